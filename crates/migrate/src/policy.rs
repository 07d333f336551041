//! When precopy stops iterating, and what it does when it cannot: a pure function from what
//! was measured to what to do.
//!
//! The work a switchover must do is what is still dirty *and* what was sent but not yet taken
//! in by the destination (in flight: queued in the source's senders, in socket buffers, being
//! digested on the other side). Both go at the rate the destination absorbs data, so the
//! predicted downtime is their sum over that rate. Pausing while much is in flight would make
//! the final pass queue behind it; waiting for it instead ([`Decision::Drain`]) costs the guest
//! nothing, so the policy drains before it switches over.
//!
//! A guest that dirties memory about as fast as the link carries it never fits. Precopy has
//! *stalled* when, for [`STALL_PASSES`] passes in a row, the guest dirtied more than half of
//! what the pass sent (QEMU's auto-converge trigger). A stalled migration switches to
//! postcopy if it may ([`Observation::postcopy_on_stall`]), else slows the guest down
//! ([`Policy::auto_converge`]: its vCPUs sleep a share of every 10 ms, starting at 20% and
//! growing 10 points per stalled pass up to a cap), else keeps iterating until the timeout.

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What to do when a migration has not converged by its timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeoutAction {
    /// Give up: the source keeps running, nothing is lost. The default, because a forced
    /// switchover's pause can be arbitrarily longer than the downtime limit.
    Cancel,
    /// Pause the guest and send the rest, however long that takes.
    Switchover,
    /// Switch to postcopy: the guest moves now and its remaining pages follow. Needs postcopy
    /// to be enabled (and granted); the pause is as short as with a converged migration.
    Postcopy,
}

/// Auto-converge: the throttle steps, in percent of each vCPU's time spent asleep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct AutoConverge {
    /// The first throttle (QEMU's cpu-throttle-initial, 20).
    pub initial: u8,
    /// Added per further stalled pass (QEMU's cpu-throttle-increment, 10).
    pub increment: u8,
    /// The most it throttles, below 100 (QEMU's max-cpu-throttle, 99).
    pub max: u8,
}

impl Default for AutoConverge {
    fn default() -> Self {
        AutoConverge {
            initial: 20,
            increment: 10,
            max: 99,
        }
    }
}

impl AutoConverge {
    /// The default steps capped at `max` percent (the first throttle no higher than the cap).
    pub fn up_to(max: u8) -> AutoConverge {
        let d = AutoConverge::default();
        AutoConverge {
            initial: d.initial.min(max),
            max,
            ..d
        }
    }

    /// The throttle after `current` when precopy is still stalled, or `None` at the cap.
    pub fn next(&self, current: u8) -> Option<u8> {
        let next = match current {
            0 => self.initial,
            c => c.saturating_add(self.increment),
        }
        .min(self.max);
        (next > current).then_some(next)
    }
}

/// How auto-converge slows a stalled guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConvergeBy {
    /// Every vCPU sleeps a share of its time ([`AutoConverge`]'s steps).
    #[default]
    Throttle,
    /// Each vCPU may dirty at most a rate, and only those that dirty faster sleep
    /// ([`next_dirty_limit`]'s steps): vCPUs that only compute run freely. Needs a VMM that
    /// knows which vCPU dirtied a page (the reference VMM with its dirty ring).
    DirtyLimit,
}

/// The lowest per-vCPU dirty limit auto-converge sets: 1 MB/s (QEMU's vcpu-dirty-limit
/// default).
pub const DIRTY_LIMIT_FLOOR: u64 = 1_000_000;

/// The per-vCPU dirty limit after `current` (bytes per second; `None`: none yet) when precopy
/// is still stalled at `bandwidth`: half of what the link carries at first, so that one
/// writing vCPU dirties at most half of what a pass sends (the stall test's line), then half
/// the limit at each further stall, down to [`DIRTY_LIMIT_FLOOR`]; `None` at the floor.
pub fn next_dirty_limit(current: Option<u64>, bandwidth: f64) -> Option<u64> {
    let next = match current {
        None => (bandwidth / 2.0) as u64,
        Some(c) => c / 2,
    }
    .max(DIRTY_LIMIT_FLOOR);
    current.is_none_or(|c| next < c).then_some(next)
}

