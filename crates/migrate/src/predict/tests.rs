//! The prediction as tables: a guest at rest, one that converges as a geometric series, one
//! writing faster than the link, and who picks the way.

use super::*;
use crate::policy::{AutoConverge, TimeoutAction};

const MB: f64 = 1e6;

/// A guest measured at the end of pass 1, 1 s in: `remaining` MB dirty, a link of `rate`
/// MB/s, dirtying `dirty` MB/s, 1 GB populated; no sync cost, so the figures are sums.
fn at_pass_1(remaining: f64, rate: f64, dirty: f64) -> Measured {
    Measured {
        pass: 1,
        remaining_bytes: (remaining * MB) as u64,
        in_flight_bytes: 0,
        rate: Some(rate * MB),
        dirty_rate: dirty * MB,
        dirty_cap_bytes: 1_000_000_000,
        sync: Duration::ZERO,
        elapsed: Duration::from_secs(1),
        stalled_passes: 0,
        throttle: 0,
        dirty_limit: None,
    }
}

fn allowed(auto_converge: bool, postcopy: bool, choose: Choose) -> Allowed {
    Allowed {
        policy: Policy {
            auto_converge: auto_converge.then(AutoConverge::default),
            ..Policy::default()
        },
        postcopy,
        postcopy_on_stall: false,
        postcopy_after_passes: None,
        choose,
    }
}

fn close(got: Option<f64>, want: f64) -> bool {
    got.is_some_and(|g| (g - want).abs() < 0.01)
}

const PAUSE_MS: f64 = 2.0; // STATE_AND_RESUME with no sync

#[test]
fn a_guest_with_nothing_left_is_predicted_without_a_rate_and_one_with_something_is_not() {
    let idle = Measured {
        remaining_bytes: 0,
        rate: None,
        ..at_pass_1(0.0, 1.0, 0.0)
    };
    let p = predict(&idle, &allowed(true, true, Choose::Prediction)).unwrap();
    assert!(close(p.precopy.total_ms, 1000.0 + PAUSE_MS), "{p:?}");
    assert!(close(p.precopy.downtime_ms, PAUSE_MS), "{p:?}");
    assert!(p.precopy.converges);
    assert_eq!(p.chosen, Way::Precopy, "a tie goes to precopy");
    let busy = Measured {
        rate: None,
        ..at_pass_1(10.0, 1.0, 0.0)
    };
    assert_eq!(predict(&busy, &allowed(true, true, Choose::Policy)), None);
    let zero = Measured {
        rate: Some(0.0),
        ..busy
    };
    assert_eq!(predict(&zero, &allowed(true, true, Choose::Policy)), None);
}

#[test]
fn precopy_converges_as_a_geometric_series_of_dirty_rate_over_link_rate() {
    // 400 MB at 100 MB/s: 4 s, dirtying 100 MB; then 1 s, dirtying 25 MB: 250 ms fits 300.
    let p = predict(
        &at_pass_1(400.0, 100.0, 25.0),
        &allowed(false, false, Choose::Policy),
    )
    .unwrap();
    assert!(
        close(p.precopy.total_ms, 1000.0 + 5000.0 + 250.0 + PAUSE_MS),
        "{p:?}"
    );
    assert!(close(p.precopy.downtime_ms, 250.0 + PAUSE_MS), "{p:?}");
    assert!(p.precopy.converges);
    assert_eq!(
        (p.auto_converge, p.postcopy),
        (None, None),
        "neither allowed"
    );
    assert_eq!(p.chosen, Way::Precopy);
    // Each pass's sync is paid per pass and once in the pause.
    let synced = Measured {
        sync: Duration::from_millis(10),
        ..at_pass_1(400.0, 100.0, 25.0)
    };
    let q = predict(&synced, &allowed(false, false, Choose::Policy)).unwrap();
    // 4.01 s dirtying 100.25 MB, 1.0125 s dirtying 25.3125 MB: 253.125 ms of pages.
    let downtime = 253.125 + 10.0 + PAUSE_MS;
    assert!(close(q.precopy.downtime_ms, downtime), "{q:?}");
    assert!(
        close(q.precopy.total_ms, 1000.0 + 4010.0 + 1012.5 + downtime),
        "{q:?}"
    );
}

#[test]
fn a_guest_dirtying_faster_than_the_link_never_converges_by_precopy_alone() {
    let m = at_pass_1(500.0, 100.0, 150.0);
    let p = predict(&m, &allowed(true, true, Choose::Policy)).unwrap();
    assert_eq!(p.precopy, Forecast::NEVER, "{p:?}");
    let ac = p.auto_converge.unwrap();
    assert!(ac.converges, "the throttle brings it in: {ac:?}");
    assert!(ac.downtime_ms.unwrap() <= 300.0 + PAUSE_MS, "{ac:?}");
    assert_eq!(p.chosen, Way::AutoConverge, "the default policy throttles");
    let pc = p.postcopy.unwrap();
    assert!(close(pc.total_ms, 1000.0 + 5000.0 + PAUSE_MS), "{pc:?}");
    assert!(close(pc.downtime_ms, PAUSE_MS), "{pc:?}");
    assert!(pc.total_ms < ac.total_ms, "{pc:?} {ac:?}");
}

