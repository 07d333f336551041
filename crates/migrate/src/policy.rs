//! When precopy stops iterating: a pure function from what was measured to what to do.

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
    /// Send rate over the recent window, bytes per second (0 when nothing was measured yet).
    pub bandwidth: f64,
    /// Time since the migration started.
    pub elapsed: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run another pass.
    Iterate,
    /// Pause the guest and send the rest.
    Switchover,
    /// Stop trying; the source keeps running.
    Cancel,
}

impl Observation {
    /// How long sending the rest would take at the measured bandwidth.
    pub fn expected_downtime(&self) -> Option<Duration> {
        (self.bandwidth > 0.0)
            .then(|| Duration::from_secs_f64(self.remaining_bytes as f64 / self.bandwidth))
    }
}

/// Switch over when the rest fits in the downtime limit at the measured bandwidth; otherwise
/// iterate until the timeout, then do what the policy says.
pub fn decide(policy: &Policy, now: &Observation) -> Decision {
    if fits(policy, now) {
        return Decision::Switchover;
    }
    match policy.timeout {
        Some(t) if now.elapsed >= t => match policy.timeout_action {
            TimeoutAction::Cancel => Decision::Cancel,
            TimeoutAction::Switchover => Decision::Switchover,
        },
        _ => Decision::Iterate,
    }
}

/// Whether what is left can be sent within the downtime limit at the measured bandwidth.
pub fn fits(policy: &Policy, now: &Observation) -> bool {
    now.remaining_bytes == 0
        || now
            .expected_downtime()
            .is_some_and(|d| d <= policy.downtime_limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    fn obs(remaining_mb: u64, bandwidth_mb_s: f64, elapsed_s: u64) -> Observation {
        Observation {
            remaining_bytes: remaining_mb * MB,
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
}
