//! Transports: the byte streams a migration runs over, and the listeners a destination waits
//! on. The engine speaks to any [`Stream`] (read, write, shut down, a read timeout); TCP is
//! one, a Unix socket (`unix:PATH`, for a migration between two VMMs on one host) a second,
//! and a test may add its own (a proxy that cuts or delays a connection). TLS ([`tls`]) wraps
//! either.
//!
//! [`Address`] is the one parser of the `tcp:HOST:PORT` / `unix:PATH` strings a user types;
//! a [`Dialer`] is an address and, when the migration uses it, the source's TLS.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod tls;

use tls::{SourceTls, TlsError};

/// A connection of a migration.
pub trait Stream: Read + Write + Send + std::fmt::Debug {
    /// A second handle to the same connection (one thread reads while another writes).
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>>;
    /// Shuts down one or both directions; a blocked read on any handle returns.
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    /// Bounds every later read (`None`: no bound).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Bounds every later write on any handle of the connection (`None`: no bound): a peer
    /// that stops reading cannot hold a writer forever.
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Who is on the other end, for logs and progress.
    fn peer(&self) -> String;
    /// Sends small writes at once (TCP: no Nagle delay); records are already written whole
    /// through a buffer, and a pass end or a Resumed must not wait for an acknowledgement.
    fn set_low_latency(&self) -> io::Result<()>;
    /// Marks the connection's packets urgent for the queues that look: `SO_PRIORITY` 6
    /// (`TC_PRIO_INTERACTIVE`, what a `prio` qdisc serves first) and DSCP EF (expedited
    /// forwarding, for routers that honour it). Postcopy's preempt connection.
    fn set_urgent(&self) -> io::Result<()>;
    /// Notices a peer that vanished without a word (no FIN, no reset: a cable pulled, a host
    /// gone) within about `within` even while nothing is written: TCP keepalive probes and
    /// `TCP_USER_TIMEOUT`. `None`, or a connection that is not TCP: nothing to do.
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        let _ = within;
        Ok(())
    }
    /// Whether the peer closed the connection (or it broke), judged without blocking and
    /// without consuming anything: for a side that waits elsewhere while it is not reading.
    fn hung_up(&self) -> bool {
        false
    }
}

/// A socket's end of file or error, seen by peeking one byte without waiting.
fn socket_hung_up(fd: std::os::fd::RawFd) -> bool {
    use nix::sys::socket::{MsgFlags, recv};
    let mut byte = [0u8; 1];
    match recv(fd, &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e != nix::errno::Errno::EAGAIN && e != nix::errno::Errno::EINTR,
    }
}

/// `SO_PRIORITY` of urgent traffic: `TC_PRIO_INTERACTIVE`, the highest an unprivileged socket
/// may set, which the default priomap of a `prio` qdisc puts in band 0.
const URGENT_PRIORITY: i32 = 6;
/// DSCP EF (46) in the TOS byte: the per-hop behaviour for low-latency traffic (RFC 3246).
const URGENT_TOS: i32 = 46 << 2;

/// Where a destination waits for connections.
pub trait Listener: Send + Sync + std::fmt::Debug {
    /// The next connection, or `None` when none arrived within `wait`.
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>>;
    /// The address sources connect to, as a user would write it.
    fn local(&self) -> String;
}

