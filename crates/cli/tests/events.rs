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

    // At most 32 requests wait at once, each holding a thread of the VMM: the 33rd is refused
    // at once, saying why, and one that does not wait is still answered.
    let socket = vm.socket.clone();
    let waiting: Vec<_> = (0..32)
        .map(|_| {
            let socket = socket.clone();
            // Refused only while a probe below held the last slot for its millisecond.
            std::thread::spawn(move || {
                loop {
                    let got = ferry_vmm::api::client::request(
                        &socket,
                        "GET",
                        "/events?after=0&wait_ms=5000",
                    );
                    match got {
                        Err(e) if format!("{e:?}").contains("429") => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        got => break got,
                    }
                }
            })
        })
        .collect();
    // A probe that waits 1 ms takes a slot too, one at a time: asked until the 32 hold theirs.
    let deadline = std::time::Instant::now() + Duration::from_secs(4);
    let err = loop {
        let probe = ferry_vmm::api::client::request(&vm.socket, "GET", "/events?wait_ms=1");
        if probe.is_err() || std::time::Instant::now() > deadline {
            break format!("{probe:?}");
        }
    };
    assert!(
        err.contains("32 GET /events requests already wait"),
        "{err}"
    );
    vm.status_of("/events?after=0&wait_ms=0");
    for w in waiting {
        let answer = w.join().unwrap().expect("a waiter answered");
        assert_eq!(answer["events"], serde_json::json!([]), "{answer}");
    }
    vm.status_of("/events?after=0&wait_ms=10");
}

/// Checks a job statistics object (`job` in `GET /migration` and the events) adds up: what was
/// processed is within the total, the rest is what remains.
fn assert_job_adds_up(job: &serde_json::Value) {
    let n = |k: &str| job[k].as_u64().unwrap_or_else(|| panic!("no {k} in {job}"));
    for part in ["data", "memory"] {
        let (total, processed, remaining) = (
            n(&format!("{part}_total_bytes")),
            n(&format!("{part}_processed_bytes")),
            n(&format!("{part}_remaining_bytes")),
        );
        assert!(processed <= total, "{part}: {job}");
        assert_eq!(remaining, total - processed, "{part}: {job}");
    }
    assert_eq!(n("memory_page_size_bytes"), 4096, "{job}");
    if let (Some(normal), Some(bytes)) = (
        job["memory_normal_pages"].as_u64(),
        job["memory_normal_bytes"].as_u64(),
    ) {
        assert_eq!(bytes, normal * 4096, "{job}");
    }
}

#[test]
fn job_statistics_named_as_libvirt_s_add_up_during_and_after_a_migration() {
    let src = RunningVm::start("256M", "ws=64M rate=20 verify-ms=200 log-ms=0");
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = common::destination("256M");
    let (watched, polled) = std::thread::scope(|s| {
        let watcher = s.spawn(|| watch_until_the_end(&src));
        let poller = s.spawn(|| {
            let mut seen = Vec::new();
            for _ in 0..2000 {
                let m = ferry_vmm::api::client::request(&src.socket, "GET", "/migration");
                let Ok(m) = m else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let active = !["completed", "failed", "cancelled"]
                    .contains(&m["phase"].as_str().unwrap_or(""));
                seen.push(m);
                if !active {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        std::thread::sleep(Duration::from_millis(200));
        // 40 MB/s: precopy lasts a few seconds, so the poller sees it run.
        let out = start_migrate(&src, port, &["--max-bandwidth", "40M"])
            .wait_with_output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        (watcher.join().unwrap(), poller.join().unwrap())
    });
    // During: every figure the poller saw adds up, and time runs forward.
    let running: Vec<&serde_json::Value> = polled
        .iter()
        .filter(|m| m["phase"] == "precopy" && !m["job"].is_null())
        .map(|m| &m["job"])
        .collect();
    assert!(running.len() >= 3, "few precopy samples: {}", running.len());
    for job in &running {
        assert_job_adds_up(job);
    }
    assert!(
        running
            .windows(2)
            .all(|w| w[0]["time_elapsed_ms"].as_u64() <= w[1]["time_elapsed_ms"].as_u64())
    );
    assert!(
        running.iter().any(|j| j["memory_bps"].as_u64() > Some(0)),
        "a measured rate shows"
    );
    // Each pass event carries the job at that pass end: its iteration is the pass.
    let passes: Vec<&serde_json::Value> = watched
        .iter()
        .map(|(e, _)| e)
        .filter(|e| e["event"] == "pass")
        .collect();
    for p in &passes {
        assert_job_adds_up(&p["job"]);
        assert_eq!(p["job"]["memory_iteration"], p["pass"], "{p}");
        assert_eq!(p["job"]["data_processed_bytes"], p["bytes_sent"], "{p}");
    }
    // After: the completion event and GET /migration carry the same job, from the statistics.
    let end = &watched.last().unwrap().0;
    let after = src.status_of("/migration");
    assert_eq!(end["job"], after["job"], "the event and the status agree");
    let (job, stats) = (&after["job"], &after["stats"]);
    assert_job_adds_up(job);
    assert_eq!(job["data_remaining_bytes"], 0, "{job}");
    assert_eq!(job["time_remaining_ms"], 0, "{job}");
    assert_eq!(job["data_processed_bytes"], stats["bytes_sent"]);
    assert_eq!(job["memory_normal_pages"], stats["pages_normal"]);
    assert_eq!(job["memory_constant_pages"], stats["pages_zero"]);
    let f = |v: &serde_json::Value| v.as_f64().unwrap().round() as u64;
    assert_eq!(
        job["downtime_ms"].as_u64(),
        Some(f(&stats["downtime"]["total_ms"]))
    );
    assert_eq!(job["setup_time_ms"].as_u64(), Some(f(&stats["setup_ms"])));
    assert_eq!(job["time_elapsed_ms"].as_u64(), Some(f(&stats["total_ms"])));
    let rows = stats["passes"].as_array().unwrap();
    assert_eq!(job["memory_iteration"].as_u64(), Some(rows.len() as u64));
    assert_eq!(
        rows.iter().filter(|r| r["paused"] == false).count(),
        passes.len(),
        "a pass event per pass the guest ran through"
    );
    assert!(job["downtime_net_ms"].as_u64() <= job["downtime_ms"].as_u64());
    eprintln!("job at the end: {job}");
    dst.assert_verifies_clean();
}
