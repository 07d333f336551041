//! What a control plane watches instead of polling: a numbered log of a VM's migration events
//! on both sides (each phase entered, each pass's end with its figures, the end with its
//! figures or its cause), that a watcher reads from where it left off and waits on.
//!
//! The log is written where the figures change: [`crate::Control::update`] and the
//! destination's [`crate::destination::IncomingControl`] compare the phase and pass before and
//! after each update and log what changed, so an event is in the log, and its waiters woken,
//! in the same moment the state it reports is published. A VMM gives one log to every
//! migration of a VM (`Control::with_events`), so the numbers run on across migrations; a
//! process that replaces its VM (one that received a guest again after it migrated away)
//! carries the old log's numbering into the new one ([`EventLog::carry_on_from`]).
//!
//! Invariant: sequence numbers start at 1 and rise by one per event; the log keeps the last
//! [`KEPT`] of them, and a reader that fell further behind is told how many it missed.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::job::JobStats;
use crate::phase::{IncomingPhase, Phase};
use crate::predict::Prediction;

/// Events kept for readers that fall behind: a migration logs a few per pass.
pub const KEPT: usize = 4096;

/// One event: its number, when it happened, and what.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    /// Host `CLOCK_MONOTONIC`, ns (what `GET /vm`'s `host_monotonic_ns` reads).
    pub host_ns: u64,
    #[serde(flatten)]
    pub what: EventKind,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// The source entered `phase`; with the end's figures when it completed, its cause when it
    /// failed or was cancelled.
    Source {
        phase: Phase,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        total_ms: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        downtime_ms: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        bytes_sent: Option<u64>,
        /// The completed job's statistics, named as libvirt's ([`JobStats`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<JobStats>,
    },
    /// A precopy pass ended (with its dirty sync): libvirt's iteration event, with what the
    /// next decision stands on.
    Pass {
        pass: u32,
        remaining_bytes: u64,
        bytes_sent: u64,
        bandwidth_mb_s: f64,
        dirty_rate_pages_per_s: f64,
        #[serde(skip_serializing_if = "Option::is_none")]
        expected_downtime_ms: Option<f64>,
        /// What this pass end predicts for each way to finish (`crate::predict`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prediction: Option<Prediction>,
        elapsed_ms: f64,
        /// The job's statistics at the pass end, named as libvirt's ([`JobStats`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<JobStats>,
    },
    /// The destination entered `phase`.
    Destination {
        phase: IncomingPhase,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// What [`EventLog::since`] found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Events {
    pub events: Vec<Event>,
    /// Events after the reader's mark that the log no longer holds.
    pub missed: u64,
    /// The number to ask after next time.
    pub last: u64,
}

#[derive(Debug, Default)]
struct Log {
    kept: VecDeque<Event>,
    last: u64,
}

/// A VM's event log: written by its migrations, read by watchers.
#[derive(Debug, Default)]
pub struct EventLog {
    log: Mutex<Log>,
    arrived: Condvar,
}

impl EventLog {
    /// Logs `what` now and wakes the waiting readers.
    pub fn push(&self, what: EventKind) {
        let mut log = self.log.lock().unwrap();
        log.last += 1;
        let event = Event {
            seq: log.last,
            host_ns: monotonic_ns(),
            what,
        };
        if log.kept.len() == KEPT {
            log.kept.pop_front();
        }
        log.kept.push_back(event);
        drop(log);
        self.arrived.notify_all();
    }

    /// Carries on `earlier`'s numbering: this log's events are renumbered after `earlier`'s
    /// last, and `earlier`'s kept events come before them, so that a watcher of a process
    /// whose VM is replaced (a VMM that received a guest again after it migrated away) sees
    /// one log whose numbers only rise. Meant for a log that has logged only its VM's first
    /// events, before anyone watches it.
    pub fn carry_on_from(&self, earlier: &EventLog) {
        let old = earlier.log.lock().unwrap();
        let mut log = self.log.lock().unwrap();
        let base = old.last;
        let mine = std::mem::take(&mut log.kept);
        log.kept = old.kept.clone();
        for mut e in mine {
            e.seq += base;
            if log.kept.len() == KEPT {
                log.kept.pop_front();
            }
            log.kept.push_back(e);
        }
        log.last += base;
    }

