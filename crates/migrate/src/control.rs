//! The handle another thread holds on a running migration: cancel it, read its progress.
//! These are the source's, unprefixed as the outgoing migration is everywhere (`ferry migrate`,
//! `GET /migration` on the source); the destination's twins carry the prefix:
//! [`IncomingControl`](crate::destination::IncomingControl), `IncomingPhase`, `IncomingProgress`.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::events::{EventKind, EventLog};
use crate::job::JobStats;

use serde::{Deserialize, Serialize};

pub use crate::phase::Phase;
use crate::policy::AutoConverge;
use crate::predict::Prediction;
use crate::stats::MigrationStats;

/// What `GET /migration` and `ferry migrate` show while a migration runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Progress {
    pub phase: Phase,
    /// Precopy passes whose dirty sync is done; the pass being sent is the next one (pass 1
    /// while this is 0).
    pub pass: u32,
    /// Bytes still to send, as known now: in pass 1, the populated memory the walk has not
    /// reached yet (the dirty log is read only when the pass ends); in a dirty pass, the dirty
    /// pages not sent yet; in postcopy, the pages the destination still lacks. Updated while
    /// a pass runs, not only at its end.
    pub remaining_bytes: u64,
    /// Of `remaining_bytes`, the iterative device state still to send (changed or never
    /// sent); 0 without such state.
    #[serde(default)]
    pub state_remaining_bytes: u64,
    pub bytes_sent: u64,
    pub bandwidth_mb_s: f64,
    pub dirty_rate_pages_per_s: f64,
    /// What the last dirty sync predicts the pause would cost; only in precopy.
    pub expected_downtime_ms: Option<f64>,
    /// What the last pass end predicts for each way to finish, and the way chosen
    /// (`crate::predict`); `None` before a rate was measured.
    #[serde(default)]
    pub prediction: Option<Prediction>,
    /// `remaining_bytes` at the current send rate: when the pass (or postcopy's background
    /// stream) should end. Precopy then syncs and may find more to send.
    #[serde(default)]
    pub eta_ms: Option<f64>,
    pub elapsed_ms: f64,
    /// Page request runs the destination sent in postcopy, and the pages they asked for.
    #[serde(default)]
    pub postcopy_requests: u64,
    #[serde(default)]
    pub postcopy_pages_requested: u64,
    /// The auto-converge throttle in force, percent (0: none).
    #[serde(default)]
    pub throttle_percent: u8,
    /// Times a postcopy migration recovered from a broken connection so far.
    #[serde(default)]
    pub recoveries: u32,
    /// Recovery attempts (`ferry migrate --resume`) that failed and left the migration
    /// postcopy-paused again, so far: how a follower of a resume learns that its attempt
    /// failed (the phase is `postcopy_paused` before and after).
    #[serde(default)]
    pub recovery_failures: u32,
    /// The destination granted postcopy recovery: a connection that breaks in postcopy
    /// pauses the migration instead of failing it.
    #[serde(default)]
    pub postcopy_recover: bool,
    /// The source sent Complete (or Postcopy): the guest may run on the destination from
    /// here, so the source never resumes it on its own. A migration that fails after this
    /// without the destination's Resumed leaves the guest paused here; resuming it is the
    /// operator's call, once the destination is known not to run it.
    #[serde(default)]
    pub handed_over: bool,
    /// The settings in force, which [`Control::tune`] can change while the migration runs.
    #[serde(default)]
    pub settings: Settings,
    /// A local handover ([`crate::source::SourceParams::local`]): guest RAM was handed to a
    /// process on this host, not sent.
    #[serde(default)]
    pub local: bool,
    /// A snapshot (a session to a file, `source/keep.rs`): it hands nothing over, so a cancel
    /// is taken in its pause too (the guest resumes here).
    #[serde(default)]
    pub snapshot: bool,
    /// The figures as libvirt's job statistics name them (`virDomainGetJobStats`), as of
    /// the last publish; once completed, from the statistics. `None` before the first.
    #[serde(default)]
    pub job: Option<JobStats>,
    /// Filled when the migration ends.
    pub stats: Option<MigrationStats>,
    pub error: Option<String>,
}

