//! What the session hands the prediction (`crate::predict`) at a pass end: the figures it
//! measured, the ways the user allowed and who chooses among them.
//!
//! Invariant: the link's rate is handed over only once its window carried
//! [`MEASURED_BYTES`] (a rate measured over a few KB of zero runs predicts nothing), and no
//! faster than the cap in force.

#![forbid(unsafe_code)]

use super::Session;
use super::target::Target;
use crate::policy::Observation;
use crate::predict::{self, Allowed, Choose, Measured, Prediction};
use crate::wire::PAGE_SIZE;

/// Bytes the send rate's window must have carried before a figure is predicted from it:
/// 1 MiB, what a few hundred data pages make; a window of zero runs carries KBs.
pub(super) const MEASURED_BYTES: u64 = 1 << 20;

impl<P: Target> Session<'_, P> {
    /// The link's rate as the policy observed it, once measured, capped by the limit in force.
    pub(super) fn measured_rate(&self, now: &Observation) -> Option<f64> {
        let cap = self
            .params
            .max_bandwidth
            .map_or(f64::INFINITY, |c| c as f64);
        (self.link.bandwidth.window_bytes() >= MEASURED_BYTES && now.bandwidth > 0.0)
            .then(|| now.bandwidth.min(cap))
    }

    /// Predicts each allowed way to finish from pass `pass`'s end, observed as `now`, with
    /// the guest dirtying `dirty_rate` pages per second.
    pub(super) fn forecast(
        &self,
        pass: u32,
        now: &Observation,
        dirty_rate: f64,
    ) -> Option<Prediction> {
        let measured = Measured {
            pass,
            remaining_bytes: now.remaining_bytes,
            in_flight_bytes: now.in_flight_bytes,
            rate: self.measured_rate(now),
            dirty_rate: dirty_rate * PAGE_SIZE as f64,
            dirty_cap_bytes: self.report.populated.max(self.bitmap.count() * PAGE_SIZE),
            sync: self.report.last_sync,
            elapsed: now.elapsed,
            stalled_passes: now.stalled_passes,
            throttle: now.throttle,
            dirty_limit: now.dirty_limit,
        };
        let postcopy = self.params.postcopy();
        let granted = self.peer.agreement().postcopy;
        let allowed = Allowed {
            policy: self.params.policy,
            postcopy: granted,
            postcopy_on_stall: now.postcopy_on_stall,
            // Asked for now counts as asked for at this pass.
            postcopy_after_passes: if self.control.postcopy_requested() {
                Some(pass)
            } else {
                postcopy.and_then(|p| p.after_passes)
            },
            choose: if postcopy.is_some_and(|p| p.auto) {
                Choose::Prediction
            } else {
                Choose::Policy
            },
        };
        predict::predict(&measured, &allowed)
    }
}
