//! What the policy observes ([`Session::observe`]) and what the destination has taken in, as
//! the source uses it: the acknowledged byte count from the reader thread (kept in
//! `ack_state.rs`), the rate at which the destination absorbs data, what is still in flight,
//! the observation the policy decides on, and the drain the policy may ask for.
//!
//! Without acknowledgements (a destination that did not grant the progress capability, or one
//! that granted it and then said nothing through a whole drain) the source falls back to what
//! it measured before: the send rate, and nothing counted in flight.
//!
//! Invariant: a drain sends nothing, is bounded by [`policy::drain_bound`], and looks at
//! cancellation and at the destination's records every [`DRAIN_POLL`].

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::ack_state::{AckUse, Acks};
use super::target::Target;
use super::{Session, ms};
use crate::control::Phase;
use crate::error::MigrateError;
use crate::policy::{self, Observation, TimeoutAction};
use crate::wire::{HELLO_SIZE, PAGE_SIZE};

/// How often a drain looks at the acknowledgements: a tenth of the destination's interval.
const DRAIN_POLL: Duration = Duration::from_millis(1);
/// What a page queued on a sender costs once written: its address and its data (a zero page
/// costs less; counting it in full only makes the source wait a little longer).
const BYTES_PER_PAGE: u64 = 8 + PAGE_SIZE;

impl<P: Target> Session<'_, P> {
    /// Folds a new acknowledgement, if one came, into the absorption window.
    pub(super) fn note_acks(&mut self) {
        if let Some(acks) = self.peer.acks_mut() {
            acks.note();
        }
    }

    /// Record bytes sent on every connection (the hellos are not counted on either side) and
    /// the pages still queued on the senders, at their full cost.
    fn bytes_committed(&self) -> u64 {
        self.bytes_written().saturating_sub(HELLO_SIZE as u64)
            + self.peer.pending_pages() * BYTES_PER_PAGE
    }

    /// Bytes sent or queued that the destination has not acknowledged; 0 without
    /// acknowledgements.
    pub(super) fn in_flight(&self) -> u64 {
        self.peer
            .acks()
            .map_or(0, |acks| acks.in_flight(self.bytes_committed()))
    }

    /// The rate the policy divides by: what the destination absorbs, once acknowledgements
    /// have measured it, else the send rate.
    pub(super) fn rate(&self) -> f64 {
        self.peer
            .acks()
            .and_then(Acks::absorbed_rate)
            .unwrap_or_else(|| self.link.bandwidth.rate())
    }

    /// Something is about to be handed to the channels: both rate clocks run again (see
    /// `bandwidth.rs`: time with nothing to carry is not the link's).
    pub(super) fn link_busy(&mut self) {
        let now = Instant::now();
        self.link.bandwidth.busy(now, self.bytes_written());
        let walked = self.walked_bytes();
        self.link.walk.busy(now, walked);
        if let Some(acks) = self.peer.acks_mut() {
            acks.absorbed.busy(now, acks.acked);
        }
    }

    /// Page bytes the senders finished so far, data or zero (the walk's rate counts them):
    /// the pages the session handed over less those pending. Never less than last time (pages
    /// the preempt connection's reader queues itself are pending but not handed here).
    pub(super) fn walked_bytes(&mut self) -> u64 {
        let done = self
            .link
            .handed_pages
            .saturating_sub(self.peer.pending_pages())
            * PAGE_SIZE;
        self.link.walked = self.link.walked.max(done);
        self.link.walked
    }

    /// Stops a rate clock whose pipeline is empty: the senders wrote every page queued on
    /// them (the send rate), the destination acknowledged everything written (its rate).
    fn note_idle(&mut self) {
        let now = Instant::now();
        if self.peer.pending_pages() == 0 {
            self.link.bandwidth.idle(now, self.bytes_written());
            let walked = self.walked_bytes();
            self.link.walk.idle(now, walked);
        }
        let in_flight = self.in_flight();
        if let Some(acks) = self.peer.acks_mut()
            && acks.use_ == AckUse::Live
            && in_flight == 0
        {
            acks.absorbed.idle(now, acks.acked);
        }
    }

    /// What the policy decides on, now.
    pub(super) fn observe(&mut self) -> Observation {
        self.note_acks();
        self.note_idle();
        Observation {
            // Compressed, what is left costs the link what data pages lately did.
            remaining_bytes: ((self.bitmap.count() * PAGE_SIZE) as f64 * self.wire_share()) as u64
                + self.pending_state(),
            in_flight_bytes: self.in_flight(),
            bandwidth: self.rate(),
            elapsed: self.report.start.elapsed(),
            stalled_passes: self.converge.stalled_passes,
            throttle: self.converge.throttle,
            dirty_limit: self.converge.dirty_limit,
            postcopy_granted: self.peer.agreement().postcopy,
            postcopy_on_stall: self.params.postcopy().is_some_and(|p| p.on_stall),
            switchover_ready: self.switchover_ready(),
        }
    }

    /// Waits, sending nothing, until what is in flight has settled (or, when no rate was
    /// measured yet, until one is) or [`policy::drain_bound`] passed. A drain through which the destination acknowledged nothing at all means it does
    /// not acknowledge: the source stops counting on it.
    pub(super) fn drain(&mut self, now: &Observation) -> Result<(), MigrateError> {
        let started = Instant::now();
        let deadline = started + policy::drain_bound(now);
        let acked = |s: &Self| s.peer.acks().map_or(0, Acks::acked);
        let acked_before = acked(self);
        loop {
            self.check_control()?;
            let o = self.observe();
            // A drain for want of a rate ends once one is measured: the loop decides again.
            if o.settled() || (now.bandwidth <= 0.0 && o.bandwidth > 0.0) {
                break;
            }
            if Instant::now() >= deadline {
                self.report.stats.drain_timeouts += 1;
                if acked(self) == acked_before
                    && let Some(acks) = self.peer.acks_mut()
                {
                    tracing::warn!(
                        "the destination acknowledged nothing for {:?}; deciding on the send rate from now on",
                        policy::drain_bound(now)
                    );
                    acks.use_ = AckUse::Stalled;
                }
                break;
            }
            std::thread::sleep(DRAIN_POLL);
        }
        self.report.stats.drain_ms += ms(started.elapsed());
        Ok(())
    }

    /// Cancellation, a timeout whose action is to cancel, and whatever the destination said
    /// that ends the migration (its Error, a record out of order, its connection closing) —
    /// looked at between any two batches, so that a pass of minutes does not outlive a
    /// maintenance window. (A timeout that switches over or to postcopy acts at the pass end:
    /// the pages of a pass cut short would have to be put back first.)
    pub(super) fn check_control(&mut self) -> Result<(), MigrateError> {
        let now = Instant::now();
        if let Some(last) = self.report.last_check.replace(now) {
            self.report.stats.max_step_ms = self.report.stats.max_step_ms.max(ms(now - last));
        }
        if self.control.cancelled() {
            return Err(MigrateError::Cancelled);
        }
        self.retune();
        let policy = &self.params.policy;
        if let Some(t) = policy.timeout.filter(|&t| {
            self.report.phase == Phase::Precopy
                && policy.timeout_action == TimeoutAction::Cancel
                && self.report.start.elapsed() >= t
        }) {
            return Err(MigrateError::Timeout(t));
        }
        self.peer.heard()
    }
}