impl Progress {
    /// Whether a cancel still leaves the guest running here with nothing lost: a migration
    /// before its pause ([`Phase::is_cancellable`]), a snapshot in its pause too.
    pub fn is_cancellable(&self) -> bool {
        self.phase.is_cancellable() || (self.snapshot && self.phase == Phase::Switchover)
    }
}

/// The settings of a running migration that [`Control::tune`] can change, as in force.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub downtime_limit_ms: u64,
    /// Bytes per second; `None`: unlimited.
    pub max_bandwidth: Option<u64>,
    /// Counted from the migration's start; `None`: none.
    pub timeout_ms: Option<u64>,
    /// Auto-converge's highest throttle, percent; `None`: auto-converge is off.
    pub max_throttle: Option<u8>,
}

/// New values for settings of a running migration (QEMU's migrate-set-parameters, virsh's
/// migrate-setmaxdowntime and migrate-setspeed; `PATCH /migration`, `ferry migrate-set`):
/// each `Some` replaces a setting at the migration's next step (a batch, at most 2 MiB), the
/// rest stay as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tuning {
    pub downtime_limit: Option<Duration>,
    /// `Some(None)`: no limit. A new limit is an average from when it was set.
    pub max_bandwidth: Option<Option<u64>>,
    /// `Some(None)`: no timeout. Counted from the migration's start, so a timeout already
    /// passed acts at once (with the migration's timeout action).
    pub timeout: Option<Option<Duration>>,
    /// `Some(None)`: never throttle, and a throttle in force is lifted at the next pass end;
    /// a lower cap lowers a throttle above it.
    pub auto_converge: Option<Option<AutoConverge>>,
}

impl Tuning {
    /// Refuses values no migration can run with, naming the fix.
    pub fn check(&self) -> Result<(), crate::MigrateError> {
        use crate::error::ConfigError;
        if self.max_bandwidth == Some(Some(0)) {
            return Err(ConfigError::ZeroBandwidth.into());
        }
        if self.timeout == Some(Some(Duration::ZERO)) {
            return Err(ConfigError::ZeroTimeout.into());
        }
        if let Some(Some(a)) = self.auto_converge
            && (a.initial == 0 || a.max >= 100 || a.initial > a.max)
        {
            return Err(ConfigError::Throttle {
                initial: a.initial,
                max: a.max,
            }
            .into());
        }
        Ok(())
    }

    /// These settings, then `later`'s over them.
    fn then(self, later: Tuning) -> Tuning {
        Tuning {
            downtime_limit: later.downtime_limit.or(self.downtime_limit),
            max_bandwidth: later.max_bandwidth.or(self.max_bandwidth),
            timeout: later.timeout.or(self.timeout),
            auto_converge: later.auto_converge.or(self.auto_converge),
        }
    }
}

/// Shared between the migration thread and its controllers.
#[derive(Debug, Default)]
pub struct Control {
    cancel: AtomicBool,
    postcopy: AtomicBool,
    /// Break the connections of a migration in postcopy, as a failure would.
    pause: AtomicBool,
    /// The operator resumed the guest here by force: a paused postcopy migration ends.
    give_up: AtomicBool,
    /// Where a paused postcopy migration reconnects to, once asked.
    resume: Mutex<Option<crate::transport::Dialer>>,
    resume_asked: Condvar,
    /// New settings not yet taken by the migration.
    tuning: Mutex<Option<Tuning>>,
    progress: Mutex<Progress>,
    /// Where phase changes and pass ends are logged for watchers, if the VMM keeps a log.
    events: Option<Arc<EventLog>>,
}

