//! A VM with a NIC through real processes, in a network namespace the test makes for itself:
//! `ferry run --net tap=NAME` (inside the namespace) answers a stream of numbered frames, and
//! a local handover (`ferry migrate --local`) passes its tap to the new process, which never
//! closes it, so not one frame is lost; and a snapshot's clones come up on the taps given at
//! the restore, each with a new MAC unless one is given, and answer there.

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, ferry_output, stderr};
use ferry_migrate_testkit::netns::{EchoStream, Netns};

const GUEST: &str = "ws=32M rate=20 verify-ms=200 log-ms=0 net=10.99.0.2";
const LIMIT: Duration = Duration::from_secs(60);
/// Frames a second the host sends: the stream.
const RATE: u32 = 10_000;

fn echoes(vm: &RunningVm) -> u64 {
    vm.status()["guest"]["net"]["echoes_sent"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn a_local_handover_of_a_guest_receiving_a_frame_stream_loses_none() {
    let ns = Netns::new();
    ns.tap("ftap", Some("10.99.0.1/24"));
    let a = RunningVm::start_in(ns.name(), "256M", GUEST, &["--net", "tap=ftap"]);
    let mac = a.status()["net"]["mac"].as_str().unwrap().to_string();
    ns.neighbour("10.99.0.2", &mac, "ftap");
    a.wait_until("the guest's network workload", LIMIT, |vm| {
        vm.status()["guest"]["net"].is_object()
    });
    let stream = EchoStream::start(
        &ns,
        "10.99.0.1:0".parse().unwrap(),
        "10.99.0.2:7".parse().unwrap(),
        RATE,
    );
    a.wait_until("the guest answering", LIMIT, |vm| echoes(vm) >= 2000);
    let dir = tempfile::tempdir().unwrap().keep();
    let to = format!("unix:{}", dir.join("in.sock").display());
    let b = RunningVm::start_in(
        ns.name(),
        "256M",
        "",
        &["--incoming", to.as_str(), "--net", "tap=ftap"],
    );
    let before = std::time::Instant::now();
    let out = ferry()
        .args(["migrate", "--local", "--to", &to, "--output", "json"])
        .arg("--api-socket")
        .arg(&a.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let after = std::time::Instant::now();
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let handed = echoes(&b);
    b.wait_until("the guest answering in the new process", LIMIT, |vm| {
        echoes(vm) >= handed + 5000
    });
    let run = stream.stop();
    let lost = run.lost();
    eprintln!(
        "local handover at {RATE} frames/s: {} sent, {} echoes, {} lost, {} duplicated; downtime {} ms; the tap {}",
        run.sent.len(),
        run.echoes.len(),
        lost.len(),
        run.duplicates(),
        stats["downtime"]["total_ms"],
        b.status()["net"]["tap"]
    );
    let ms = |t: std::time::Instant| t.saturating_duration_since(before).as_secs_f64() * 1e3;
    if let (Some(f), Some(l)) = (lost.first(), lost.last()) {
        eprintln!(
            "lost from {:.1} ms to {:.1} ms after the handover began; it ended at {:.1} ms; {} lost in it",
            ms(run.sent[*f as usize - 1]),
            ms(run.sent[*l as usize - 1]),
            ms(after),
            run.lost_between(before, after).len()
        );
    }
    eprintln!(
        "guest: {}; device: {}",
        b.status()["guest"]["net"],
        b.status()["net"]
    );
    let _ = std::process::Command::new("ip")
        .args(["-n", ns.name(), "-s", "link", "show", "ftap"])
        .status();
    assert_eq!(run.duplicates(), 0, "no frame answered twice");
    assert!(
        lost.is_empty(),
        "the tap never closed, so none is lost: {} lost, the first {:?}",
        lost.len(),
        &lost[..lost.len().min(20)]
    );
    assert_eq!(b.status()["net"]["tap"], "ftap");
    assert_eq!(b.status()["guest"]["net"]["duplicates"], 0);
    let out = a.finish(LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_restored_clone_comes_up_on_its_own_tap_with_a_new_mac_and_answers_as_it() {
    let ns = Netns::new();
    ns.ip(&["link", "add", "br0", "type", "bridge"]);
    ns.up("br0", Some("10.99.0.1/24"));
    for t in ["fa", "fb", "fc"] {
        ns.tap(t, None);
        ns.ip(&["link", "set", t, "master", "br0"]);
    }
    let a = RunningVm::start_in(ns.name(), "256M", GUEST, &["--net", "tap=fa"]);
    let mac_a = a.status()["net"]["mac"].as_str().unwrap().to_string();
    a.wait_until("the guest's network workload", LIMIT, |vm| {
        vm.status()["guest"]["net"].is_object()
    });
    let keep = tempfile::tempdir().unwrap();
    let file = keep.path().join("vm.snap");
    let out = a.snapshot(&file, &["--stop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(a);

    let refused = ferry_output(&["run", "--restore", file.to_str().unwrap()]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("--net tap=NAME"),
        "{}",
        stderr(&refused)
    );

    let b = RunningVm::restore_in(ns.name(), &file, &["--net", "tap=fb"]);
    let mac_b = b.status()["net"]["mac"].as_str().unwrap().to_string();
    assert_ne!(mac_b, mac_a, "a clone gets a new MAC");
    assert_eq!(b.status()["net"]["tap"], "fb");
    ns.neighbour("10.99.0.2", &mac_b, "br0");
    let stream = EchoStream::start(
        &ns,
        "10.99.0.1:0".parse().unwrap(),
        "10.99.0.2:7".parse().unwrap(),
        2000,
    );
    b.wait_until("the clone answering as its new MAC", LIMIT, |vm| {
        echoes(vm) >= 1000
    });
    let run = stream.stop();
    assert_eq!(run.duplicates(), 0);
    assert!(common::read(&b.serial).contains(&format!("MAC is now {mac_b}")));
    drop(b);

    let c = RunningVm::restore_in(ns.name(), &file, &["--net", &format!("tap=fc,mac={mac_a}")]);
    assert_eq!(
        c.status()["net"]["mac"],
        mac_a.as_str(),
        "the MAC given wins"
    );
    drop(c);
}
