//! `ferry bench soak` at a small count: a guest migrated back and forth between two
//! `ferry run --then-incoming` processes verifies clean after every hop, in precopy and in
//! postcopy, and neither process keeps a descriptor per hop.

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, free_port, require_kvm, start_migrate, stderr};

/// `ferry bench soak` with `args` on real KVM: its output, and the JSON rows in it.
fn soak(args: &[&str]) -> (String, Vec<serde_json::Value>) {
    require_kvm();
    let out = ferry().args(["bench", "soak"]).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    let rows = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    (text, rows)
}

#[test]
fn a_guest_migrated_back_and_forth_verifies_after_every_hop_and_no_descriptor_leaks() {
    let (text, rows) = soak(&["--round-trips", "4"]);
    let of = |bench: &str| -> Vec<&serde_json::Value> {
        rows.iter().filter(|r| r["bench"] == bench).collect()
    };
    let soak = of("soak");
    assert_eq!(soak.len(), 1, "{text}");
    assert_eq!(soak[0]["hops"], 8, "{text}");
    assert_eq!(soak[0]["verify_failures"], 0, "{text}");
    assert!(soak[0]["verify_passes"].as_u64() >= Some(8), "{text}");
    let modes: Vec<&str> = of("soak_hops")
        .iter()
        .filter_map(|r| r["mode"].as_str())
        .collect();
    assert_eq!(modes, ["precopy", "postcopy"], "{text}");
    let processes = of("soak_process");
    assert_eq!(processes.len(), 2, "{text}");
    for p in processes {
        assert_eq!(p["fd_growth"], 0, "{text}");
    }
}

/// The soak as a control plane drives it: every hop started with `PUT /migration` and followed
/// on both processes' `GET /events` alone; the completions' job statistics agree with their
/// figures (the bench fails otherwise), every hop verifies, no descriptor is kept.
#[test]
fn a_soak_followed_on_the_events_alone_verifies_every_hop_and_keeps_no_descriptor() {
    let (text, rows) = soak(&["--round-trips", "3", "--follow-events"]);
    let of = |bench: &str| -> Vec<&serde_json::Value> {
        rows.iter().filter(|r| r["bench"] == bench).collect()
    };
    let soak = of("soak");
    assert_eq!(soak[0]["hops"], 6, "{text}");
    assert_eq!(soak[0]["verify_failures"], 0, "{text}");
    let events = of("soak_events");
    assert_eq!(events.len(), 1, "{text}");
    assert!(
        events[0]["events_awaited"].as_u64() >= Some(6),
        "the source's end at least, every hop: {text}"
    );
    for p in of("soak_process") {
        assert_eq!(p["fd_growth"], 0, "{text}");
    }
}

#[test]
fn ferry_migrate_follows_a_then_incoming_source_to_the_end_and_the_guest_comes_back() {
    let port_a = free_port();
    let back_to_a = format!("tcp:127.0.0.1:{port_a}");
    let a = RunningVm::start_with(
        "256M",
        "ws=32M pattern=random rate=10 verify-ms=100 log-ms=0",
        &["--then-incoming", &back_to_a],
    );
    a.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.socket.exists() && vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let port_b = free_port();
    let b = RunningVm::start_with(
        "256M",
        "",
        &["--incoming", &format!("tcp:127.0.0.1:{port_b}")],
    );
    b.wait_until("the destination's API", Duration::from_secs(30), |vm| {
        vm.socket.exists()
    });

    let before = a.status_of("/events?after=0")["last"].as_u64().unwrap();
    let out = start_migrate(&a, port_b, &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the source VMM waits for the next migration"),
        "{}",
        stderr(&out)
    );
    b.assert_verifies_clean();
    // The first VMM now waits on its --then-incoming address, and tells how the migration
    // away from it ended.
    let waiting = a.status_of("/migration");
    assert_eq!(waiting["role"], "destination", "{waiting:#}");
    assert_eq!(waiting["phase"], "waiting", "{waiting:#}");
    assert_eq!(waiting["previous"]["phase"], "completed", "{waiting:#}");
    assert_eq!(a.status()["state"], "incoming");
    // Issue 55 (regression): the VM that waits now had a log of its own, numbered from 1
    // again, so a watcher asking after its last number saw none of the next migration's
    // events. The process's numbers run on: the source's events, then the waiting VM's.
    let log = a.status_of("/events?after=0");
    let seqs: Vec<u64> = log["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{log}");
    let newest = log["events"].as_array().unwrap().last().unwrap();
    assert_eq!(newest["event"], "destination", "{log}");
    assert!(newest["seq"].as_u64() > Some(before), "{log}");
    let waiting = a.status_of(&format!("/events?after={before}&wait_ms=0"));
    assert!(
        waiting["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["event"] == "destination"),
        "a watcher reading on from before the hop sees the wait: {waiting}"
    );

    let out = start_migrate(&b, port_a, &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    a.assert_verifies_clean();
    assert_eq!(a.status()["state"], "running");
    assert_eq!(
        b.status()["state"],
        "paused",
        "without --then-incoming a source stays paused"
    );
}
