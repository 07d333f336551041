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
//! implementations), `tls.rs` (TLS as one more stream and listener), `address.rs` (addresses,
//! their errors, and the dialer with its TLS name).

#![forbid(unsafe_code)]

mod address;
mod stream;
pub mod tls;

pub use address::{Address, AddressError, Dialer};
pub use stream::{Listener, Stream};

#[cfg(test)]
mod tests;
