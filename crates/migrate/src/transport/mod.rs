//! Transports: the byte streams a migration runs over, and the listeners a destination waits
//! on. The engine speaks to any [`Stream`] (read, write, shut down, a read timeout); TCP is
//! one, a Unix socket (`unix:PATH`, for a migration between two VMMs on one host) a second,
//! and a test may add its own (a proxy that cuts or delays a connection). TLS ([`tls`]) wraps
//! either.
//!
//! [`Address`] is the one parser of the `tcp:HOST:PORT` / `unix:PATH` strings a user types;
//! a [`Dialer`] is an address and, when the migration uses it, the source's TLS.
//!
//! Floors, each standing only on those below: `stream.rs` (the traits and the TCP and Unix
//! implementations, and a Unix peer's credentials), `peer.rs` (whether a local handover may
//! give guest RAM to that peer or take it from it: `SO_PEERCRED` against the VMM's own uid and
//! the uids allowed), `unix_listen.rs` (the incoming Unix socket, 0600 by default from its
//! first instant, never over anything but a stale socket), `tls.rs` (TLS as one more stream
//! and listener), `address.rs` (addresses, their errors, and the dialer with its TLS name).

#![forbid(unsafe_code)]

mod address;
pub mod peer;
mod stream;
pub mod tls;
mod unix_listen;

pub use address::{Address, AddressError, Dialer};
pub use peer::{LocalPeerError, PeerRole};
pub use stream::{Listener, PeerCred, Stream};
pub use unix_listen::{
    DEFAULT_SOCKET_MODE, Occupant, UnixListenError, UnixSocketListener, bind as bind_unix,
};

#[cfg(test)]
mod tests;
