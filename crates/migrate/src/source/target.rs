//! The seam between a migration's transfer core and where its pages go: a [`Target`]. The core
//! (the session's passes, dirty bitmap, policy, limiter, hints, throttle and statistics) hands
//! a target batches of page addresses and state chunks, and ends passes on it; the target says
//! what it agreed to, how much it has written and what is still queued, what it acknowledged
//! and said meanwhile, and closes its page path after the final pass. What completes a
//! migration differs: a live destination (`live/`: TCP, TLS or Unix) takes the device state
//! and Complete and answers Resumed; a snapshot file (`snapshot::target`) takes the state into
//! its file and answers nothing.

#![forbid(unsafe_code)]

use super::ack_state::Acks;
use super::agreement::Agreement;
use crate::error::MigrateError;
use crate::stats::MigrationStats;
use crate::vm::Section;

/// Where a session's pages go.
pub(crate) trait Target {
    /// What the target agreed to (capabilities, postcopy's unit): a file agrees to precopy
    /// alone.
    fn agreement(&self) -> Agreement;

    /// Queues a batch of page addresses; the target copies the pages out of guest memory when
    /// it writes them (a page the guest changes meanwhile is dirty again, and sent again).
    fn queue_pages(&mut self, gpas: Vec<u64>) -> Result<(), MigrateError>;

    /// Ends pass `pass` after every batch queued before it.
    fn end_pass(&mut self, pass: u32) -> Result<(), MigrateError>;

    /// Pages queued and not written yet.
    fn pending_pages(&self) -> u64;

    /// Bytes written so far, for the send rate.
    fn bytes_written(&self) -> u64;

    /// The data records' page bytes and the bytes written for them so far (what
    /// [`crate::compress::WireShare`] follows); `(0, 0)` where pages are not compressed.
    fn data_totals(&self) -> (u64, u64) {
        (0, 0)
    }

    /// The bandwidth limit changed to `max` while the migration runs.
    fn max_bandwidth_changed(&mut self, _max: Option<u64>) {}

    /// The guest is about to pause for the final pass, with `dirty_pages` dirty pages as the
    /// last sync counted them.
    fn before_pause(&mut self, _dirty_pages: u64) {}

    /// The final pass was queued: writes what is queued and closes the page path, adding what
    /// it did to `stats`.
    fn close_pages(&mut self, stats: &mut MigrationStats) -> Result<(), MigrateError>;

    /// Stops everything that writes, at once (the session failed, or ended).
    fn abandon(&mut self);

    /// Tells the target why the migration failed, if it can hear it (best effort).
    fn send_ending(&mut self, _e: &MigrateError) {}

    /// The target's own account of why a write failed, if it gave one.
    fn peer_error(&mut self) -> Option<String> {
        None
    }

    /// What the target acknowledged of what it was sent, for the in-flight count and the
    /// rate the policy divides by; `None` for a target that answers nothing (a file), whose
    /// session decides on the send rate alone.
    fn acks(&self) -> Option<&Acks> {
        None
    }

    /// [`Target::acks`], to fold new acknowledgements in.
    fn acks_mut(&mut self) -> Option<&mut Acks> {
        None
    }

    /// Sends a chunk of iterative device state. Called only when the target agreed to take
    /// such chunks ([`Agreement::iterative`]), which a file never does.
    fn send_state_chunk(&mut self, chunk: &Section) -> Result<(), MigrateError> {
        let _ = chunk;
        Err(crate::error::Internal::ChunkNotAgreed.into())
    }

    /// Whether the target's devices said they are ready for the switchover (StateReady).
    fn state_ready(&self) -> bool {
        false
    }

    /// Whatever the target said since it was last asked that ends the migration (its error,
    /// a record out of order, its connection closing); looked at between any two batches.
    fn heard(&mut self) -> Result<(), MigrateError> {
        Ok(())
    }
}

/// A target that keeps what it is given and answers nothing: a snapshot file. A session to it
/// runs precopy and the final pass, resumes the guest unless [`Keeper::stops`], and ends it
/// with the device state ([`super::keep`]).
pub(crate) trait Keeper: Target {
    /// Whether the guest stays paused once its state is saved.
    fn stops(&self) -> bool;

    /// Takes the device state once the final pass was closed, and ends the target.
    fn keep(&mut self, sections: &[Section]) -> Result<(), MigrateError>;
}
