//! `GET /events`: a control plane follows a migration by waiting on the VM's event log, on
//! both sides, instead of polling `GET /migration`.

mod common;

use std::time::Duration;

use common::{RunningVm, start_migrate, stderr};

/// Host `CLOCK_MONOTONIC` in ns, the clock events are stamped with.
fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// Reads `vm`'s events until one says the source's migration ended, each wait long-polling up
/// to 5 s; returns them with when each answer came.
fn watch_until_the_end(vm: &RunningVm) -> Vec<(serde_json::Value, u64)> {
    let mut seen = Vec::new();
    let mut after = 0;
    for _ in 0..200 {
        let got = vm.status_of(&format!("/events?after={after}&wait_ms=5000"));
        let at = now_ns();
        after = got["last"].as_u64().unwrap();
        assert_eq!(got["missed"], 0, "{got}");
        for e in got["events"].as_array().unwrap() {
            seen.push((e.clone(), at));
        }
        if seen.iter().any(|(e, _)| {
            e["event"] == "source"
                && ["completed", "failed", "cancelled"].contains(&e["phase"].as_str().unwrap_or(""))
        }) {
            return seen;
        }
    }
    panic!("no end in 200 answers: {seen:?}");
}

#[test]
fn a_watcher_follows_both_sides_of_a_migration_through_get_events() {
    let src = RunningVm::start("256M", "ws=64M rate=20 verify-ms=200 log-ms=0");
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = common::destination("256M");
    let watched = std::thread::scope(|s| {
        let watcher = s.spawn(|| watch_until_the_end(&src));
        // Started once the watcher waits, so that its first answer is woken by an event.
        std::thread::sleep(Duration::from_millis(200));
        let out = start_migrate(&src, port, &[]).wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        watcher.join().unwrap()
    });
    let phases: Vec<&str> = watched
        .iter()
        .filter(|(e, _)| e["event"] == "source")
        .map(|(e, _)| e["phase"].as_str().unwrap())
        .collect();
    let order = ["setup", "precopy", "switchover", "completed"];
    let mut at = 0;
    for phase in order {
        at += phases[at..]
            .iter()
            .position(|p| *p == phase)
            .unwrap_or_else(|| panic!("no {phase} after {:?} in {phases:?}", &phases[..at]));
    }
    let numbers: Vec<u64> = watched
        .iter()
        .map(|(e, _)| e["seq"].as_u64().unwrap())
        .collect();
    assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
    let passes: Vec<&serde_json::Value> = watched
        .iter()
        .map(|(e, _)| e)
        .filter(|e| e["event"] == "pass")
        .collect();
    assert!(!passes.is_empty() && passes[0]["pass"] == 1, "{passes:?}");
    assert!(
        passes.iter().all(|p| p["elapsed_ms"].as_f64() > Some(0.0)),
        "{passes:?}"
    );
    let end = &watched.last().unwrap().0;
    assert!(
        end["total_ms"].as_f64() > Some(0.0) && end["downtime_ms"].as_f64() > Some(0.0),
        "{end}"
    );
    // Each answer came when its newest event was logged, not when the wait ran out: the lag
    // from an event to the answer that carried it, over the answers the watcher waited for.
    let mut lags: Vec<f64> = watched
        .iter()
        .map(|(e, at)| at.saturating_sub(e["host_ns"].as_u64().unwrap()) as f64 / 1e6)
        .collect();
    lags.sort_by(f64::total_cmp);
    eprintln!(
        "events: {} on the source; lag from event to answer: median {:.2} ms, max {:.2} ms",
        lags.len(),
        lags[lags.len() / 2],
        lags[lags.len() - 1]
    );
    assert!(
        lags[lags.len() - 1] < 1000.0,
        "an answer waited for its wait to run out: {lags:?}"
    );
    // The destination logged its own side, from waiting to completed.
    let theirs = dst.status_of("/events?after=0");
    let phases: Vec<&str> = theirs["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == "destination")
        .map(|e| e["phase"].as_str().unwrap())
        .collect();
    assert!(
        phases.contains(&"precopy") && phases.last() == Some(&"completed"),
        "{phases:?}"
    );
    dst.assert_verifies_clean();
}

#[test]
fn a_bad_events_query_is_refused_with_what_it_takes() {
    let vm = RunningVm::start("256M", "ws=16M log-ms=0");
    vm.wait_until("the API", Duration::from_secs(30), |vm| vm.socket.exists());
    let out = ferry_vmm::api::client::request(&vm.socket, "GET", "/events?since=3");
    let err = format!("{out:?}");
    assert!(err.contains("after=N") && err.contains("since=3"), "{err}");
    let none = vm.status_of("/events?after=0&wait_ms=0");
    assert_eq!(
        none["events"],
        serde_json::json!([]),
        "no migration, no events: {none}"
    );
}
