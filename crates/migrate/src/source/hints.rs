//! Free page hints, and the dirty sync they must be ordered against: the one place where the
//! source drops pages the guest does not use from what it still has to send.
//!
//! The guest (through the VMM's virtio-balloon, [`SourceVm::start_hints`]) reports ranges of
//! memory it holds free; the source does not send them. The rule, and why it loses nothing:
//!
//! 1. A round of hints starts only after dirty tracking started for all of RAM (setup starts
//!    it before pass 1 looks at any page). A hinted page that the guest writes again is then
//!    in the dirty log, and a later pass sends it.
//! 2. A hint drops its pages from the current pass only: in pass 1 from the walk over
//!    populated memory (the `skip` bitmap), in a dirty pass from the pending bitmap. It never
//!    marks a page "never send".
//! 3. Every round is stopped, and what it hinted applied, before the dirty sync that ends the
//!    pass ([`Session::sync_dirty`], the only caller of `fetch_dirty`). A hint applied after a
//!    sync could clear a write that sync already fetched, made after the hint: that write
//!    would be lost. So hints never outlive the sync after them; the VMM drops any that come
//!    after [`SourceVm::stop_hints`].
//! 4. A new round starts only before another pass with the guest running; the final sync (the
//!    guest paused) and postcopy have none. Before the guest's state is saved the VMM is told
//!    the migration is done with hints ([`SourceVm::finish_hints`], virtio's `DONE`), so the
//!    guest, here or on the destination, may use its hinted pages again.
//!
//! A page hinted and never written is not sent at all: the destination keeps what it had
//! there (zeros, or an older copy), which the guest does not read before it writes the page,
//! since the page was free.

#![forbid(unsafe_code)]

use std::time::Instant;

use super::hint_rounds::State;
use super::target::Target;
use super::{Session, ms};
use crate::bitmap::DirtyBitmap;
use crate::error::MigrateError;
use crate::vm::{SourceVm, VmError};

impl<P: Target> Session<'_, P> {
    /// Starts a round of hints before a pass with the guest running (the first round finds
    /// out whether the VMM can hint at all; if not, hinting stays off, quietly: a VMM without
    /// a balloon simply has none).
    pub(super) fn start_hint_round(&mut self, vm: &mut dyn SourceVm) {
        if !matches!(self.hints.state, State::Untried | State::Between) {
            return;
        }
        match vm.start_hints() {
            Ok(()) => {
                if self.hints.state == State::Untried && self.report.pass <= 1 {
                    self.hints.skip = Some(DirtyBitmap::new(self.ram.regions()));
                }
                self.hints.state = State::Round;
                self.report.stats.hint_rounds += 1;
            }
            Err(VmError::Unsupported { operation }) => {
                tracing::debug!("{operation} is not available: every page is sent");
                self.hints.state = State::Off;
            }
            Err(e) => self.hints_failed(vm, e),
        }
    }

    /// Drops what the guest hinted since the last look from what this pass still sends (in
    /// pass 1 by marking the walk's skip bitmap; later, by clearing pending pages).
    pub(super) fn apply_hints(&mut self, vm: &mut dyn SourceVm) {
        if self.hints.state != State::Round {
            return;
        }
        let mut ranges = std::mem::take(&mut self.hints.ranges);
        match vm.take_hints(&mut ranges) {
            Ok(()) => {
                for &(gpa, len) in &ranges {
                    match &mut self.hints.skip {
                        Some(skip) => {
                            skip.set_range(gpa, len);
                        }
                        None => {
                            self.report.stats.pages_skipped_hinted +=
                                self.bitmap.clear_range(gpa, len);
                        }
                    }
                }
            }
            Err(e) => self.hints_failed(vm, e),
        }
        ranges.clear();
        self.hints.ranges = ranges;
    }

    /// The dirty sync: stops the round and applies its last hints first (rule 3 of the
    /// module), then merges the dirty log into the pending bitmap.
    pub(super) fn sync_dirty(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        if self.hints.state == State::Round {
            match vm.stop_hints() {
                Ok(()) => {
                    self.apply_hints(vm);
                    if self.hints.state == State::Round {
                        self.hints.state = State::Between;
                    }
                }
                Err(e) => self.hints_failed(vm, e),
            }
        }
        let t = Instant::now();
        if self.postcopy.is_some() {
            self.bitmap.forget_touched();
        }
        vm.fetch_dirty(&mut self.bitmap)?;
        if let Some(postcopy) = &mut self.postcopy {
            postcopy.heat.note_sync(&self.bitmap);
        }
        // What the devices changed is as fresh as the pages the policy decides on.
        if let Some(it) = &mut self.iteration {
            it.pending = vm.pending_state_bytes()?;
        }
        self.report.last_sync = t.elapsed();
        self.report.stats.max_sync_ms =
            self.report.stats.max_sync_ms.max(ms(self.report.last_sync));
        Ok(())
    }

    /// Tells the VMM the migration is done with hints (once, if a round ever started).
    pub(super) fn finish_hints(&mut self, vm: &mut dyn SourceVm) {
        if matches!(self.hints.state, State::Round | State::Between) {
            self.hints.state = State::Finished;
            if let Err(e) = vm.finish_hints() {
                tracing::warn!("could not tell the guest it may reuse its hinted pages: {e}");
            }
        }
    }

    /// A hinting call failed: hints are an optimisation, so the migration goes on without
    /// them, sending every page. No hint is taken again, so none can be applied after a sync;
    /// the guest is told it may reuse what it hinted.
    fn hints_failed(&mut self, vm: &mut dyn SourceVm, e: VmError) {
        tracing::warn!("free page hinting failed, every page is sent from here: {e}");
        if let Err(e) = vm.finish_hints() {
            tracing::debug!("ending hints after the failure: {e}");
        }
        self.hints.skip = None;
        self.hints.state = State::Off;
    }
}
