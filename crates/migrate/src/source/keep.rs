//! A session to a target that keeps what it is given and answers nothing (a snapshot file,
//! `snapshot::target`): precopy and the final pass as to a destination, then the guest runs
//! again here (unless the target stops it) and the target takes the device state. Nothing is
//! handed over, so a failure at any step resumes a guest the session paused, as a cancel does.

#![forbid(unsafe_code)]

use std::time::Instant;

use super::target::Keeper;
use super::{Ending, GuestState, Session, SourceParams, TestHooks, ms};
use crate::control::{Control, Phase};
use crate::error::MigrateError;
use crate::ram::Ram;
use crate::stats::MigrationStats;
use crate::vm::SourceVm;

/// Saves `vm` into `target` while it runs, as [`super::migrate`] sends it to a destination;
/// returns the statistics (the downtime is the pause the guest saw).
pub(crate) fn keep<K: Keeper>(
    vm: &mut dyn SourceVm,
    target: K,
    params: &SourceParams,
    control: &Control,
) -> Result<MigrationStats, MigrateError> {
    params.check()?;
    let ram = Ram::new(vm.ram())?;
    let mut session = Session::new(ram, target, params, TestHooks::default(), control);
    control.update(|p| {
        p.phase = Phase::Setup;
        p.settings = params.settings();
        p.snapshot = true;
    });
    let result = session.run_keeping(vm);
    session.conclude(vm, result)
}

impl<K: Keeper> Session<'_, K> {
    fn run_keeping(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        self.start_tracking(vm)?;
        // A keeper agrees to no postcopy, so precopy never ends in it; were it asked, the
        // final pass would be the safe end all the same.
        let last = match self.precopy(vm)? {
            Ending::Switchover(last) | Ending::Postcopy(last, _) => last,
        };
        let (sections, steps) = self.final_pass(vm, last + 1)?;
        if !self.peer.stops() {
            vm.resume()?;
            self.guest = GuestState::Running;
        }
        let resumed = Instant::now();
        self.note_downtime(steps, resumed);
        self.report.stats.downtime.resume_ms = ms(resumed - steps[4]);
        self.peer.keep(&sections)
    }
}