#[test]
fn the_policy_as_set_is_what_the_prediction_says_it_takes() {
    let flat_out = at_pass_1(500.0, 100.0, 150.0);
    let mut a = allowed(false, false, Choose::Policy);
    assert_eq!(
        predict(&flat_out, &a).unwrap().chosen,
        Way::Precopy,
        "iterates forever"
    );
    a.policy.timeout = Some(Duration::from_secs(30));
    a.policy.timeout_action = TimeoutAction::Switchover;
    let forced = predict(&flat_out, &a).unwrap().precopy;
    assert!(
        !forced.converges && forced.total_ms.unwrap() >= 30_000.0,
        "{forced:?}"
    );
    // Each pass dirties more than it sent, up to all 1 GB populated: 10 s at 100 MB/s.
    assert!(close(forced.downtime_ms, 10_000.0 + PAUSE_MS), "{forced:?}");
    a.postcopy = true;
    a.postcopy_on_stall = true;
    let p = predict(&flat_out, &a).unwrap();
    assert_eq!(p.chosen, Way::Postcopy, "{p:?}");
    a.postcopy_on_stall = false;
    a.postcopy_after_passes = Some(1);
    assert_eq!(predict(&flat_out, &a).unwrap().chosen, Way::Postcopy);
    a.postcopy_after_passes = Some(2);
    let converging = at_pass_1(400.0, 100.0, 25.0);
    assert_eq!(
        predict(&converging, &a).unwrap().chosen,
        Way::Postcopy,
        "after pass 2"
    );
    a.postcopy_after_passes = Some(4);
    assert_eq!(
        predict(&converging, &a).unwrap().chosen,
        Way::Precopy,
        "it fits first"
    );
}

#[test]
fn the_prediction_chooses_the_least_downtime_within_a_tenth_of_the_fastest() {
    let a = allowed(true, true, Choose::Prediction);
    // Writing flat out: postcopy is the fastest and pauses least.
    let p = predict(&at_pass_1(500.0, 100.0, 150.0), &a).unwrap();
    assert_eq!(p.chosen, Way::Postcopy, "{p:?}");
    // A few dirty pages: precopy pauses a ms longer, a tie it wins.
    let p = predict(&at_pass_1(0.1, 100.0, 0.1), &a).unwrap();
    assert_eq!(p.chosen, Way::Precopy, "{p:?}");
    // Converging, but its last pass pauses 250 ms: postcopy within 1.1x pauses 2 ms.
    let p = predict(&at_pass_1(400.0, 100.0, 25.0), &a).unwrap();
    assert_eq!(p.chosen, Way::Postcopy, "{p:?}");
    // Without postcopy, precopy converges faster than the throttle would need.
    let p = predict(
        &at_pass_1(400.0, 100.0, 25.0),
        &allowed(true, false, Choose::Prediction),
    )
    .unwrap();
    assert_eq!(p.chosen, Way::Precopy, "{p:?}");
}

#[test]
fn least_downtime_keeps_to_ways_fast_enough() {
    let f = |t: f64, d: f64| {
        Some(Forecast {
            total_ms: Some(t),
            downtime_ms: Some(d),
            converges: true,
        })
    };
    let pick = |ways: &[(Way, Option<Forecast>)]| least_downtime(ways);
    assert_eq!(
        pick(&[
            (Way::Precopy, f(1000.0, 100.0)),
            (Way::Postcopy, f(1099.0, 1.0))
        ]),
        Some(Way::Postcopy)
    );
    assert_eq!(
        pick(&[
            (Way::Precopy, f(1000.0, 100.0)),
            (Way::Postcopy, f(1101.0, 1.0))
        ]),
        Some(Way::Precopy)
    );
    assert_eq!(
        pick(&[
            (Way::Precopy, Some(Forecast::NEVER)),
            (Way::AutoConverge, None)
        ]),
        None
    );
}

#[test]
fn the_throttle_in_force_is_taken_out_of_the_measured_dirty_rate() {
    // Measured 50 MB/s under a 50% throttle: the guest's own rate is 100 MB/s, which precopy
    // without the throttle never outruns on a 100 MB/s link.
    let m = Measured {
        throttle: 50,
        ..at_pass_1(500.0, 100.0, 50.0)
    };
    let p = predict(&m, &allowed(true, false, Choose::Policy)).unwrap();
    assert!(!p.precopy.converges, "{p:?}");
    assert!(p.auto_converge.unwrap().converges, "{p:?}");
    assert_eq!(p.chosen, Way::AutoConverge);
}

#[test]
fn what_is_in_flight_costs_time_before_the_pause_not_downtime() {
    // 0.3 MB dirty, 100 MB in flight on a 100 MB/s link, the guest at rest: a second of
    // drain, then a pause with 3 ms of pages.
    let m = Measured {
        in_flight_bytes: 100_000_000,
        ..at_pass_1(0.3, 100.0, 0.0)
    };
    let p = predict(&m, &allowed(true, true, Choose::Prediction)).unwrap();
    let total = 2000.0 + 3.0 + PAUSE_MS;
    assert!(close(p.precopy.downtime_ms, 3.0 + PAUSE_MS), "{p:?}");
    assert!(close(p.precopy.total_ms, total), "{p:?}");
    assert!(close(p.postcopy.unwrap().total_ms, total), "{p:?}");
    assert_eq!(p.chosen, Way::Precopy, "3 ms saved is a tie");
}
