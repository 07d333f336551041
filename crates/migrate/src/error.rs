//! Why a migration failed, with what to do about it.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::ram::RamError;
use crate::vm::VmError;
use crate::wire::WireError;

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(
        "cannot connect to the destination {addr}: {source}; is `ferry run --incoming tcp:{addr}` waiting there?"
    )]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
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
