//! Where a migration is: the phases both sides report (the source's [`Phase`], the
//! destination's [`IncomingPhase`]), in the order they pass through them.
//! Plain data with no dependency in the crate, so the handle ([`crate::control`]) and the
//! figures ([`crate::stats`]) both stand on it.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    Setup,
    Precopy,
    /// Postcopy was decided and the guest still runs here: the source lists the pages it will
    /// send again after the switch, and the destination drops them (a round or a few, each
    /// waiting for the destination to apply the last). Cancelling still leaves the guest here.
    Discarding,
    /// The guest is paused here: the last pages (precopy) and the device state go out, and
    /// the destination loads them and resumes the guest.
    Switchover,
    /// The guest runs on the destination; the source sends the pages it still needs (those it
    /// asks for first). It can no longer be cancelled: the source's copy is out of date.
    Postcopy,
    /// A connection broke (or `PUT /migration/pause` broke them) in postcopy: the guest runs on
    /// the destination and waits for missing pages; the source keeps what it still has to
    /// send and waits for `ferry migrate --resume` to reconnect.
    PostcopyPaused,
    Completed,
    Failed,
    Cancelled,
}

impl Phase {
    /// Whether a migration in this phase has not ended yet.
    pub fn is_active(self) -> bool {
        !matches!(self, Phase::Completed | Phase::Failed | Phase::Cancelled)
    }

    /// Whether a cancel still leaves the guest running here with nothing lost: before the
    /// pause (QEMU's migrate_cancel in its active states).
    pub fn is_cancellable(self) -> bool {
        matches!(self, Phase::Setup | Phase::Precopy | Phase::Discarding)
    }
}

/// Where an incoming migration is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IncomingPhase {
    /// Not listening yet: the VMM readies what it needs to take pages first (preallocating
    /// guest RAM; see [`IncomingProgress::preparing`]), or has not reached its listener. A
    /// source that connects now is refused by the host and may retry (`ferry migrate` does,
    /// for its `--connect-timeout`). Where every incoming migration starts: a watcher that
    /// sees `waiting` may connect.
    #[default]
    Preparing,
    /// Listening; no source has completed a valid hello yet.
    Waiting,
    /// A source's main hello was accepted; its data channels connect.
    Handshake,
    /// Pages arrive.
    Precopy,
    /// Device state is loading and the guest is being resumed.
    Loading,
    /// The guest runs here while its remaining pages arrive (those it waits for first).
    Postcopy,
    /// A connection broke in postcopy: the guest runs here and waits for missing pages until
    /// a recovery (`ferry migrate-recover`, then `ferry migrate --resume` on the source).
    PostcopyPaused,
    /// The guest runs here.
    Completed,
    Failed,
    Cancelled,
}
