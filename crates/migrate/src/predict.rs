//! How each way to finish would go, predicted from what the migration measured by the end of
//! a pass: a pure function from [`Measured`] to [`Prediction`].
//!
//! The model replays the policy itself ([`policy::decide`]) over simulated passes, so a
//! prediction and the decisions the loop will take cannot disagree on the rules, only on the
//! figures. A simulated pass sends what is dirty (the first one also what is still in flight)
//! at the measured rate, plus the dirty sync's measured cost; the guest meanwhile dirties at
//! its measured rate, scaled by the throttle (and capped by the dirty limit) the replayed
//! policy puts in force, never more than its populated memory. While the guest dirties slower
//! than the link carries, the passes shrink as a geometric series of dirty-rate / link-rate
//! until the rest fits the downtime limit; otherwise precopy stalls, and what follows is the
//! policy's: iterate until a timeout, slow the guest, or switch to postcopy.
//!
//! The ways to finish, each predicted when the user allowed it:
//! - precopy as set, without slowing the guest ([`Way::Precopy`]);
//! - precopy with auto-converge, by throttle or dirty limit as the policy says
//!   ([`Way::AutoConverge`]; only when auto-converge is on);
//! - postcopy now ([`Way::Postcopy`]; only when the destination granted it): the pause, then
//!   what is dirty at the link's rate while the guest runs on the destination.
//!
//! A pause costs its final pages at the link's rate, the dirty sync that finds them (measured
//! every pass) and [`STATE_AND_RESUME`]. Invariant: no figure comes from a rate that was not
//! measured: without a link rate only a migration with nothing left to send is predicted.

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::policy::{self, Decision, Observation, Policy};

/// What a pause costs besides its final pages and its dirty sync: the state save, its send,
/// the destination's load and resume of a guest with a few KiB of device state. An idle
/// guest's whole pause (final sync included) takes ~3 ms on this project's machine
/// (`policy::SETTLED`), its sync ~1 ms of it.
pub const STATE_AND_RESUME: Duration = Duration::from_millis(2);

/// Simulated passes before a precopy that has not ended is called one that does not converge:
/// a geometric series whose ratio lets 64 passes go by without fitting is no convergence an
/// operator waits for.
pub const MAX_PASSES: u32 = 64;

/// A choice among ways counts as fast enough when its total time is within this factor of the
/// fastest predicted (issue 55's "within 1.1x the best way in hindsight").
pub const FAST_ENOUGH: f64 = 1.1;

/// Downtimes closer than this are a tie, which the earlier way (precopy before postcopy)
/// wins: after a switch to postcopy the guest still waits for each page it touches first
/// (a fault's round trip, hundreds of µs here, `ferry bench postcopy`) and its memory lies on
/// two hosts until the end, so a few ms of pause saved do not pay for that; 5 ms is the
/// downtime issue 55 asks of postcopy for a guest writing flat out.
pub const DOWNTIME_TIE: Duration = Duration::from_millis(5);

/// What the engine measured by the end of a pass (after its dirty sync).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// The pass that just ended.
    pub pass: u32,
    /// Bytes still dirty, at what they cost the link, with pending iterative device state.
    pub remaining_bytes: u64,
    /// Bytes sent or queued that the destination has not taken in yet.
    pub in_flight_bytes: u64,
    /// What the link carries, bytes per second, capped by `max_bandwidth`; `None` until
    /// measured.
    pub rate: Option<f64>,
    /// Bytes the guest dirtied per second over the last pass, under the throttle in force.
    pub dirty_rate: f64,
    /// The most the guest can dirty in a pass: its populated memory.
    pub dirty_cap_bytes: u64,
    /// The last dirty sync's cost, paid once per pass and once in the pause.
    pub sync: Duration,
    /// Time since the migration started.
    pub elapsed: Duration,
    /// The policy's state: stalled passes, the throttle and dirty limit in force.
    pub stalled_passes: u32,
    pub throttle: u8,
    pub dirty_limit: Option<u64>,
}

/// What the user allowed, and how the way is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Allowed {
    pub policy: Policy,
    /// The destination granted postcopy.
    pub postcopy: bool,
    /// Postcopy's own triggers as set: on a stall, after a pass count.
    pub postcopy_on_stall: bool,
    pub postcopy_after_passes: Option<u32>,
    pub choose: Choose,
}

/// Who picks the way to finish.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Choose {
    /// The policy's own rules, as set (the prediction says where they lead).
    #[default]
    Policy,
    /// The prediction: the least downtime among the ways within [`FAST_ENOUGH`] of the
    /// fastest (`--postcopy auto`).
    Prediction,
}

