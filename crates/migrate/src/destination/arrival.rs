//! What every connection into a destination starts with, below the screening (`listen.rs`)
//! and the session that both use it: the hello read within its time bound, a connection that
//! sent one ([`Arrival`]), where a session's data connections come from ([`Arrivals`]), and the
//! time bounds of the receiving side.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::error::MigrateError;
use crate::transport::Stream;
use crate::wire::{HELLO_SIZE, Hello};

/// How long the destination waits for the next record on a connection before it gives up on
/// a silent source. Generous: the main channel is quiet while a long pass runs on the data
/// channels (a pass is bounded by the migration's own timeout, at most minutes).
pub const RECORD_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the announced data channels have to connect after the main hello.
pub const CHANNEL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new connection has to send its hello: a source sends it at once, so 10 s is
/// only ever reached by something that is not a source (a port scanner, an idle client).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection that has sent its hello.
#[derive(Debug)]
pub struct Arrival {
    pub stream: Box<dyn Stream>,
    pub hello: Hello,
}

/// Where a session's data connections come from.
pub trait Arrivals {
    /// The next connection with its hello; `None` once `deadline` passed without one.
    fn next(&mut self, deadline: Instant) -> Result<Option<Arrival>, MigrateError>;
    /// Every announced channel is connected: later connections are not this session's.
    fn close(&mut self);
}

/// Reads a hello unbuffered (whatever follows it belongs to the connection's reader), within
/// `timeout`.
pub fn read_hello(stream: &mut dyn Stream, timeout: Duration) -> Result<Hello, MigrateError> {
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| MigrateError::io("reading the hello", e))?;
    let mut raw = [0u8; HELLO_SIZE];
    std::io::Read::read_exact(stream, &mut raw)
        .map_err(|e| MigrateError::io("reading the hello", e))?;
    if crate::transport::tls::looks_like_tls(&raw) {
        return Err(crate::error::ProtocolError::TlsInsteadOfHello.into());
    }
    Ok(Hello::decode(&raw)?)
}
