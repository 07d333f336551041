//! Why a migration failed, with what to do about it.
//!
//! [`MigrateError`] is one enum so that `?` works across the engine, but its variants fall into
//! kinds a caller acts on differently ([`MigrateError::kind`]): a **protocol** error means the
//! peer sent what the protocol forbids ([`ProtocolError`]: a bad header, an address outside RAM,
//! records out of order); a **configuration** error means the request cannot work as given
//! ([`ConfigError`]: fix it and ask again); the **transport**, the **peer**, the **VM** and a
//! **cancel** are what they say; **internal** is a bug in ferry (a thread that panicked).

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::ram::RamError;
use crate::vm::VmError;
use crate::wire::WireError;

/// What kind of failure a [`MigrateError`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The peer broke the protocol; nothing was applied that could harm the VM.
    Protocol,
    /// The request cannot work as given; fix it.
    Configuration,
    /// A connection failed or closed.
    Transport,
    /// The peer refused, reported an error, or stopped mid-migration.
    Peer,
    /// The VMM failed an operation the engine asked for.
    Vm,
    /// Someone cancelled, or a timeout with the cancel action ran out.
    Cancelled,
    /// A bug in ferry.
    Internal,
}

mod config;
mod internal;
mod protocol;

pub use config::ConfigError;
pub use internal::Internal;
pub use protocol::{Bound, Connection, ProtocolError, Rule, Twice};