/// A way to finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Way {
    Precopy,
    AutoConverge,
    Postcopy,
}

impl Way {
    pub fn name(self) -> &'static str {
        match self {
            Way::Precopy => "precopy",
            Way::AutoConverge => "auto-converge",
            Way::Postcopy => "postcopy",
        }
    }
}

/// How one way would end. `total_ms` counts from the migration's start.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    /// `None`: it does not end (precopy that never fits, before a timeout that cancels).
    pub total_ms: Option<f64>,
    pub downtime_ms: Option<f64>,
    /// It ends with a pause within the downtime limit.
    pub converges: bool,
}

impl Forecast {
    const NEVER: Forecast = Forecast {
        total_ms: None,
        downtime_ms: None,
        converges: false,
    };
}

/// Every allowed way's forecast, and the one the migration will take.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The pass whose end it was made at.
    pub pass: u32,
    pub precopy: Forecast,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_converge: Option<Forecast>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy: Option<Forecast>,
    pub chosen: Way,
}

impl Prediction {
    /// The chosen way's forecast.
    pub fn forecast(&self) -> Forecast {
        self.of(self.chosen).unwrap_or(Forecast::NEVER)
    }

    /// A way's forecast, if it was allowed.
    pub fn of(&self, way: Way) -> Option<Forecast> {
        match way {
            Way::Precopy => Some(self.precopy),
            Way::AutoConverge => self.auto_converge,
            Way::Postcopy => self.postcopy,
        }
    }
}

/// Predicts every allowed way from `m`, and which the migration takes. `None` when something
/// is left to send and the link's rate was not measured.
pub fn predict(m: &Measured, allowed: &Allowed) -> Option<Prediction> {
    let rate = m.rate.filter(|&r| r > 0.0);
    if rate.is_none() && m.remaining_bytes + m.in_flight_bytes > 0 {
        return None;
    }
    let rate = rate.unwrap_or(0.0);
    let alone = Allowed {
        postcopy: false,
        postcopy_on_stall: false,
        postcopy_after_passes: None,
        ..*allowed
    };
    let plain = Policy {
        auto_converge: None,
        ..allowed.policy
    };
    // Without slowing the guest: no throttle or dirty limit, the guest at its own rate.
    let unslowed = Measured {
        dirty_rate: own_dirty_rate(m),
        throttle: 0,
        dirty_limit: None,
        ..*m
    };
    let precopy = replay(
        &unslowed,
        rate,
        &Allowed {
            policy: plain,
            ..alone
        },
    )
    .0;
    let auto_converge = allowed
        .policy
        .auto_converge
        .map(|_| replay(m, rate, &alone).0);
    let postcopy = allowed.postcopy.then(|| {
        let (at, dirty) = drained(m, rate);
        postcopy_at(m, rate, at, dirty)
    });
    let chosen = match allowed.choose {
        Choose::Policy => replay(m, rate, allowed).1,
        Choose::Prediction => least_downtime(&[
            (Way::Precopy, Some(precopy)),
            (Way::AutoConverge, auto_converge),
            (Way::Postcopy, postcopy),
        ])
        .unwrap_or(Way::Precopy),
    };
    Some(Prediction {
        pass: m.pass,
        precopy,
        auto_converge,
        postcopy,
        chosen,
    })
}

/// The way with the least downtime among those whose total time is within [`FAST_ENOUGH`]
/// of the fastest; of two whose downtimes differ by less than [`DOWNTIME_TIE`], the earlier
/// in `ways`. `None` when no way ends.
fn least_downtime(ways: &[(Way, Option<Forecast>)]) -> Option<Way> {
    let ending = || {
        ways.iter()
            .filter_map(|&(w, f)| Some((w, f?.total_ms?, f?.downtime_ms?)))
    };
    let fastest = ending().map(|(_, t, _)| t).reduce(f64::min)?;
    let tie = DOWNTIME_TIE.as_secs_f64() * 1e3;
    ending()
        .filter(|&(_, t, _)| t <= fastest * FAST_ENOUGH)
        .reduce(|best, w| if w.2 < best.2 - tie { w } else { best })
        .map(|(w, _, _)| w)
}

/// What a pause costs in seconds with `bytes` still to send at `rate`.
fn pause_s(m: &Measured, bytes: f64, rate: f64) -> f64 {
    secs(bytes, rate) + m.sync.as_secs_f64() + STATE_AND_RESUME.as_secs_f64()
}