/// The knobs, named as QEMU names them.
///
/// The default is what a careful operator wants: a migration that finishes and can lose
/// nothing. Auto-converge is on, because slowing the guest for a few seconds needs nothing from
/// the destination and leaves the source's copy whole until the pause; postcopy on a stall is
/// off, because it needs postcopy enabled on both sides and puts the guest's memory on two
/// hosts until it completes. No timeout: with the throttle, precopy finishes on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Policy {
    pub downtime_limit: Duration,
    pub timeout: Option<Duration>,
    pub timeout_action: TimeoutAction,
    /// Throttle the guest when precopy stalls; `None`: never.
    pub auto_converge: Option<AutoConverge>,
    /// How auto-converge slows the guest (the throttle's steps, or a per-vCPU dirty limit).
    pub converge_by: ConvergeBy,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            downtime_limit: Duration::from_millis(300),
            timeout: None,
            timeout_action: TimeoutAction::Cancel,
            auto_converge: Some(AutoConverge::default()),
            converge_by: ConvergeBy::Throttle,
        }
    }
}

/// Passes in a row that must dirty more than half of what they sent before precopy counts as
/// stalled: QEMU's auto-converge waits for two such syncs, so that one burst does not throttle.
pub const STALL_PASSES: u32 = 2;

/// The stall count after a pass that sent `sent` bytes while the guest dirtied `dirtied`:
/// one more when the guest dirtied more than half of it, else back to 0.
pub fn stall_count(before: u32, sent: u64, dirtied: u64) -> u32 {
    if dirtied > sent / 2 { before + 1 } else { 0 }
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
    /// Passes in a row that dirtied more than half of what they sent ([`stall_count`]).
    pub stalled_passes: u32,
    /// The throttle in force, percent.
    pub throttle: u8,
    /// The per-vCPU dirty limit in force, bytes per second.
    pub dirty_limit: Option<u64>,
    /// Whether the destination granted postcopy.
    pub postcopy_granted: bool,
    /// Whether postcopy's settings ask for it when precopy stalls
    /// ([`Postcopy::on_stall`](crate::source::Postcopy::on_stall)).
    pub postcopy_on_stall: bool,
    /// Whether the destination's devices with iterative state are ready for a switchover
    /// (QEMU's switchover-ack); true without such state.
    pub switchover_ready: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run another pass.
    Iterate,
    /// The dirty pages fit, but what is in flight does not let the pause start yet: send
    /// nothing, wait (at most [`drain_bound`]) for the destination to take it in, then sync
    /// and decide again.
    Drain,
    /// Everything fits, but the destination's devices did not say they are ready for the
    /// switchover ([`Observation::switchover_ready`], QEMU's switchover-ack): wait a moment
    /// ([`READY_WAIT`]) for their StateReady, then run another pass, so that what changed
    /// keeps going and the destination keeps hearing from the source.
    AwaitReady,
    /// Pause the guest and send the rest.
    Switchover,
    /// Hand the guest over now and send the rest while it runs there.
    Postcopy,
    /// Set the guest's throttle to this percent, then run another pass.
    Throttle(u8),
    /// Limit each vCPU's dirty rate to this many bytes per second, then run another pass.
    LimitDirty(u64),
    /// Stop trying; the source keeps running.
    Cancel,
}

