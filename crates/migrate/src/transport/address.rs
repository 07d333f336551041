//! Where a migration goes: [`Address`], the one parser of the `tcp:HOST:PORT` / `unix:PATH`
//! strings a user types, its errors, and [`Dialer`], an address with the source's TLS when the
//! migration uses it (and so the name the destination must prove, [`SourceTls::name_for`]).

#![forbid(unsafe_code)]

use std::io;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;

use super::stream::{Listener, Stream};
use super::tls::{SourceTls, TlsError, parse_name};
use super::unix_listen::{self, DEFAULT_SOCKET_MODE, UnixListenError};

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
    /// The Unix socket could not be made, or its path holds something that is kept.
    #[error(transparent)]
    UnixSocket(#[from] UnixListenError),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(a) => write!(f, "tcp:{a}"),
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Whether `a` is `HOST:PORT`: a host, and a port that is a number.
fn host_port(a: &str) -> bool {
    a.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
}

/// `tcp:HOST:PORT`, `unix:PATH`, or a bare `HOST:PORT` (TCP), as the API takes them: a bare
/// host holds no `:` unless bracketed (`[::1]:4444`), so `udp:h:1` is not read as a host.
impl std::str::FromStr for Address {
    type Err = AddressError;
    fn from_str(s: &str) -> Result<Address, AddressError> {
        if let Some(a) = s.strip_prefix("tcp:")
            && host_port(a)
        {
            return Ok(Address::Tcp(a.to_string()));
        }
        if !s.starts_with("tcp:")
            && !s.starts_with("unix:")
            && host_port(s)
            && s.rsplit_once(':')
                .is_some_and(|(h, _)| !h.contains(':') || h.starts_with('['))
        {
            return Ok(Address::Tcp(s.to_string()));
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

    /// Listens on this address, a Unix socket with [`DEFAULT_SOCKET_MODE`].
    pub fn listen(&self) -> Result<Box<dyn Listener>, AddressError> {
        self.listen_with_mode(DEFAULT_SOCKET_MODE)
    }

    /// Listens on this address; a Unix socket gets permission bits `socket_mode` from its
    /// first instant, whatever the umask. A Unix socket left by a dead process is replaced;
    /// anything else at the path (a file, a directory, a socket a live process listens on) is
    /// refused and kept (`unix_listen.rs`).
    pub fn listen_with_mode(&self, socket_mode: u32) -> Result<Box<dyn Listener>, AddressError> {
        let err = |source| AddressError::Listen {
            address: self.to_string(),
            source,
        };
        match self {
            Address::Tcp(a) => Ok(Box::new(TcpListener::bind(a).map_err(err)?)),
            Address::Unix(p) => Ok(Box::new(unix_listen::bind(p, socket_mode)?)),
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

impl SourceTls {
    /// The name the destination at `to` must prove it holds.
    pub fn name_for(&self, to: &Address) -> Result<ServerName<'static>, TlsError> {
        if let Some(n) = &self.name {
            return Ok(n.clone());
        }
        match to {
            Address::Tcp(a) => {
                let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
                parse_name(host.trim_start_matches('[').trim_end_matches(']'))
            }
            Address::Unix(_) => Err(TlsError::NeedsName(to.to_string())),
        }
    }
}