impl Control {
    /// A control whose phase changes and pass ends go to `events` as they are published,
    /// starting with its first phase (setup) now.
    pub fn with_events(events: Arc<EventLog>) -> Control {
        log_change(&events, (Phase::Failed, 0), &Progress::default());
        Control {
            events: Some(events),
            ..Control::default()
        }
    }

    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    /// Ends a migration that handed the guest over and waits in postcopy-paused, because the
    /// operator resumed the guest on this side by force (`ferry resume --risk-running-twice`):
    /// it fails with [`MigrateError::GivenUp`](crate::MigrateError::GivenUp) instead of waiting
    /// for a recovery that would send pages of a guest that runs again here.
    pub fn give_up(&self) {
        self.give_up.store(true, Ordering::Release);
    }

    pub fn given_up(&self) -> bool {
        self.give_up.load(Ordering::Acquire)
    }

    /// Asks a migration that has postcopy enabled to switch to it at the end of the pass it is
    /// sending (`ferry migrate-postcopy`, `PUT /migration/postcopy`).
    pub fn start_postcopy(&self) {
        self.postcopy.store(true, Ordering::Relaxed);
    }

    pub fn postcopy_requested(&self) -> bool {
        self.postcopy.load(Ordering::Relaxed)
    }

    /// Breaks a postcopy migration's connections as a network failure would (QEMU's
    /// migrate-pause; `PUT /migration/pause`): both sides go to postcopy-paused. Only a
    /// migration in postcopy whose destination granted recovery can be paused (any other
    /// would fail, losing the guest): false, and nothing asked, otherwise.
    pub fn pause_postcopy(&self) -> bool {
        let p = self.progress();
        if p.phase != Phase::Postcopy || !p.postcopy_recover {
            return false;
        }
        self.pause.store(true, Ordering::Relaxed);
        true
    }

    /// Whether a pause was asked for and not yet acted on; clears the request.
    pub fn take_pause(&self) -> bool {
        self.pause.swap(false, Ordering::Relaxed)
    }

    /// Asks a migration in postcopy-paused to reconnect to `to` (`ferry migrate --resume`,
    /// `PUT /migration/resume`).
    /// A plain [`Address`](crate::transport::Address) converts; a [`Dialer`](crate::transport::Dialer) with TLS
    /// reconnects through it.
    pub fn resume_postcopy(&self, to: impl Into<crate::transport::Dialer>) {
        *self.resume.lock().unwrap() = Some(to.into());
        self.resume_asked.notify_all();
    }

    /// Waits up to `timeout` for a resume request and takes it.
    pub fn wait_resume(&self, timeout: Duration) -> Option<crate::transport::Dialer> {
        let mut r = self.resume.lock().unwrap();
        if r.is_none() {
            r = self.resume_asked.wait_timeout(r, timeout).unwrap().0;
        }
        r.take()
    }

    /// Changes settings of the running migration at its next step (see [`Tuning`]); refuses
    /// values it could not run with, and changes nothing then. Settings asked for before the
    /// migration took the last ones are merged, the later winning.
    pub fn tune(&self, tuning: Tuning) -> Result<(), crate::MigrateError> {
        tuning.check()?;
        let mut t = self.tuning.lock().unwrap();
        *t = Some(t.unwrap_or_default().then(tuning));
        Ok(())
    }

    /// The settings asked for since the last call, if any.
    pub(crate) fn take_tuning(&self) -> Option<Tuning> {
        self.tuning.lock().unwrap().take()
    }

    pub fn progress(&self) -> Progress {
        self.progress.lock().unwrap().clone()
    }

    /// Changes the published progress; a phase entered or a pass ended is logged in the same
    /// moment, under the same lock, so a watcher never sees the event before the figures.
    pub fn update(&self, f: impl FnOnce(&mut Progress)) {
        let mut p = self.progress.lock().unwrap();
        let before = (p.phase, p.pass);
        f(&mut p);
        if let Some(events) = &self.events {
            log_change(events, before, &p);
        }
    }
}

