//! The guest's clocks across every kind of move, through real `ferry` processes on real KVM
//! (issue 53): a migration over TCP, a local handover, and a snapshot restored eagerly and
//! lazily seconds after it was taken. After each, the guest's kvmclock has advanced by the
//! pause and no more: the clock jump `GET /vm` shows (`migration_clocks.clock_jump_ns`, the
//! guest's gap across the move less the host's between the same two reports) is within
//! [`JUMP_BOUND_NS`] of 0, where a guest whose clocks stopped for the pause (ferry before
//! version 2 of the clock section) shows minus the pause.

mod common;

use std::time::Duration;

use common::{RunningVm, destination_with, ferry, stderr, unix_destination};

/// Two vCPUs writing, a heartbeat every 10 ms from each: reports on both sides of the pause.
const GUEST: &str = "ws=32M pattern=random rate=20 verify-ms=200 log-ms=0";
const LIMIT: Duration = Duration::from_secs(60);
/// How far the clock jump may be from 0: issue 53's goal. The figure is the best of the
/// reports of the first second after the move (`telemetry_move.rs`): a report written late,
/// its vCPU put aside by this busy 2-core host or faulting on a page a lazy restore had still
/// to read (8.5 ms seen), only lowers it. Measured here: within 0.1 ms.
const JUMP_BOUND_NS: i64 = 1_000_000;
/// How far the guest's TSC gap, made ns at the frequency KVM gives the guest, may be from its
/// kvmclock gap: 1 ms and 0.01% of the gap. (`ferry bench clock`: within 0.001 ms over 128
/// gaps that spanned a move, once the guest read both clocks at one instant.) The TSC made ns
/// at the guest's own calibration is printed, not bounded: a calibration on this busy host
/// was 1.5% off once (its windows all preempted at an edge), 60 ms over a 4 s restore.
const TSC_BOUND_NS: u64 = 1_000_000;

/// The destination's clock jump and pause (ns), once the guest reported after the move, and
/// the guest's own gap across the move on kvmclock when it saw one (a pause shorter than its
/// 15 ms threshold leaves none; `need_gap` waits for it): its gap on the TSC agrees with
/// kvmclock's, and neither clock went back.
fn jump_and_pause(vm: &RunningVm, what: &str, need_gap: bool) -> (i64, u64, Option<u64>) {
    vm.wait_until("the guest's reports after the move", LIMIT, |vm| {
        let m = &vm.status()["guest"]["migration_clocks"];
        m["clock_jump_ns"].is_i64() && (m["guest_gap"].is_object() || !need_gap)
    });
    // The jump is refined, and the guest's gap across the move comes, within the first second
    // of reports after it (`telemetry_move.rs`).
    std::thread::sleep(Duration::from_millis(1100));
    let g = &vm.status()["guest"];
    let m = &g["migration_clocks"];
    let (jump, pause) = (
        m["clock_jump_ns"].as_i64().unwrap(),
        g["migration_pause_ns"].as_u64().unwrap(),
    );
    assert!(
        jump.abs() <= JUMP_BOUND_NS,
        "{what}: the guest's clock moved {jump} ns against the host's across a pause of {pause} ns"
    );
    assert_eq!(g["verify_failures"], 0, "{what}: {g:#}");
    let gap = &m["guest_gap"];
    if !gap.is_object() {
        eprintln!(
            "{what}: pause {:.3} ms, clock jump {:+.3} ms; the guest saw no gap across it",
            pause as f64 / 1e6,
            jump as f64 / 1e6,
        );
        return (jump, pause, None);
    }
    let kvmclock = gap["kvmclock_ns"].as_u64().unwrap();
    let calibrated = gap["tsc_ns"].as_u64();
    let calibrated =
        calibrated.unwrap_or_else(|| panic!("{what}: the guest has a calibrated TSC: {g:#}"));
    let (ticks, hz) = (
        gap["tsc_ticks"].as_u64().unwrap(),
        g["tsc_host_hz"].as_u64().unwrap(),
    );
    let tsc = (u128::from(ticks) * 1_000_000_000 / u128::from(hz)) as u64;
    eprintln!(
        "{what}: pause {:.3} ms, clock jump {:+.3} ms; the guest's gap {:.3} ms on kvmclock, {:.3} ms on its TSC at KVM's frequency ({:.3} ms at its own calibration)",
        pause as f64 / 1e6,
        jump as f64 / 1e6,
        kvmclock as f64 / 1e6,
        tsc as f64 / 1e6,
        calibrated as f64 / 1e6,
    );
    assert!(
        kvmclock.abs_diff(tsc) <= TSC_BOUND_NS + kvmclock / 10_000,
        "{what}: the TSC saw {tsc} ns where kvmclock saw {kvmclock} ns"
    );
    assert_eq!(gap["backwards"], 0, "{what}: a clock went back: {g:#}");
    (jump, pause, Some(kvmclock))
}

fn source() -> RunningVm {
    let vm = RunningVm::start_with("256M", GUEST, &["--vcpus", "2"]);
    vm.wait_until("the API socket", LIMIT, |vm| vm.socket.exists());
    vm.wait_until("a verify pass", LIMIT, |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    vm
}

fn migrate(src: &RunningVm, to: &str, extra: &[&str]) {
    let out = ferry()
        .args(["migrate", "--to", to, "--downtime-limit", "300ms"])
        .args(extra)
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_migrated_guests_clocks_advance_by_the_pause() {
    let src = source();
    let (dst, port) = destination_with("256M", &["--vcpus", "2"]);
    migrate(&src, &format!("tcp:127.0.0.1:{port}"), &[]);
    let (_, pause, gap) = jump_and_pause(&dst, "migration", false);
    if let Some(gap) = gap {
        assert!(gap <= pause + 30_000_000, "{gap} ns, a pause of {pause} ns");
    }
    dst.assert_verifies_clean();
}

#[test]
fn a_guest_handed_over_locally_keeps_its_clocks() {
    let src = source();
    let (dst, to) = unix_destination("256M", &["--vcpus", "2"]);
    migrate(&src, &to, &["--local"]);
    jump_and_pause(&dst, "local handover", false);
    dst.assert_verifies_clean();
}

/// A snapshot restored 3 s after it was taken: the guest sees the 3 s pass (its pause is the
/// whole time since the save), eagerly and lazily.
#[test]
fn a_restored_guest_sees_the_time_since_its_snapshot() {
    let src = source();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let out = src.snapshot(&file, &["--stop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(src);
    std::thread::sleep(Duration::from_secs(3));
    for extra in [&[][..], &["--lazy"][..]] {
        let vm = RunningVm::restore(&file, extra);
        let (_, pause, gap) = jump_and_pause(&vm, &format!("restore {extra:?}"), true);
        let gap = gap.expect("a gap of seconds");
        assert!(pause >= 3_000_000_000, "{pause} ns");
        assert!(gap >= 3_000_000_000, "the guest saw the 3 s pass: {gap} ns");
        vm.assert_verifies_clean();
    }
}