/// What may still be in flight when the guest pauses, as time at the destination's rate: the
/// final pass queues behind it, so it is downtime. 2 ms keeps an idle guest's pause (whose
/// final sync, state save, load and resume take ~3 ms on this project's machine) under the
/// 10 ms goal, and is above the jitter of a destination that acknowledges every 10 ms.
pub const SETTLED: Duration = Duration::from_millis(2);
/// The longest a [`Decision::AwaitReady`] waits for the destination's StateReady before the
/// next pass: one acknowledgement interval of the destination (10 ms), which carries it.
pub const READY_WAIT: Duration = Duration::from_millis(10);
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
/// at the timeout do what the policy says; drain when no rate was measured yet but something
/// is in flight (its acknowledgement measures one: deciding without it would take a guest's
/// few dirty pages for a stall); when stalled switch to postcopy or throttle (if the policy
/// allows); otherwise iterate.
pub fn decide(policy: &Policy, now: &Observation) -> Decision {
    let dirty_only = Observation {
        in_flight_bytes: 0,
        ..*now
    };
    let timed_out = policy.timeout.is_some_and(|t| now.elapsed >= t);
    let at_timeout = || match policy.timeout_action {
        TimeoutAction::Cancel => Decision::Cancel,
        TimeoutAction::Switchover => Decision::Switchover,
        TimeoutAction::Postcopy if now.postcopy_granted => Decision::Postcopy,
        // Not granted (the source checks this cannot be asked for without postcopy):
        // the only way left to finish.
        TimeoutAction::Postcopy => Decision::Switchover,
    };
    if fits(policy, &dirty_only) {
        return if !(now.settled() && fits(policy, now)) {
            Decision::Drain
        } else if now.switchover_ready {
            Decision::Switchover
        } else if timed_out {
            // A destination whose devices never get ready does not outlast the timeout.
            at_timeout()
        } else {
            Decision::AwaitReady
        };
    }
    if timed_out {
        return at_timeout();
    }
    if now.bandwidth <= 0.0 && now.in_flight_bytes > 0 {
        return Decision::Drain;
    }
    if now.stalled_passes < STALL_PASSES {
        return Decision::Iterate;
    }
    if now.postcopy_on_stall && now.postcopy_granted {
        return Decision::Postcopy;
    }
    let Some(a) = policy.auto_converge else {
        return Decision::Iterate;
    };
    match policy.converge_by {
        ConvergeBy::Throttle => a.next(now.throttle).map(Decision::Throttle),
        ConvergeBy::DirtyLimit => {
            next_dirty_limit(now.dirty_limit, now.bandwidth).map(Decision::LimitDirty)
        }
    }
    .unwrap_or(Decision::Iterate)
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
            stalled_passes: 0,
            throttle: 0,
            dirty_limit: None,
            postcopy_granted: false,
            postcopy_on_stall: false,
            switchover_ready: true,
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
            // No rate measured yet, but something in flight: its acknowledgement will
            // measure the link, so wait for it rather than guess (an idle guest's first pass).
            (limit, 10, 5.0, 0.0, Decision::Drain),
            (limit, 5000, 5.0, 0.0, Decision::Drain),
            // Nothing measured and nothing in flight (no acknowledgements): iterate.
            (limit, 10, 0.0, 0.0, Decision::Iterate),
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
    fn a_stalled_precopy_limits_each_vcpu_from_half_the_link_down_to_the_floor() {
        let by_limit = Policy {
            converge_by: ConvergeBy::DirtyLimit,
            ..Policy::default()
        };
        // (stalled passes, limit in force, measured bandwidth B/s, decision)
        let table = [
            (1, None, 100e6, Decision::Iterate),
            (2, None, 100e6, Decision::LimitDirty(50_000_000)),
            (3, Some(50_000_000), 100e6, Decision::LimitDirty(25_000_000)),
            (
                2,
                Some(1_500_000),
                100e6,
                Decision::LimitDirty(DIRTY_LIMIT_FLOOR),
            ),
            // At the floor there is no further step.
            (2, Some(DIRTY_LIMIT_FLOOR), 100e6, Decision::Iterate),
            // A link slower than twice the floor starts at the floor.
            (2, None, 1e6, Decision::LimitDirty(DIRTY_LIMIT_FLOOR)),
        ];
        for (passes, limit, bandwidth, want) in table {
            let o = Observation {
                dirty_limit: limit,
                bandwidth,
                ..stalled(passes, 0, false)
            };
            assert_eq!(decide(&by_limit, &o), want, "{o:?}");
        }
        // Without auto-converge, no limit; a stalled guest that fits is switched over.
        let off = Policy {
            auto_converge: None,
            ..by_limit
        };
        assert_eq!(decide(&off, &stalled(3, 0, false)), Decision::Iterate);
        let fits = Observation {
            remaining_bytes: 1_000_000,
            ..stalled(3, 0, false)
        };
        assert_eq!(decide(&by_limit, &fits), Decision::Switchover);
    }

    /// Iterative state (QEMU's switchover-ack): a switchover that fits waits for the
    /// destination's StateReady, passes going on meanwhile, until the timeout, whose action
    /// then applies.
    #[test]
    fn a_switchover_waits_for_the_destination_s_state_ready() {
        let not_ready = |o: Observation| Observation {
            switchover_ready: false,
            ..o
        };
        let forced = Policy {
            timeout: Some(Duration::from_secs(60)),
            timeout_action: TimeoutAction::Switchover,
            ..Policy::default()
        };
        let table = [
            (Policy::default(), obs(100, 1000.0, 1), Decision::Switchover),
            (
                Policy::default(),
                not_ready(obs(100, 1000.0, 1)),
                Decision::AwaitReady,
            ),
            (
                Policy::default(),
                not_ready(obs(0, 0.0, 1)),
                Decision::AwaitReady,
            ),
            (
                Policy::default(),
                not_ready(obs(5000, 1000.0, 1)),
                Decision::Iterate,
            ),
            (
                forced,
                not_ready(obs(5000, 1000.0, 61)),
                Decision::Switchover,
            ),
            // Everything fits, the devices are not ready, and the timeout passed: its action.
            (
                forced,
                not_ready(obs(100, 1000.0, 61)),
                Decision::Switchover,
            ),
            (
                forced,
                not_ready(obs(100, 1000.0, 59)),
                Decision::AwaitReady,
            ),
            (
                Policy {
                    timeout_action: TimeoutAction::Cancel,
                    ..forced
                },
                not_ready(obs(100, 1000.0, 61)),
                Decision::Cancel,
            ),
        ];
        for (policy, o, want) in table {
            assert_eq!(decide(&policy, &o), want, "{o:?}");
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

    fn stalled(passes: u32, throttle: u8, postcopy_granted: bool) -> Observation {
        Observation {
            stalled_passes: passes,
            throttle,
            dirty_limit: None,
            postcopy_granted,
            ..obs(1000, 1000.0, 5)
        }
    }

    #[test]
    fn a_stalled_precopy_switches_to_postcopy_or_throttles_as_the_policy_allows() {
        let careful = Policy::default();
        let plain = Policy {
            auto_converge: None,
            ..Policy::default()
        };
        let capped = Policy {
            auto_converge: Some(AutoConverge {
                max: 50,
                ..AutoConverge::default()
            }),
            ..Policy::default()
        };
        // (policy, postcopy asked for on a stall, stalled passes, throttle in force,
        // postcopy granted, decision)
        let table = [
            // One stalled pass is not a stall yet.
            (careful, false, 1, 0, false, Decision::Iterate),
            (careful, false, 2, 0, false, Decision::Throttle(20)),
            (careful, false, 3, 20, false, Decision::Throttle(30)),
            (careful, false, 2, 90, false, Decision::Throttle(99)),
            (careful, false, 2, 99, false, Decision::Iterate),
            // Postcopy granted but not asked for on a stall: the careful default throttles.
            (careful, false, 2, 0, true, Decision::Throttle(20)),
            (plain, false, 5, 0, false, Decision::Iterate),
            (plain, false, 5, 0, true, Decision::Iterate),
            // Asked for and granted: postcopy first, whatever the throttle.
            (careful, true, 2, 0, true, Decision::Postcopy),
            (careful, true, 1, 0, true, Decision::Iterate),
            (careful, true, 2, 40, true, Decision::Postcopy),
            (plain, true, 2, 0, true, Decision::Postcopy),
            // Asked for but not granted: throttling is what is left.
            (careful, true, 2, 0, false, Decision::Throttle(20)),
            (capped, true, 2, 40, false, Decision::Throttle(50)),
            (capped, true, 2, 50, false, Decision::Iterate),
        ];
        for (policy, on_stall, passes, throttle, granted, want) in table {
            let o = Observation {
                postcopy_on_stall: on_stall,
                ..stalled(passes, throttle, granted)
            };
            assert_eq!(decide(&policy, &o), want, "{policy:?} {o:?}");
        }
        // A stalled guest that fits is switched over, not throttled.
        let fits = Observation {
            remaining_bytes: 10 * MB,
            postcopy_on_stall: true,
            ..stalled(4, 0, true)
        };
        assert_eq!(decide(&careful, &fits), Decision::Switchover);
    }

    #[test]
    fn the_timeout_comes_before_the_stall_rules() {
        let timed = |action| Policy {
            timeout: Some(Duration::from_secs(5)),
            timeout_action: action,
            ..Policy::default()
        };
        let table = [
            (TimeoutAction::Cancel, true, Decision::Cancel),
            (TimeoutAction::Switchover, true, Decision::Switchover),
            (TimeoutAction::Postcopy, true, Decision::Postcopy),
            (TimeoutAction::Postcopy, false, Decision::Switchover),
        ];
        for (action, granted, want) in table {
            let o = Observation {
                postcopy_on_stall: true,
                ..stalled(0, 0, granted)
            };
            assert_eq!(decide(&timed(action), &o), want, "{action:?} {o:?}");
        }
    }

    #[test]
    fn a_pass_is_stalled_when_the_guest_dirtied_more_than_half_of_what_it_sent() {
        // (stalled before, MB sent, MB dirtied, stalled after)
        let table = [
            (0, 1000, 501, 1),
            (1, 1000, 900, 2),
            (3, 1000, 500, 0),
            (2, 1000, 10, 0),
            (0, 0, 1, 1),
            (0, 0, 0, 0),
        ];
        for (before, sent, dirtied, want) in table {
            assert_eq!(stall_count(before, sent * MB, dirtied * MB), want);
        }
    }

    #[test]
    fn throttle_steps_start_at_the_initial_grow_by_the_increment_and_stop_at_the_cap() {
        let a = AutoConverge::default();
        let mut steps = vec![];
        let mut t = 0;
        while let Some(n) = a.next(t) {
            steps.push(n);
            t = n;
        }
        assert_eq!(steps, [20, 30, 40, 50, 60, 70, 80, 90, 99]);
        let odd = AutoConverge {
            initial: 60,
            increment: 30,
            max: 80,
        };
        assert_eq!(odd.next(0), Some(60));
        assert_eq!(odd.next(60), Some(80));
        assert_eq!(odd.next(80), None);
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
