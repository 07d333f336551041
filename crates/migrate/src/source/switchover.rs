//! Switchover, for any target: pause the guest, sync and send the last dirty pages, close the
//! target's page path and save the device state (`final_pass`), and measure where the
//! downtime went. What follows is the target's: a live destination takes the state and
//! Complete and answers Resumed (`live/handover.rs`); a file keeps the state (`keep.rs`).

#![forbid(unsafe_code)]

use std::time::Instant;

use super::target::Target;
use super::{GuestState, Session, ms};
use crate::control::Phase;
use crate::error::MigrateError;
use crate::vm::{Section, SourceVm};

impl<P: Target> Session<'_, P> {
    /// Stops the guest here, sends the final pass and closes the target's page path, then
    /// saves the device state; `pass` is the final pass's number. Returns the state and when
    /// the pause was asked for, the guest paused, the final sync, the final pages and the
    /// state save ended.
    pub(super) fn final_pass(
        &mut self,
        vm: &mut dyn SourceVm,
        pass: u32,
    ) -> Result<(Vec<Section>, [Instant; 5]), MigrateError> {
        self.note_acks();
        self.report.stats.in_flight_at_pause_bytes = self.in_flight();
        self.peer.before_pause(self.bitmap.count());
        let (t0, t1) = self.pause_guest(vm)?;
        self.sync_dirty(vm)?;
        let t2 = Instant::now();
        self.dirty_pass(vm, pass, GuestState::Paused, t2)?;
        self.peer.close_pages(&mut self.report.stats)?;
        let t3 = Instant::now();
        self.finish_hints(vm);
        let sections = vm.save_state()?;
        let t4 = Instant::now();
        self.note_state(vm, &sections);
        Ok((sections, [t0, t1, t2, t3, t4]))
    }

    /// Pauses the guest here for the switchover (precopy's, or postcopy's): the phase, the end
    /// of the control loop's steps, and when the pause was asked for and done.
    pub(super) fn pause_guest(
        &mut self,
        vm: &mut dyn SourceVm,
    ) -> Result<(Instant, Instant), MigrateError> {
        self.set_phase(Phase::Switchover);
        let asked = Instant::now();
        self.report.last_check = None; // the control loop's steps end here
        vm.pause()?;
        self.guest = GuestState::Paused;
        Ok((asked, Instant::now()))
    }

    /// Records where the downtime went on this side: `steps` as [`Session::final_pass`]
    /// returns them, and `end`, when the guest runs again (here, or on the destination).
    pub(super) fn note_downtime(&mut self, steps: [Instant; 5], end: Instant) {
        let [t0, t1, t2, t3, t4] = steps;
        let d = &mut self.report.stats.downtime;
        d.total_ms = ms(end - t0);
        d.pause_ms = ms(t1 - t0);
        d.final_sync_ms = ms(t2 - t1);
        d.final_pages_ms = ms(t3 - t2);
        d.state_save_ms = ms(t4 - t3);
    }

    /// Records the saved state's size and where its save went, for the downtime breakdown.
    pub(super) fn note_state(&mut self, vm: &dyn SourceVm, sections: &[Section]) {
        let d = &mut self.report.stats.downtime;
        d.state_bytes = sections.iter().map(|s| s.data.len() as u64).sum();
        d.save_parts = vm.state_parts();
    }
}