/// When what is in flight has gone, and what is dirty then. It goes first, whatever comes
/// next: in front of the next pass, or drained before a pause (time, not downtime); the guest
/// dirties meanwhile.
fn drained(m: &Measured, rate: f64) -> (Duration, f64) {
    let drain = secs(m.in_flight_bytes as f64, rate);
    let dirtied = own_pace(own_dirty_rate(m), m.throttle, m.dirty_limit) * drain;
    let cap = m.dirty_cap_bytes.max(m.remaining_bytes) as f64;
    (
        m.elapsed + Duration::from_secs_f64(drain),
        (m.remaining_bytes as f64 + dirtied).min(cap),
    )
}

/// Postcopy started `at` with `dirty` bytes left: the pause carries no pages, the rest
/// follows at the link's rate while the guest runs on the destination.
fn postcopy_at(m: &Measured, rate: f64, at: Duration, dirty: f64) -> Forecast {
    let pause = pause_s(m, 0.0, rate);
    let total = at.as_secs_f64() + pause + secs(dirty, rate);
    Forecast {
        total_ms: Some(total * 1e3),
        downtime_ms: Some(pause * 1e3),
        converges: true,
    }
}

/// How long `bytes` take at `rate` (nothing takes no time, whatever the rate).
fn secs(bytes: f64, rate: f64) -> f64 {
    if bytes > 0.0 { bytes / rate } else { 0.0 }
}

/// The rate the guest dirties at unthrottled: the measured one was taken under the throttle
/// in force (a dirty limit in force hides it: the measured rate is taken as the guest's).
fn own_dirty_rate(m: &Measured) -> f64 {
    m.dirty_rate / (1.0 - f64::from(m.throttle.min(99)) / 100.0)
}

/// The rate the guest dirties at, from its own `base`, under `throttle` and `limit`.
fn own_pace(base: f64, throttle: u8, limit: Option<u64>) -> f64 {
    let paced = base * (1.0 - f64::from(throttle) / 100.0);
    limit.map_or(paced, |l| paced.min(l as f64))
}

/// Replays the policy of `allowed` over simulated passes from `m`: how it ends, and by which
/// way (auto-converge once it slows the guest, postcopy once it switches).
fn replay(m: &Measured, rate: f64, allowed: &Allowed) -> (Forecast, Way) {
    let p = &allowed.policy;
    let base = own_dirty_rate(m);
    let (mut throttle, mut limit, mut stalled) = (m.throttle, m.dirty_limit, m.stalled_passes);
    let mut slowed = m.throttle > 0 || m.dirty_limit.is_some();
    // What is in flight goes first, whatever comes next: in front of the next pass, or
    // drained before a pause (time, not downtime). The guest dirties meanwhile.
    let (mut elapsed, mut remaining) = drained(m, rate);
    let way = |slowed: bool| {
        if slowed {
            Way::AutoConverge
        } else {
            Way::Precopy
        }
    };
    for pass in m.pass..m.pass + MAX_PASSES {
        let now = Observation {
            remaining_bytes: remaining as u64,
            in_flight_bytes: 0,
            bandwidth: rate,
            elapsed,
            stalled_passes: stalled,
            throttle,
            dirty_limit: limit,
            postcopy_granted: allowed.postcopy,
            postcopy_on_stall: allowed.postcopy_on_stall,
            switchover_ready: true,
        };
        let asked = allowed.postcopy && allowed.postcopy_after_passes.is_some_and(|n| pass >= n);
        let decision = if asked {
            Decision::Postcopy
        } else {
            policy::decide(p, &now)
        };
        match decision {
            // Nothing is in flight in the replay, so a drain is one for want of a rate, which
            // the replay has: not a case it meets.
            Decision::Switchover | Decision::AwaitReady | Decision::Drain => {
                let pause = pause_s(m, remaining, rate);
                let forecast = Forecast {
                    total_ms: Some((elapsed.as_secs_f64() + pause) * 1e3),
                    downtime_ms: Some(pause * 1e3),
                    converges: policy::fits(p, &now),
                };
                return (forecast, way(slowed));
            }
            Decision::Postcopy => {
                return (postcopy_at(m, rate, elapsed, remaining), Way::Postcopy);
            }
            Decision::Cancel => return (Forecast::NEVER, way(slowed)),
            Decision::Throttle(percent) => (throttle, slowed) = (percent, true),
            Decision::LimitDirty(rate) => (limit, slowed) = (Some(rate), true),
            Decision::Iterate => {}
        }
        let took = secs(remaining, rate) + m.sync.as_secs_f64();
        let dirtied = (own_pace(base, throttle, limit) * took).min(m.dirty_cap_bytes as f64);
        stalled = policy::stall_count(stalled, remaining as u64, dirtied as u64);
        elapsed += Duration::from_secs_f64(took);
        remaining = dirtied;
    }
    (Forecast::NEVER, way(slowed))
}

#[cfg(test)]
mod tests;