impl Stream for TcpStream {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
    fn peer(&self) -> String {
        self.peer_addr()
            .map_or_else(|_| "tcp:?".into(), |a| format!("tcp:{a}"))
    }
    fn set_low_latency(&self) -> io::Result<()> {
        self.set_nodelay(true)
    }
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        let Some(within) = within else {
            return Ok(());
        };
        // Idle for a third of the bound, then a probe every sixth, four unanswered ending it;
        // unacknowledged data ends it after the whole bound.
        let secs = within.as_secs().max(3);
        let idle = u32::try_from(secs / 3).unwrap_or(u32::MAX).max(1);
        let interval = u32::try_from(secs / 6).unwrap_or(u32::MAX).max(1);
        setsockopt(self, sockopt::KeepAlive, &true)?;
        setsockopt(self, sockopt::TcpKeepIdle, &idle)?;
        setsockopt(self, sockopt::TcpKeepInterval, &interval)?;
        setsockopt(self, sockopt::TcpKeepCount, &4)?;
        let ms = u32::try_from(within.as_millis()).unwrap_or(u32::MAX);
        setsockopt(self, sockopt::TcpUserTimeout, &ms)?;
        Ok(())
    }
    fn set_urgent(&self) -> io::Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        // The TOS first: setting it also sets the priority from its bits, which the explicit
        // priority then overrides.
        match self.local_addr()? {
            std::net::SocketAddr::V4(_) => setsockopt(self, sockopt::Ipv4Tos, &URGENT_TOS)?,
            std::net::SocketAddr::V6(_) => setsockopt(self, sockopt::Ipv6TClass, &URGENT_TOS)?,
        }
        setsockopt(self, sockopt::Priority, &URGENT_PRIORITY)?;
        Ok(())
    }
    fn hung_up(&self) -> bool {
        socket_hung_up(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

impl Stream for UnixStream {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
    fn peer(&self) -> String {
        "unix:(local peer)".into()
    }
    fn set_low_latency(&self) -> io::Result<()> {
        Ok(()) // a Unix socket delivers every write at once
    }
    fn set_urgent(&self) -> io::Result<()> {
        Ok(()) // no queue to jump
    }
    fn hung_up(&self) -> bool {
        socket_hung_up(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

impl Stream for Box<dyn Stream> {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        (**self).try_clone_stream()
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        (**self).shutdown(how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_read_timeout(timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_write_timeout(timeout)
    }
    fn peer(&self) -> String {
        (**self).peer()
    }
    fn set_low_latency(&self) -> io::Result<()> {
        (**self).set_low_latency()
    }
    fn set_urgent(&self) -> io::Result<()> {
        (**self).set_urgent()
    }
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        (**self).set_keepalive(within)
    }
    fn hung_up(&self) -> bool {
        (**self).hung_up()
    }
}

/// How often a listener looks for a new connection while it waits: a connection waits at most
/// this long to be taken, and an idle destination wakes 200 times a second (no measurable CPU).
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// Non-blocking accepts, polled until `wait` has passed.
fn accept_polling<S>(
    wait: Duration,
    mut accept: impl FnMut() -> io::Result<S>,
) -> io::Result<Option<S>> {
    let deadline = Instant::now() + wait;
    loop {
        match accept() {
            Ok(s) => return Ok(Some(s)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(ACCEPT_POLL.min(deadline - now));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// An accepted connection made blocking again (it inherits the polling listener's mode).
fn blocking<S: Stream + 'static>(
    got: Option<S>,
    set_nonblocking: fn(&S, bool) -> io::Result<()>,
) -> io::Result<Option<Box<dyn Stream>>> {
    got.map(|s| {
        set_nonblocking(&s, false)?;
        Ok(Box::new(s) as Box<dyn Stream>)
    })
    .transpose()
}

impl Listener for TcpListener {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        self.set_nonblocking(true)?;
        let got = accept_polling(wait, || self.accept().map(|(s, _)| s))?;
        blocking(got, TcpStream::set_nonblocking)
    }
    fn local(&self) -> String {
        self.local_addr()
            .map_or_else(|_| "tcp:?".into(), |a| format!("tcp:{a}"))
    }
}

impl Listener for UnixListener {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        self.set_nonblocking(true)?;
        let got = accept_polling(wait, || self.accept().map(|(s, _)| s))?;
        blocking(got, UnixStream::set_nonblocking)
    }
    fn local(&self) -> String {
        self.local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(|p| format!("unix:{}", p.display())))
            .unwrap_or_else(|| "unix:?".into())
    }
}

/// A migration address as the user writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// `tcp:HOST:PORT`
    Tcp(String),
    /// `unix:PATH`
    Unix(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    #[error(
        "'{0}' is not a migration address; write tcp:HOST:PORT (e.g. tcp:127.0.0.1:4444) or unix:PATH"
    )]
    Syntax(String),
    #[error(
        "cannot connect to {address}: {source}; is `ferry run --incoming {address}` waiting there?"
    )]
    Connect {
        address: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot set up TLS with {address}: {source}")]
    Tls {
        address: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    TlsConfig(#[from] TlsError),
    #[error("cannot listen on {address}: {source}; choose another address or stop what holds it")]
    Listen {
        address: String,
        #[source]
        source: io::Error,
    },
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(a) => write!(f, "tcp:{a}"),
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl std::str::FromStr for Address {
    type Err = AddressError;
    fn from_str(s: &str) -> Result<Address, AddressError> {
        if let Some(a) = s.strip_prefix("tcp:")
            && a.rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        {
            return Ok(Address::Tcp(a.to_string()));
        }
        if let Some(p) = s.strip_prefix("unix:")
            && !p.is_empty()
        {
            return Ok(Address::Unix(p.into()));
        }
        Err(AddressError::Syntax(s.to_string()))
    }
}

impl Address {
    /// Opens a connection, giving up after `timeout` (TCP) .
    pub fn connect(&self, timeout: Duration) -> Result<Box<dyn Stream>, AddressError> {
        let err = |source| AddressError::Connect {
            address: self.to_string(),
            source,
        };
        match self {
            Address::Tcp(a) => {
                let addr = a
                    .to_socket_addrs()
                    .map_err(err)?
                    .next()
                    .ok_or_else(|| err(io::Error::other("the address resolves to nothing")))?;
                Ok(Box::new(
                    TcpStream::connect_timeout(&addr, timeout).map_err(err)?,
                ))
            }
            Address::Unix(p) => Ok(Box::new(UnixStream::connect(p).map_err(err)?)),
        }
    }

    /// Listens on this address. A Unix socket file left by a dead process is replaced; one a
    /// live process listens on is not.
    pub fn listen(&self) -> Result<Box<dyn Listener>, AddressError> {
        let err = |source| AddressError::Listen {
            address: self.to_string(),
            source,
        };
        match self {
            Address::Tcp(a) => Ok(Box::new(TcpListener::bind(a).map_err(err)?)),
            Address::Unix(p) => {
                if p.exists() && UnixStream::connect(p).is_err() {
                    let _ = std::fs::remove_file(p);
                }
                Ok(Box::new(UnixListener::bind(p).map_err(err)?))
            }
        }
    }
}

/// How a source reaches its destination: the address, and the TLS every connection runs
/// (the main, data, preempt and recovery connections alike) when the migration uses it.
#[derive(Clone, Debug)]
pub struct Dialer {
    address: Address,
    tls: Option<(Arc<SourceTls>, rustls::pki_types::ServerName<'static>)>,
}

impl Dialer {
    /// Connections to `address`, through `tls` when given; fails at once when TLS cannot know
    /// which name the destination must prove (a Unix socket without `--tls-name`).
    pub fn new(address: Address, tls: Option<Arc<SourceTls>>) -> Result<Dialer, TlsError> {
        let tls = tls
            .map(|t| t.name_for(&address).map(|name| (t, name)))
            .transpose()?;
        Ok(Dialer { address, tls })
    }

    pub fn address(&self) -> &Address {
        &self.address
    }

    /// Whether the connections run TLS.
    pub fn secured(&self) -> bool {
        self.tls.is_some()
    }

    /// Opens a connection and, with TLS, completes its handshake, each within `timeout`.
    pub fn connect(&self, timeout: Duration) -> Result<Box<dyn Stream>, AddressError> {
        let stream = self.address.connect(timeout)?;
        match &self.tls {
            None => Ok(stream),
            Some((tls, name)) => Ok(Box::new(
                tls.secure(stream, name.clone(), timeout)
                    .map_err(|source| AddressError::Tls {
                        address: self.address.to_string(),
                        source,
                    })?,
            )),
        }
    }
}

impl From<Address> for Dialer {
    /// Plain connections to `address`.
    fn from(address: Address) -> Dialer {
        Dialer { address, tls: None }
    }
}

impl<L: Listener + ?Sized> Listener for Box<L> {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        (**self).accept_within(wait)
    }
    fn local(&self) -> String {
        (**self).local()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A silently lost peer (no FIN, no reset) used to be seen only when a write timed out,
    /// or after the 600 s record timeout on a reader.
    #[test]
    fn regression_a_migration_connection_probes_a_silent_peer_within_its_peer_timeout() {
        use nix::sys::socket::{getsockopt, sockopt};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        s.set_keepalive(Some(Duration::from_secs(30))).unwrap();
        assert!(getsockopt(&s, sockopt::KeepAlive).unwrap());
        assert_eq!(getsockopt(&s, sockopt::TcpKeepIdle).unwrap(), 10);
        assert_eq!(getsockopt(&s, sockopt::TcpKeepInterval).unwrap(), 5);
        assert_eq!(getsockopt(&s, sockopt::TcpKeepCount).unwrap(), 4);
        assert_eq!(getsockopt(&s, sockopt::TcpUserTimeout).unwrap(), 30_000);
        let boxed: Box<dyn Stream> = Box::new(l.accept().unwrap().0);
        boxed.set_keepalive(Some(Duration::from_secs(5))).unwrap();
    }

    #[test]
    fn addresses_parse_and_print_back() {
        for ok in [
            "tcp:127.0.0.1:4444",
            "tcp:[::1]:80",
            "tcp:host:1",
            "unix:/run/x.sock",
        ] {
            let a: Address = ok.parse().unwrap();
            assert_eq!(a.to_string(), ok);
        }
        for bad in [
            "127.0.0.1:4444",
            "tcp:4444",
            "tcp:h:port",
            "unix:",
            "udp:h:1",
            "",
        ] {
            let e = bad.parse::<Address>().unwrap_err().to_string();
            assert!(
                e.contains("tcp:HOST:PORT") && e.contains("unix:PATH"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn an_urgent_tcp_connection_carries_priority_6_and_dscp_ef() {
        use nix::sys::socket::{getsockopt, sockopt};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert_eq!(getsockopt(&c, sockopt::Priority).unwrap(), 0);
        Stream::set_urgent(&c).unwrap();
        assert_eq!(getsockopt(&c, sockopt::Priority).unwrap(), URGENT_PRIORITY);
        assert_eq!(getsockopt(&c, sockopt::Ipv4Tos).unwrap(), 0xb8);
    }

    #[test]
    fn a_connection_is_hung_up_once_its_peer_closed_and_not_while_data_waits() {
        let dir = tempfile::tempdir().unwrap();
        for a in [
            "tcp:127.0.0.1:0".parse::<Address>().unwrap(),
            Address::Unix(dir.path().join("h.sock")),
        ] {
            let l = a.listen().unwrap();
            let at: Address = l.local().parse().unwrap();
            let mut c = at.connect(Duration::from_secs(1)).unwrap();
            let mut s = l.accept_within(Duration::from_secs(1)).unwrap().unwrap();
            assert!(!s.hung_up(), "{a}: a fresh connection");
            c.write_all(b"x").unwrap();
            drop(c);
            std::thread::sleep(Duration::from_millis(20));
            assert!(!s.hung_up(), "{a}: a byte still waits to be read");
            let mut b = [0; 1];
            s.read_exact(&mut b).unwrap();
            assert!(s.hung_up(), "{a}: the peer closed");
        }
    }

    #[test]
    fn a_unix_listener_accepts_and_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let a = Address::Unix(dir.path().join("m.sock"));
        let l = a.listen().unwrap();
        assert!(
            l.accept_within(Duration::from_millis(20))
                .unwrap()
                .is_none()
        );
        let mut c = a.connect(Duration::from_secs(1)).unwrap();
        let mut s = l.accept_within(Duration::from_secs(1)).unwrap().unwrap();
        c.write_all(b"hi").unwrap();
        let mut b = [0; 2];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hi");
        assert_eq!(l.local(), a.to_string());
    }
}
