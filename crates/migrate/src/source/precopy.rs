//! Precopy: pass 1 over populated memory, then dirty passes while the guest runs, with the
//! policy asked after each dirty sync whether to go on, switch over or give up.
//!
//! Invariants: every pass ends with an `EndOfPass` on every data channel and on the main
//! connection (the destination's barrier counts on it); a running guest's pages are paced by
//! the limiter, and cancellation is looked at between any two batches.

#![forbid(unsafe_code)]

use std::time::Instant;

use super::limiter::{Limiter, MAX_SLEEP, Pacing};
use super::target::Target;
use super::{Ending, GuestState, Session, ms};
use crate::bitmap::Cursor;
use crate::error::MigrateError;
use crate::policy::{self, Decision};
use crate::predict::{Prediction, Way};
use crate::stats::{PassStats, PostcopyTrigger, SampleKind};
use crate::vm::{SourceVm, VmError};
use crate::wire::{self, PAGE_SIZE};

/// What a queued page may cost the link before it is written: its 8-byte address and the page.
const BYTES_PER_PAGE: u64 = 8 + PAGE_SIZE;

/// Pass 1 arms the dirty log ([`SourceVm::arm_dirty`]) in slices of 64 MiB of guest
/// addresses: 16 Ki pages, which KVM re-protects in one `KVM_CLEAR_DIRTY_LOG` under its MMU
/// lock in 0.7 ms (median; 2.5 ms at most) when all are mapped (`ferry bench snapshot`'s live
/// rows, issue 52), so no arm stalls the guest for long, and a 4 GiB guest takes 64 of them
/// over its pass 1.
pub(crate) const ARM_SLICE_BYTES: u64 = 64 << 20;

/// The slice of [`ARM_SLICE_BYTES`] (aligned in guest addresses) that holds `gpa`, cut to its
/// region `[start, end)`.
fn arm_slice(gpa: u64, start: u64, end: u64) -> (u64, u64) {
    let from = gpa / ARM_SLICE_BYTES * ARM_SLICE_BYTES;
    (from.max(start), (from + ARM_SLICE_BYTES).min(end))
}

/// Whether pass 1 still arms the dirty log: until the VMM says it has nothing to arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arm {
    Asked,
    NotNeeded,
}

impl Arm {
    /// Arms `[from, to)` before pass 1 looks at it.
    fn slice(&mut self, vm: &mut dyn SourceVm, (from, to): (u64, u64)) -> Result<(), MigrateError> {
        if *self == Arm::NotNeeded {
            return Ok(());
        }
        match vm.arm_dirty(from, to - from) {
            Err(VmError::Unsupported { .. }) => {
                *self = Arm::NotNeeded;
                Ok(())
            }
            other => Ok(other?),
        }
    }
}