/// Logs in `events` what changed on the source between `before` (its phase and pass) and
/// `now`: a pass that ended in precopy, a phase entered (with the end's figures or cause).
fn log_change(events: &EventLog, before: (Phase, u32), now: &Progress) {
    if now.pass != before.1 && now.pass > 0 && now.phase == Phase::Precopy {
        events.push(EventKind::Pass {
            pass: now.pass,
            remaining_bytes: now.remaining_bytes,
            bytes_sent: now.bytes_sent,
            bandwidth_mb_s: now.bandwidth_mb_s,
            dirty_rate_pages_per_s: now.dirty_rate_pages_per_s,
            expected_downtime_ms: now.expected_downtime_ms,
            prediction: now.prediction,
            elapsed_ms: now.elapsed_ms,
            job: now.job,
        });
    }
    if now.phase != before.0 {
        let stats = now.stats.as_ref().filter(|_| now.phase == Phase::Completed);
        events.push(EventKind::Source {
            phase: now.phase,
            error: now.error.clone().filter(|_| !now.phase.is_active()),
            total_ms: stats.map(|s| s.total_ms),
            downtime_ms: stats.map(|s| s.downtime.total_ms),
            bytes_sent: stats.map(|s| s.bytes_sent),
            job: now.job.filter(|_| now.phase == Phase::Completed),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_and_a_phase_are_logged_as_they_change() {
        let log = Arc::new(EventLog::default());
        let control = Control::with_events(log.clone());
        control.update(|p| p.phase = Phase::Precopy);
        control.update(|p| p.bytes_sent = 1);
        control.update(|p| p.pass = 1);
        control.update(|p| p.phase = Phase::Completed);
        let what: Vec<String> = log
            .since(0, Duration::ZERO)
            .events
            .iter()
            .map(|e| match &e.what {
                EventKind::Source { phase, .. } => format!("{phase:?}"),
                EventKind::Pass { pass, .. } => format!("pass {pass}"),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(what, ["Setup", "Precopy", "pass 1", "Completed"]);
    }

    /// Issue 48 (review): a snapshot paused on a hung file system could not be cancelled: only
    /// a migration's phases before the pause took a cancel. A snapshot hands nothing over, so
    /// its pause takes one too; a migration's never does.
    #[test]
    fn regression_a_snapshot_is_cancellable_in_its_pause_and_a_migration_is_not() {
        for (phase, migration, snapshot) in [
            (Phase::Setup, true, true),
            (Phase::Precopy, true, true),
            (Phase::Discarding, true, true),
            (Phase::Switchover, false, true),
            (Phase::Postcopy, false, false),
            (Phase::Completed, false, false),
        ] {
            let p = |snapshot| Progress {
                phase,
                snapshot,
                ..Progress::default()
            };
            assert_eq!(p(false).is_cancellable(), migration, "{phase:?}");
            assert_eq!(p(true).is_cancellable(), snapshot, "{phase:?}");
        }
    }

    #[test]
    fn tuning_is_checked_and_later_settings_win_over_earlier_ones() {
        let control = Control::default();
        for bad in [
            Tuning {
                max_bandwidth: Some(Some(0)),
                ..Tuning::default()
            },
            Tuning {
                timeout: Some(Some(Duration::ZERO)),
                ..Tuning::default()
            },
            Tuning {
                auto_converge: Some(Some(AutoConverge {
                    max: 100,
                    ..AutoConverge::default()
                })),
                ..Tuning::default()
            },
        ] {
            assert!(control.tune(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            control.take_tuning(),
            None,
            "a refused tuning changes nothing"
        );
        let ms = Duration::from_millis;
        control
            .tune(Tuning {
                downtime_limit: Some(ms(100)),
                max_bandwidth: Some(Some(1 << 20)),
                ..Tuning::default()
            })
            .unwrap();
        control
            .tune(Tuning {
                max_bandwidth: Some(None),
                timeout: Some(Some(ms(5))),
                ..Tuning::default()
            })
            .unwrap();
        assert_eq!(
            control.take_tuning(),
            Some(Tuning {
                downtime_limit: Some(ms(100)),
                max_bandwidth: Some(None),
                timeout: Some(Some(ms(5))),
                auto_converge: None,
            })
        );
        assert_eq!(control.take_tuning(), None, "taken once");
    }
}
