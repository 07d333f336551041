//! Why a migration failed, with what to do about it.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::ram::RamError;
use crate::vm::VmError;
use crate::wire::WireError;

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Address(#[from] crate::transport::AddressError),
    #[error("connection failed while {during}: {source}")]
    Io {
        during: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the peer closed the connection while {during} (the stream is truncated)")]
    Truncated { during: &'static str },
    #[error("invalid migration stream: {0}")]
    Wire(#[from] WireError),
    #[error("invalid migration stream: {0}")]
    Ram(#[from] RamError),
    #[error("invalid migration stream: {0}")]
    Order(String),
    #[error("the destination refused the migration: {0}")]
    Refused(String),
    #[error("the other side reported an error: {0}")]
    Remote(String),
    /// A connection of this side failed (its own error names the channel); the other parties
    /// stop with it.
    #[error("{0}")]
    Channel(String),
    #[error(
        "data channel {channel} ended after pass {after_pass} while pass {pass} was still being received; the source stopped mid-migration (crashed, killed, or its network broke). No guest runs here; migrate again"
    )]
    ChannelEnded {
        channel: u16,
        after_pass: u32,
        pass: u32,
    },
    #[error(
        "pass {pass} did not end on every connection within {timeout:?}; the source stalled. No guest runs here; migrate again"
    )]
    PassTimeout { pass: u32, timeout: Duration },
    #[error("the incoming migration was cancelled on the destination; no guest runs here")]
    CancelledHere,
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("migration cancelled; the source VM keeps running")]
    Cancelled,
    #[error(
        "migration did not converge within the {0:?} timeout (timeout action: cancel); the source VM keeps running. Raise --downtime-limit or --timeout, or use --timeout-action switchover"
    )]
    Timeout(Duration),
    #[error(
        "the destination did not acknowledge resuming the guest: {0}; the source stays paused because the guest may already run on the destination"
    )]
    Unacknowledged(Box<MigrateError>),
}

impl MigrateError {
    /// Maps an I/O error, telling a closed connection from other failures.
    pub fn io(during: &'static str, source: std::io::Error) -> MigrateError {
        match source.kind() {
            std::io::ErrorKind::UnexpectedEof => MigrateError::Truncated { during },
            _ => MigrateError::Io { during, source },
        }
    }
}
