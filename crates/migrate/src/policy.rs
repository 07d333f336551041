//! When precopy stops iterating: a pure function from what was measured to what to do.
//!
//! The work a switchover must do is what is still dirty *and* what was sent but not yet taken
//! in by the destination (in flight: queued in the source's senders, in socket buffers, being
//! digested on the other side). Both go at the rate the destination absorbs data, so the
//! predicted downtime is their sum over that rate. Pausing while much is in flight would make
//! the final pass queue behind it; waiting for it instead ([`Decision::Drain`]) costs the guest
//! nothing, so the policy drains before it switches over.

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::Serialize;

/// What to do when a migration has not converged by its timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeoutAction {
    /// Give up: the source keeps running, nothing is lost. The default, because a forced
    /// switchover's pause can be arbitrarily longer than the downtime limit.
    Cancel,
    /// Pause the guest and send the rest, however long that takes.
    Switchover,
}

/// The knobs, named as QEMU names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Policy {
    pub downtime_limit: Duration,
    pub timeout: Option<Duration>,
    pub timeout_action: TimeoutAction,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            downtime_limit: Duration::from_millis(300),
            timeout: None,
            timeout_action: TimeoutAction::Cancel,
        }
    }
}

/// What the loop knows after a dirty sync.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// Bytes still dirty.
    pub remaining_bytes: u64,
    /// Bytes sent (or queued to send) that the destination has not acknowledged; 0 when the
    /// destination does not acknowledge.
    pub in_flight_bytes: u64,
    /// The rate the destination takes data in over the recent window, bytes per second (the
    /// send rate when it does not acknowledge; 0 when nothing was measured yet).
    pub bandwidth: f64,
    /// Time since the migration started.
    pub elapsed: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run another pass.
    Iterate,
    /// The dirty pages fit, but what is in flight does not let the pause start yet: send
    /// nothing, wait (at most [`drain_bound`]) for the destination to take it in, then sync
    /// and decide again.
    Drain,
    /// Pause the guest and send the rest.
    Switchover,
    /// Stop trying; the source keeps running.
    Cancel,
}

/// What may still be in flight when the guest pauses, as time at the destination's rate: the
/// final pass queues behind it, so it is downtime. 2 ms keeps an idle guest's pause (whose
/// final sync, state save, load and resume take ~3 ms on this project's machine) under the
/// 10 ms goal, and is above the jitter of a destination that acknowledges every 10 ms.
pub const SETTLED: Duration = Duration::from_millis(2);
/// The shortest drain: five acknowledgement intervals of the destination (10 ms each), so a
/// drain that made no progress was a destination that does not acknowledge, not bad luck.
pub const DRAIN_MIN: Duration = Duration::from_millis(50);
/// The longest drain: the guest dirties pages meanwhile, so after this the loop syncs and
/// decides again rather than wait on a rate estimate that may be stale.
pub const DRAIN_MAX: Duration = Duration::from_secs(2);

impl Observation {
    /// How long sending the rest and waiting for what is in flight would take at the measured
    /// bandwidth.
    pub fn expected_downtime(&self) -> Option<Duration> {
        (self.bandwidth > 0.0).then(|| self.at_rate(self.remaining_bytes + self.in_flight_bytes))
    }

    fn at_rate(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bandwidth)
    }

    /// Whether what is in flight is small enough to pause behind ([`SETTLED`]).
    pub fn settled(&self) -> bool {
        self.in_flight_bytes == 0
            || (self.bandwidth > 0.0 && self.at_rate(self.in_flight_bytes) <= SETTLED)
    }
}

/// Switch over when the rest, with what is in flight, fits in the downtime limit at the
/// measured bandwidth and little is in flight; drain first when only the dirty pages fit;
/// otherwise iterate until the timeout, then do what the policy says.
pub fn decide(policy: &Policy, now: &Observation) -> Decision {
    let dirty_only = Observation {
        in_flight_bytes: 0,
        ..*now
    };
    if fits(policy, &dirty_only) {
        return if now.settled() && fits(policy, now) {
            Decision::Switchover
        } else {
            Decision::Drain
        };
    }
    match policy.timeout {
        Some(t) if now.elapsed >= t => match policy.timeout_action {
            TimeoutAction::Cancel => Decision::Cancel,
            TimeoutAction::Switchover => Decision::Switchover,
        },
        _ => Decision::Iterate,
    }
}

/// Whether what is left, with what is in flight, can be taken in within the downtime limit at
/// the measured bandwidth.
pub fn fits(policy: &Policy, now: &Observation) -> bool {
    now.remaining_bytes + now.in_flight_bytes == 0
        || now
            .expected_downtime()
            .is_some_and(|d| d <= policy.downtime_limit)
}