    /// The events after `after`, waiting up to `wait` for one if there is none yet.
    pub fn since(&self, after: u64, wait: Duration) -> Events {
        let deadline = Instant::now() + wait;
        let mut log = self.log.lock().unwrap();
        while log.last <= after {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            log = self.arrived.wait_timeout(log, left).unwrap().0;
        }
        let oldest = log.kept.front().map_or(log.last + 1, |e| e.seq);
        Events {
            events: log.kept.iter().filter(|e| e.seq > after).cloned().collect(),
            missed: oldest.saturating_sub(after.saturating_add(1)),
            last: log.last,
        }
    }
}

/// Host `CLOCK_MONOTONIC` in ns.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase(p: Phase) -> EventKind {
        EventKind::Source {
            phase: p,
            error: None,
            total_ms: None,
            downtime_ms: None,
            bytes_sent: None,
            job: None,
        }
    }

    #[test]
    fn a_reader_gets_what_came_after_its_mark_in_order() {
        let log = EventLog::default();
        log.push(phase(Phase::Setup));
        log.push(phase(Phase::Precopy));
        let all = log.since(0, Duration::ZERO);
        assert_eq!(all.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((all.last, all.missed), (2, 0));
        let rest = log.since(1, Duration::ZERO);
        assert_eq!(rest.events.len(), 1);
        assert_eq!(rest.events[0].what, phase(Phase::Precopy));
        assert!(log.since(2, Duration::ZERO).events.is_empty());
    }

    #[test]
    fn a_waiting_reader_wakes_when_an_event_arrives() {
        let log = std::sync::Arc::new(EventLog::default());
        let writer = log.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.push(phase(Phase::Completed));
        });
        let got = log.since(0, Duration::from_secs(30));
        t.join().unwrap();
        assert_eq!(
            got.events.len(),
            1,
            "woken by the event, not the wait's end"
        );
        assert!(log.since(1, Duration::from_millis(10)).events.is_empty());
    }

    /// Issue 55 (review): `after + 1` overflowed for the largest number a query can give
    /// (`after=18446744073709551615`), a panic on the API's thread in a debug build.
    #[test]
    fn regression_a_reader_past_every_number_is_answered_without_overflow() {
        let log = EventLog::default();
        log.push(phase(Phase::Setup));
        let got = log.since(u64::MAX, Duration::ZERO);
        assert!(got.events.is_empty());
        assert_eq!((got.last, got.missed), (1, 0));
    }

    #[test]
    fn a_log_that_carries_on_from_an_earlier_one_numbers_after_it() {
        let earlier = EventLog::default();
        earlier.push(phase(Phase::Setup));
        earlier.push(phase(Phase::Completed));
        let next = EventLog::default();
        next.push(phase(Phase::Precopy));
        next.carry_on_from(&earlier);
        next.push(phase(Phase::Failed));
        let all = next.since(0, Duration::ZERO);
        assert_eq!(
            all.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        assert_eq!(all.events[2].what, phase(Phase::Precopy));
        assert_eq!(all.last, 4);
        assert_eq!(
            next.since(2, Duration::ZERO).events.len(),
            2,
            "a watcher of the earlier log reads on"
        );
    }

    #[test]
    fn a_reader_that_fell_behind_is_told_how_many_it_missed() {
        let log = EventLog::default();
        for _ in 0..KEPT + 10 {
            log.push(phase(Phase::Precopy));
        }
        let got = log.since(0, Duration::ZERO);
        assert_eq!(got.events.len(), KEPT);
        assert_eq!(got.missed, 10);
        assert_eq!(got.events[0].seq, 11);
    }
}