impl<P: Target> Session<'_, P> {
    /// Runs pass 1 and dirty passes until the policy decides or postcopy is asked for (looked
    /// at after each pass, before the policy); says which, with the last pass sent. Between
    /// passes it throttles the guest when the policy says so.
    pub(super) fn precopy(&mut self, vm: &mut dyn SourceVm) -> Result<Ending, MigrateError> {
        self.first_pass(vm)?;
        let mut pass = 1;
        // Whether the sync below ends a pass (rather than a drain, which sent nothing).
        let mut after_pass = true;
        loop {
            let pass_started = Instant::now();
            let before = self.bitmap.count();
            self.sync_dirty(vm)?;
            let last = self.report.stats.passes.last_mut().expect("pass 1 ran");
            if after_pass {
                let dirtied = self.bitmap.count() - before;
                last.dirty_rate_pages_per_s =
                    dirtied as f64 / (last.duration_ms / 1000.0).max(1e-3);
                self.converge.stalled_passes = policy::stall_count(
                    self.converge.stalled_passes,
                    last.bytes,
                    dirtied * PAGE_SIZE,
                );
            }
            let dirty_rate = last.dirty_rate_pages_per_s;
            self.retune();
            self.fit_throttle(vm)?;
            self.sample(SampleKind::Boundary);
            let now = self.observe();
            self.tell_allowance(vm, &now);
            let prediction = self.forecast(pass, &now, dirty_rate);
            self.publish_pass(pass, &now, dirty_rate, prediction);
            after_pass = false;
            let (decision, trigger) = match self.postcopy_asked(pass) {
                Some(trigger) => (Decision::Postcopy, trigger),
                None if self.prediction_picks_postcopy(prediction.as_ref()) => {
                    (Decision::Postcopy, PostcopyTrigger::Prediction)
                }
                None => (
                    policy::decide(&self.params.policy, &now),
                    PostcopyTrigger::Policy,
                ),
            };
            match decision {
                Decision::Switchover => {
                    self.report.stats.converged = policy::fits(&self.params.policy, &now);
                    return Ok(Ending::Switchover(pass));
                }
                Decision::Postcopy => {
                    // As before a switchover: the pause should not wait for the tail of the
                    // last pass still queued for the destination.
                    if !now.settled() {
                        self.drain(&now)?;
                    }
                    return Ok(Ending::Postcopy(pass, trigger));
                }
                Decision::Drain => {
                    self.drain(&now)?;
                    continue;
                }
                Decision::Cancel => {
                    return Err(MigrateError::Timeout(
                        self.params.policy.timeout.unwrap_or_default(),
                    ));
                }
                Decision::Throttle(percent) => self.throttle(vm, percent)?,
                Decision::LimitDirty(rate) => self.limit_dirty(vm, rate)?,
                Decision::AwaitReady => self.await_ready(policy::READY_WAIT),
                Decision::Iterate => {}
            }
            pass += 1;
            after_pass = true;
            self.start_hint_round(vm);
            self.dirty_pass(vm, pass, GuestState::Running, pass_started)?;
        }
    }

    /// Takes the settings a controller changed since the last step ([`Control::tune`]) and
    /// publishes the settings in force. A throttle above a new cap (or with auto-converge
    /// turned off) is lowered at the next pass end, by [`Session::fit_throttle`].
    ///
    /// [`Control::tune`]: crate::control::Control::tune
    pub(super) fn retune(&mut self) {
        let Some(t) = self.control.take_tuning() else {
            return;
        };
        let policy = &mut self.params.policy;
        if let Some(d) = t.downtime_limit {
            policy.downtime_limit = d;
        }
        if let Some(timeout) = t.timeout {
            policy.timeout = timeout;
        }
        if let Some(a) = t.auto_converge {
            policy.auto_converge = a;
        }
        if let Some(rate) = t.max_bandwidth {
            self.set_max_bandwidth(rate);
        }
        tracing::info!("migration settings changed: {t:?}");
        let settings = self.params.settings();
        self.control.update(|p| p.settings = settings);
    }

    /// Limits the send rate to `rate` bytes per second from now on (`None`: no limit).
    pub(super) fn set_max_bandwidth(&mut self, rate: Option<u64>) {
        self.params.max_bandwidth = rate;
        self.peer.max_bandwidth_changed(rate);
        let now = self.report.start.elapsed();
        self.link.limiter = rate.map(|r| Limiter::from(r, now));
        // The new limit counts from now: what was written before is not its to charge.
        self.link.limit_base = self.bytes_written();
    }

    /// Lowers a throttle in force to the auto-converge cap now in force, or lifts it when
    /// auto-converge was turned off while the migration ran.
    fn fit_throttle(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        let cap = self.params.policy.auto_converge.map_or(0, |a| a.max);
        if self.converge.throttle > cap {
            self.throttle(vm, cap)?;
        }
        // A dirty limit auto-converge set goes with it; one asked for from the start stays.
        if self.params.policy.auto_converge.is_none()
            && self.converge.dirty_limit != self.params.dirty_limit
        {
            match self.params.dirty_limit {
                Some(rate) => self.set_dirty_limit(vm, rate)?,
                None => {
                    vm.set_dirty_limit(None)?;
                    self.converge.dirty_limit = None;
                }
            }
        }
        Ok(())
    }

    /// Sets the guest's throttle for the passes to come. A VMM that cannot throttle turns
    /// auto-converge off for the rest of this migration (said in the log and the statistics).
    fn throttle(&mut self, vm: &mut dyn SourceVm, percent: u8) -> Result<(), MigrateError> {
        match vm.set_throttle(percent) {
            Ok(()) => {
                self.converge.throttle = percent;
                self.report.stats.throttle_max_percent =
                    self.report.stats.throttle_max_percent.max(percent);
                self.control.update(|p| p.throttle_percent = percent);
                Ok(())
            }
            Err(VmError::Unsupported { .. }) => {
                tracing::warn!(
                    "the VMM cannot throttle its vCPUs: auto-converge is off for this migration"
                );
                self.params.policy.auto_converge = None;
                self.report.stats.throttle_unsupported = true;
                let settings = self.params.settings();
                self.control.update(|p| p.settings = settings);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Auto-converge by dirty limit: caps each vCPU's dirty rate for the passes to come. A
    /// VMM that cannot falls back to the throttle, from this step on, for the rest of this
    /// migration (said in the log and the statistics).
    fn limit_dirty(&mut self, vm: &mut dyn SourceVm, rate: u64) -> Result<(), MigrateError> {
        match self.set_dirty_limit(vm, rate) {
            Err(MigrateError::Vm(VmError::Unsupported { operation })) => {
                tracing::warn!(
                    "{operation} is not supported by this VMM: auto-converge throttles the whole guest instead"
                );
                self.params.policy.converge_by = crate::ConvergeBy::Throttle;
                self.report.stats.dirty_limit_unsupported = true;
                // This stall's step, taken now rather than a stalled pass later.
                match self
                    .params
                    .policy
                    .auto_converge
                    .and_then(|a| a.next(self.converge.throttle))
                {
                    Some(percent) => self.throttle(vm, percent),
                    None => Ok(()),
                }
            }
            other => other,
        }
    }

    /// Sets the per-vCPU dirty limit and records it.
    pub(super) fn set_dirty_limit(
        &mut self,
        vm: &mut dyn SourceVm,
        rate: u64,
    ) -> Result<(), MigrateError> {
        vm.set_dirty_limit(Some(rate))?;
        tracing::info!("each vCPU may now dirty at most {} MB/s", rate / 1_000_000);
        self.converge.dirty_limit = Some(rate);
        self.report.stats.dirty_limit_min = Some(
            self.report
                .stats
                .dirty_limit_min
                .map_or(rate, |m| m.min(rate)),
        );
        Ok(())
    }

    /// Pass 1: send what the backing file holds, walking populated ranges with
    /// `SEEK_DATA`/`SEEK_HOLE`, and nothing else: its cost follows populated memory. Dirty
    /// tracking started before the walk, and each slice of [`ARM_SLICE_BYTES`] that holds data
    /// is armed before the walk looks into it, which is what makes it safe: a page written
    /// before the walk reads it is sent as written, and a write after the arm (a page the walk
    /// already passed, or a hole the guest fills later) is in the dirty log, so a dirty pass
    /// sends it. A slice the walk found empty is never armed: the VMM reports its populated
    /// pages at the next fetch. The first round of free page hints starts before the walk,
    /// which skips what it hints.
    fn first_pass(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        let started = Instant::now();
        self.report.pass = 1;
        let (mut pages, bytes_before) = (0u64, self.bytes_written());
        let regions = self.ram.regions().to_vec();
        self.report.first_pass_left = self.ram.populated_bytes();
        self.report.populated = self.report.first_pass_left;
        self.publish(None);
        self.start_hint_round(vm);
        let mut hinted = 0;
        let mut batch = Vec::with_capacity(wire::MAX_PAGES_PER_RECORD as usize);
        let mut arm = Arm::Asked;
        for (index, region) in regions.iter().enumerate() {
            let end = region.gpa + region.size;
            let mut at = region.gpa;
            // Slice by slice: the first populated page from `at` names the slice to arm, and
            // the slice is looked at again once armed (a page populated in between is in it).
            while let Some((data, _)) = self
                .ram
                .next_data(index, at)
                .map_err(|e| MigrateError::io("looking for populated memory", e))?
            {
                let slice = arm_slice(data, region.gpa, end);
                arm.slice(vm, slice)?;
                at = slice.0;
                while let Some((data, hole)) = self
                    .ram
                    .next_data(index, at)
                    .map_err(|e| MigrateError::io("looking for populated memory", e))?
                    .filter(|&(data, _)| data < slice.1)
                {
                    for gpa in (data..hole.min(slice.1)).step_by(PAGE_SIZE as usize) {
                        self.report.first_pass_left =
                            self.report.first_pass_left.saturating_sub(PAGE_SIZE);
                        if self.hints.skips(gpa) {
                            hinted += 1;
                            continue;
                        }
                        batch.push(gpa);
                        if batch.len() == batch.capacity() {
                            self.check_control()?;
                            pages += self.send_pages(&batch, Pacing::Limited)?;
                            self.send_state_beside(vm, Pacing::Limited, batch_bytes(&batch))?;
                            batch.clear();
                            self.apply_hints(vm);
                        }
                    }
                    at = hole.min(slice.1);
                }
                at = slice.1;
                if at >= end {
                    break;
                }
            }
        }
        pages += self.send_pages(&batch, Pacing::Limited)?;
        self.send_state(vm, Pacing::Limited)?;
        self.report.first_pass_left = 0;
        self.hints.first_pass_done();
        self.report.stats.pages_skipped_hinted += hinted;
        self.report.stats.pages_skipped_holes = self.ram.size() / PAGE_SIZE - pages - hinted;
        self.end_pass(1, GuestState::Running, pages, bytes_before, started)
    }

    /// Sends every page marked in the bitmap. With the guest running the pass is paced and
    /// cancellable, and drops what the guest hints free on the way; with it paused (the final
    /// pass) it is neither.
    pub(super) fn dirty_pass(
        &mut self,
        vm: &mut dyn SourceVm,
        pass: u32,
        guest: GuestState,
        started: Instant,
    ) -> Result<(), MigrateError> {
        self.report.pass = pass;
        let (mut pages, bytes_before) = (0u64, self.bytes_written());
        let mut cursor = Cursor::default();
        let mut batch = Vec::with_capacity(wire::MAX_PAGES_PER_RECORD as usize);
        while !cursor.at_end(&self.bitmap) {
            if guest == GuestState::Running {
                self.check_control()?;
                self.apply_hints(vm);
            }
            self.bitmap.take(&mut cursor, batch.capacity(), &mut batch);
            pages += self.send_pages(&batch, guest.pacing())?;
            self.send_state_beside(vm, guest.pacing(), batch_bytes(&batch))?;
            batch.clear();
        }
        self.send_state(vm, guest.pacing())?;
        self.end_pass(pass, guest, pages, bytes_before, started)
    }

    /// Ends `pass` on every connection and records what it sent.
    fn end_pass(
        &mut self,
        pass: u32,
        guest: GuestState,
        pages: u64,
        bytes_before: u64,
        started: Instant,
    ) -> Result<(), MigrateError> {
        self.link_busy();
        self.peer.end_pass(pass)?;
        self.report.stats.passes.push(PassStats {
            pass,
            paused: guest == GuestState::Paused,
            throttle_percent: self.converge.throttle,
            pages,
            bytes: self.bytes_written() - bytes_before,
            duration_ms: ms(started.elapsed()),
            dirty_rate_pages_per_s: 0.0,
            predicted: None,
        });
        self.sample(SampleKind::Boundary);
        Ok(())
    }

    /// Hands `gpas` to the data channels in batches of `packet_pages`. Returns the pages
    /// handed over.
    fn send_pages(&mut self, gpas: &[u64], pacing: Pacing) -> Result<u64, MigrateError> {
        if !gpas.is_empty() {
            self.link_busy();
        }
        for batch in gpas.chunks(self.params.packet_pages as usize) {
            if pacing == Pacing::Limited {
                self.pace()?;
            }
            self.peer.queue_pages(batch.to_vec())?;
            self.link.handed_pages += batch.len() as u64;
        }
        self.after_batch();
        Ok(gpas.len() as u64)
    }

    /// What a page costs the link, as a share of its 4 KiB: 1 without compression; with it,
    /// what data pages cost on the wire lately ([`crate::compress::WireShare`]).
    pub(super) fn wire_share(&mut self) -> f64 {
        if !self.params.compression.is_on() {
            return 1.0;
        }
        let (pages, wire) = self.peer.data_totals();
        self.link.wire.update(pages, wire)
    }

    /// Sleeps, in slices that look at cancellation, until what the link carried keeps the
    /// average at or under `max_bandwidth`. What is charged is measured, not guessed per
    /// batch: the bytes written on every connection since the limit was set, and the pages
    /// queued on the senders and not written yet at a whole page each (re-counted every slice
    /// as they go out). A zero page then costs the link the few bytes of its run and a
    /// compressed page what it compressed to, so a guest of zeros is walked at the senders'
    /// speed, and a cap limits the link, as it says.
    pub(super) fn pace(&mut self) -> Result<(), MigrateError> {
        loop {
            self.check_control()?;
            let carried = self.bytes_written() + self.peer.pending_pages() * BYTES_PER_PAGE;
            let Some(limiter) = &mut self.link.limiter else {
                return Ok(());
            };
            limiter.set(carried.saturating_sub(self.link.limit_base));
            let wait = limiter.wait(self.report.start.elapsed());
            if wait.is_zero() {
                return Ok(());
            }
            std::thread::sleep(wait.min(MAX_SLEEP));
        }
    }
}

impl<P: Target> Session<'_, P> {
    /// Whether the operator asked for postcopy by now (`ferry migrate-postcopy`, or a pass
    /// count), and how; the policy's own reasons come after. Never for a target that did not
    /// agree to postcopy.
    pub(super) fn postcopy_asked(&self, pass: u32) -> Option<PostcopyTrigger> {
        if !self.peer.agreement().postcopy {
            None
        } else if self.control.postcopy_requested() {
            Some(PostcopyTrigger::Asked)
        } else if self
            .postcopy
            .as_ref()
            .and_then(|p| p.settings.after_passes)
            .is_some_and(|n| pass >= n)
        {
            Some(PostcopyTrigger::AfterPasses)
        } else {
            None
        }
    }
}

impl<P: Target> Session<'_, P> {
    /// Whether the prediction chose postcopy and was asked to choose (`--postcopy-auto`),
    /// with a destination that agreed to postcopy.
    fn prediction_picks_postcopy(&self, prediction: Option<&Prediction>) -> bool {
        self.peer.agreement().postcopy
            && self.params.postcopy().is_some_and(|p| p.auto)
            && prediction.is_some_and(|p| p.chosen == Way::Postcopy)
    }
}

/// The bytes of guest memory a batch of pages holds.
fn batch_bytes(batch: &[u64]) -> u64 {
    batch.len() as u64 * PAGE_SIZE
}