/// How long a [`Decision::Drain`] may wait: twice the time the in-flight bytes take at the
/// measured rate (the rate is an estimate), within [`DRAIN_MIN`]..=[`DRAIN_MAX`].
pub fn drain_bound(now: &Observation) -> Duration {
    if now.bandwidth <= 0.0 {
        return DRAIN_MAX;
    }
    (now.at_rate(now.in_flight_bytes) * 2).clamp(DRAIN_MIN, DRAIN_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    fn obs(remaining_mb: u64, bandwidth_mb_s: f64, elapsed_s: u64) -> Observation {
        Observation {
            remaining_bytes: remaining_mb * MB,
            in_flight_bytes: 0,
            bandwidth: bandwidth_mb_s * MB as f64,
            elapsed: Duration::from_secs(elapsed_s),
        }
    }

    #[test]
    fn decisions() {
        let limit = Policy::default();
        let timed = |action| Policy {
            timeout: Some(Duration::from_secs(60)),
            timeout_action: action,
            ..Policy::default()
        };
        let table = [
            (limit, obs(0, 0.0, 1), Decision::Switchover),
            (limit, obs(100, 1000.0, 1), Decision::Switchover),
            (limit, obs(300, 1000.0, 1), Decision::Switchover),
            (limit, obs(301, 1000.0, 1), Decision::Iterate),
            (limit, obs(1, 0.0, 1), Decision::Iterate),
            (limit, obs(5000, 1000.0, 600), Decision::Iterate),
            (
                timed(TimeoutAction::Cancel),
                obs(5000, 1000.0, 59),
                Decision::Iterate,
            ),
            (
                timed(TimeoutAction::Cancel),
                obs(5000, 1000.0, 60),
                Decision::Cancel,
            ),
            (
                timed(TimeoutAction::Switchover),
                obs(5000, 1000.0, 61),
                Decision::Switchover,
            ),
            (
                timed(TimeoutAction::Cancel),
                obs(10, 1000.0, 61),
                Decision::Switchover,
            ),
        ];
        for (policy, o, want) in table {
            assert_eq!(decide(&policy, &o), want, "{policy:?} {o:?}");
        }
    }

    fn in_flight(remaining_mb: u64, in_flight_mb: f64, bandwidth_mb_s: f64) -> Observation {
        Observation {
            in_flight_bytes: (in_flight_mb * MB as f64) as u64,
            ..obs(remaining_mb, bandwidth_mb_s, 1)
        }
    }

    #[test]
    fn what_is_in_flight_counts_as_work_and_is_drained_first() {
        let limit = Policy::default(); // 300 ms
        let forced = Policy {
            timeout: Some(Duration::from_secs(1)),
            timeout_action: TimeoutAction::Switchover,
            ..Policy::default()
        };
        // (policy, remaining MB, in flight MB, MB/s, decision)
        let table = [
            // An idle guest right after pass 1: 10 MB dirty, 200 MB still queued: drain.
            (limit, 10, 200.0, 1000.0, Decision::Drain),
            // Drained to 1 ms of data: pause.
            (limit, 10, 1.0, 1000.0, Decision::Switchover),
            // 2 ms in flight is settled; 3 ms is not.
            (limit, 10, 2.0, 1000.0, Decision::Switchover),
            (limit, 10, 3.0, 1000.0, Decision::Drain),
            // Nothing dirty at all, but much in flight: still drain.
            (limit, 0, 50.0, 1000.0, Decision::Drain),
            // Settled, but dirty + in flight just over the limit: drain the last bit.
            (limit, 299, 2.0, 1000.0, Decision::Drain),
            // The dirty pages alone do not fit: in flight does not matter, iterate.
            (limit, 400, 0.0, 1000.0, Decision::Iterate),
            (limit, 400, 500.0, 1000.0, Decision::Iterate),
            // No rate measured yet: nothing fits, iterate (as without acknowledgements).
            (limit, 10, 5.0, 0.0, Decision::Iterate),
            // Forced by the timeout: the in-flight bytes do not delay it.
            (forced, 5000, 500.0, 1000.0, Decision::Switchover),
            // But a guest that fits is still drained after the timeout.
            (forced, 10, 500.0, 1000.0, Decision::Drain),
        ];
        for (policy, remaining, flight, rate, want) in table {
            let o = Observation {
                elapsed: Duration::from_secs(5),
                ..in_flight(remaining, flight, rate)
            };
            assert_eq!(decide(&policy, &o), want, "{policy:?} {o:?}");
        }
    }

    #[test]
    fn expected_downtime_includes_what_is_in_flight() {
        let o = in_flight(100, 50.0, 1000.0);
        assert_eq!(o.expected_downtime(), Some(Duration::from_millis(150)));
        assert_eq!(in_flight(100, 50.0, 0.0).expected_downtime(), None);
        assert!(fits(&Policy::default(), &in_flight(250, 50.0, 1000.0)));
        assert!(!fits(&Policy::default(), &in_flight(250, 51.0, 1000.0)));
    }

    #[test]
    fn drains_are_bounded() {
        // (in flight MB, MB/s, bound)
        let table = [
            (100.0, 1000.0, Duration::from_millis(200)),
            (1.0, 1000.0, DRAIN_MIN),
            (0.0, 1000.0, DRAIN_MIN),
            (10_000.0, 1000.0, DRAIN_MAX),
            (100.0, 0.0, DRAIN_MAX),
        ];
        for (flight, rate, want) in table {
            let got = drain_bound(&in_flight(0, flight, rate));
            assert!(
                got.abs_diff(want) < Duration::from_micros(10),
                "{flight} MB at {rate}: {got:?}"
            );
        }
    }
}