/// Which end of a migration said something.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("invalid migration stream: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("invalid migration request: {0}")]
    Config(#[from] ConfigError),
    /// The destination could not be reached (nothing listens, TLS failed): the request may
    /// be fine, the peer is not there.
    #[error(transparent)]
    Connect(crate::transport::AddressError),
    #[error("connection failed while {during}: {source}")]
    Io {
        during: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the peer took or sent nothing for longer than the timeout while {during}: it is stopped, overloaded or unreachable"
    )]
    Stalled { during: &'static str },
    #[error("the peer closed the connection while {during} (the stream is truncated)")]
    Truncated { during: &'static str },
    #[error("the destination refused the migration: {0}")]
    Refused(String),
    /// A local handover's peer runs as a uid that may not take (or give) guest RAM; refused
    /// before any descriptor moved.
    #[error(transparent)]
    LocalPeer(#[from] crate::transport::LocalPeerError),
    /// An Error record from the peer: its own words, with who said them (an error this side
    /// detected is never one).
    #[error("the {0} reported an error: {1}")]
    Remote(Side, String),
    /// An Error record that says its sayer cancelled the migration (`wire::ERROR_CANCELLED`):
    /// an operator's choice there, not a failure.
    #[error("the {0} cancelled the migration: {1}")]
    CancelledThere(Side, String),
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
    /// A snapshot file could not be written, or read for a restore.
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
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
    #[error(
        "the migration was given up while postcopy-paused: the guest was resumed on the source by force (ferry resume --risk-running-twice)"
    )]
    GivenUp,
    #[error("internal error in ferry (please report it): {0}")]
    Internal(#[from] Internal),
    /// The postcopy fault thread's failure, as the thread waiting for the last page sees it.
    #[error("internal error in ferry (please report it): the fault thread: {0}")]
    FaultThread(#[source] std::sync::Arc<MigrateError>),
}

impl From<WireError> for MigrateError {
    fn from(e: WireError) -> Self {
        MigrateError::Protocol(e.into())
    }
}

impl From<crate::uffd::UffdError> for MigrateError {
    fn from(e: crate::uffd::UffdError) -> Self {
        MigrateError::Internal(e.into())
    }
}

impl From<RamError> for MigrateError {
    fn from(e: RamError) -> Self {
        MigrateError::Protocol(e.into())
    }
}

impl From<crate::transport::AddressError> for MigrateError {
    fn from(e: crate::transport::AddressError) -> Self {
        use crate::transport::AddressError as A;
        match e {
            A::Connect { .. } | A::Tls { .. } => MigrateError::Connect(e),
            e => MigrateError::Config(e.into()),
        }
    }
}

/// Why a destination of another RAM size cannot take the guest, and the fix.
pub(crate) fn memory_sizes_differ(source: u64, destination: u64) -> String {
    format!(
        "guest memory sizes differ (source {}, destination {}); start the destination with the same --memory",
        crate::ram::Size(source),
        crate::ram::Size(destination)
    )
}

impl MigrateError {
    /// A record of kind `got` that broke the record order's `rule`.
    pub fn misplaced(got: crate::wire::Kind, rule: Rule) -> MigrateError {
        MigrateError::Protocol(ProtocolError::Misplaced { got, rule })
    }

    pub fn kind(&self) -> ErrorKind {
        use MigrateError as E;
        match self {
            E::Protocol(_) => ErrorKind::Protocol,
            E::Config(_) => ErrorKind::Configuration,
            E::Io { .. } | E::Truncated { .. } | E::Connect(_) => ErrorKind::Transport,
            E::Refused(_)
            | E::LocalPeer(_)
            | E::Remote(..)
            | E::ChannelEnded { .. }
            | E::PassTimeout { .. }
            | E::Stalled { .. }
            | E::Unacknowledged(_) => ErrorKind::Peer,
            // A sibling connection's failure: its own error carries the kind.
            E::Channel(_) => ErrorKind::Peer,
            E::Vm(_) => ErrorKind::Vm,
            // The file could not be written or read: its storage failed.
            E::Snapshot(crate::snapshot::SnapshotError::Io { .. }) => ErrorKind::Transport,
            // The file is not a snapshot this VM can take.
            E::Snapshot(_) => ErrorKind::Protocol,
            E::Cancelled
            | E::CancelledHere
            | E::CancelledThere(..)
            | E::Timeout(_)
            | E::GivenUp => ErrorKind::Cancelled,
            E::Internal(_) | E::FaultThread(_) => ErrorKind::Internal,
        }
    }

    /// The peer's Error record `h` with its `payload`, said by `side`: a cancel there, or its
    /// failure.
    pub(crate) fn from_peer(side: Side, h: &crate::wire::Header, payload: &[u8]) -> MigrateError {
        let message = String::from_utf8_lossy(payload).into_owned();
        match h.count {
            crate::wire::ERROR_CANCELLED => MigrateError::CancelledThere(side, message),
            _ => MigrateError::Remote(side, message),
        }
    }

    /// Whether a connection broke (failed, closed, stalled, a data channel ended early): what
    /// postcopy recovery recovers from, on either side.
    pub fn is_broken_connection(&self) -> bool {
        matches!(
            self,
            MigrateError::Io { .. }
                | MigrateError::Truncated { .. }
                | MigrateError::Stalled { .. }
                | MigrateError::Channel(_)
                | MigrateError::ChannelEnded { .. }
        )
    }

    /// Whether the peer said this (it is not sent back to it).
    pub fn from_the_peer(&self) -> bool {
        matches!(
            self,
            MigrateError::Remote(..) | MigrateError::CancelledThere(..)
        )
    }

    /// Maps an I/O error, telling a closed connection from other failures.
    pub fn io(during: &'static str, source: std::io::Error) -> MigrateError {
        match source.kind() {
            std::io::ErrorKind::UnexpectedEof => MigrateError::Truncated { during },
            // What a socket timeout returns (EAGAIN on Linux).
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                MigrateError::Stalled { during }
            }
            _ => MigrateError::Io { during, source },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_cause() {
        let table: &[(MigrateError, ErrorKind, &str)] = &[
            (
                WireError::UnknownKind(9).into(),
                ErrorKind::Protocol,
                "invalid migration stream: unknown record kind 9",
            ),
            (
                MigrateError::misplaced(crate::wire::Kind::Pages, Rule::MainChannel),
                ErrorKind::Protocol,
                "invalid migration stream: Pages record on the main channel",
            ),
            (
                ConfigError::Channels { asked: 0, max: 64 }.into(),
                ErrorKind::Configuration,
                "invalid migration request: 0 channels",
            ),
            (
                "nonsense"
                    .parse::<crate::transport::Address>()
                    .unwrap_err()
                    .into(),
                ErrorKind::Configuration,
                "invalid migration request",
            ),
            (
                MigrateError::io("sending", std::io::ErrorKind::UnexpectedEof.into()),
                ErrorKind::Transport,
                "closed the connection while sending",
            ),
            (
                // A write or read that hit its socket timeout: a stalled peer.
                MigrateError::io("sending pages", std::io::ErrorKind::WouldBlock.into()),
                ErrorKind::Peer,
                "took or sent nothing for longer than the timeout while sending pages",
            ),
            (
                MigrateError::Remote(Side::Destination, "x".into()),
                ErrorKind::Peer,
                "the destination reported an error: x",
            ),
            (MigrateError::Cancelled, ErrorKind::Cancelled, "cancelled"),
            (
                Internal::Panicked {
                    thread: "a sender thread",
                }
                .into(),
                ErrorKind::Internal,
                "please report it",
            ),
        ];
        for (e, kind, text) in table {
            assert_eq!(e.kind(), *kind, "{e}");
            assert!(e.to_string().contains(text), "{e}");
        }
    }
}
