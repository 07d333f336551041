//! Iterative device state ([`SourceVm::start_state_iteration`]): the state of devices too
//! large for the pause (a disk's blocks, a device with megabytes of its own) goes in chunks
//! while the guest runs, after each pass's pages, as RAM does; the policy counts what is
//! pending as left to send, and waits for the destination's StateReady before it pauses the
//! guest for a switchover (QEMU's switchover-ack). The final pass, with the guest paused,
//! sends what is left. Written over any target: a target that did not agree to take chunks
//! (a file) never starts an iteration, and the VM saves all of its state in the pause.
//!
//! Invariant: while the guest runs, one call sends about what was pending at the last dirty
//! sync (it stops at the first chunk that reaches that budget), so a device that changes
//! faster than the link carries it cannot hold a pass for ever; the policy sees the rest and
//! throttles, switches, or waits as it does for RAM.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::Session;
use super::iteration::Iteration;
use super::limiter::Pacing;
use super::target::Target;
use crate::error::MigrateError;
use crate::policy::Observation;
use crate::vm::{SourceVm, VmError};

/// How often [`Session::await_ready`] looks for the destination's StateReady: a tenth of the
/// destination's acknowledgement interval (10 ms), which carries it, as a drain polls.
const READY_POLL: Duration = Duration::from_millis(1);
/// Most bytes of data in one chunk: a section's bound on the wire.
const CHUNK_BYTES: usize = crate::wire::MAX_SECTION_BYTES as usize;

impl<P: Target> Session<'_, P> {
    /// Starts the VM's iterative state if the target agreed to take chunks and the VM has
    /// such state; a VM without it goes on with sections alone.
    pub(super) fn start_iteration(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        if !self.peer.agreement().iterative {
            return Ok(());
        }
        match vm.start_state_iteration() {
            Ok(pending) => {
                self.iteration = Some(Iteration {
                    pending,
                    ..Iteration::default()
                });
                Ok(())
            }
            Err(VmError::Unsupported { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends chunks beside a pass's pages, after a batch of `bytes`: as much again, within
    /// the pass's budget. So the state goes on the main connection while the data channels
    /// carry pages, not after them, and a writer the device holds until its chunks go (a
    /// disk's mirror) waits for a batch, not a pass.
    pub(super) fn send_state_beside(
        &mut self,
        vm: &mut dyn SourceVm,
        pacing: Pacing,
        bytes: u64,
    ) -> Result<(), MigrateError> {
        match self.pass_room(pacing) {
            Some(room) => self.send_chunks(vm, pacing, room.min(bytes)),
            None => Ok(()),
        }
    }

    /// What this pass may still send of the iteration (`None` without one): while the guest
    /// runs, what was pending at the pass's start less what went; with it paused, all.
    fn pass_room(&self, pacing: Pacing) -> Option<u64> {
        let it = self.iteration.as_ref()?;
        Some(match pacing {
            Pacing::Limited => it.pending.saturating_sub(it.pass_sent),
            Pacing::Unlimited => u64::MAX,
        })
    }

    /// Ends a pass's state: sends the chunks pending now (while the guest runs, paced and
    /// cancellable and at most what was pending at the pass's start, less what went beside
    /// its pages; with it paused, all that is left), and asks what is pending.
    pub(super) fn send_state(
        &mut self,
        vm: &mut dyn SourceVm,
        pacing: Pacing,
    ) -> Result<(), MigrateError> {
        let Some(budget) = self.pass_room(pacing) else {
            return Ok(());
        };
        self.send_chunks(vm, pacing, budget)?;
        let pending = vm.pending_state_bytes()?;
        let it = self.iteration.as_mut().expect("started");
        it.pending = pending;
        it.pass_sent = 0;
        Ok(())
    }

    /// Sends chunks until `budget` bytes went or none is pending.
    fn send_chunks(
        &mut self,
        vm: &mut dyn SourceVm,
        pacing: Pacing,
        budget: u64,
    ) -> Result<(), MigrateError> {
        let mut sent = 0u64;
        while sent < budget {
            let Some(chunk) = vm.next_state_chunk(CHUNK_BYTES)? else {
                break;
            };
            let bytes = chunk.data.len() as u64;
            if pacing == Pacing::Limited {
                self.pace()?;
            }
            self.link_busy();
            self.peer.send_state_chunk(&chunk)?;
            sent += bytes;
            let it = self.iteration.as_mut().expect("started");
            it.chunks += 1;
            it.bytes += bytes;
            it.pass_sent += bytes;
            self.after_batch();
        }
        Ok(())
    }

    /// Tells the VM what of its iterative state the pause could carry now
    /// ([`SourceVm::state_allowance`]), once a bandwidth was measured.
    pub(super) fn tell_allowance(&self, vm: &mut dyn SourceVm, now: &Observation) {
        if self.iteration.is_some() && now.bandwidth > 0.0 {
            let limit = self.params.policy.downtime_limit.as_secs_f64();
            vm.state_allowance((now.bandwidth * limit) as u64);
        }
    }

    /// Bytes of iterative state still to send, as last asked.
    pub(super) fn pending_state(&self) -> u64 {
        self.iteration.as_ref().map_or(0, |it| it.pending)
    }

    /// Whether the destination is ready for a switchover: at once without iterative state or
    /// before any chunk went, else once it said StateReady.
    pub(super) fn switchover_ready(&self) -> bool {
        self.iteration
            .as_ref()
            .is_none_or(|it| it.chunks == 0 || self.peer.state_ready())
    }

    /// Waits at most `bound` (short: the next pass looks at cancellation) for the
    /// destination's StateReady.
    pub(super) fn await_ready(&mut self, bound: Duration) {
        let deadline = Instant::now() + bound;
        while !self.switchover_ready() && Instant::now() < deadline {
            std::thread::sleep(READY_POLL);
        }
    }

    /// Ends the iteration, however the session ended, and counts what it sent.
    pub(super) fn end_iteration(&mut self, vm: &mut dyn SourceVm) {
        if let Some(it) = self.iteration.take() {
            vm.end_state_iteration();
            self.report.stats.state_chunks = it.chunks;
            self.report.stats.state_chunk_bytes = it.bytes;
        }
    }
}
