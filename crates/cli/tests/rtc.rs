//! The RTC's time of day through the `ferry` binary on real KVM: a time the guest set with SET
//! (2001) is still the guest's, advanced by the time that passed, after a snapshot restored
//! two seconds later and after a local handover of the restored guest to another process. The
//! RTC's section goes through both as it goes through a migration (`ferry-vmm`'s tests/rtc.rs).

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, stderr};

const SET_TO: i64 = 1_000_000_000;
/// A guest that sets its RTC to 2001 at boot and reads it every 200 ms.
const GUEST: &str = "ws=16M rate=10 verify-ms=0 log-ms=0 calibrate-ms=200 rtc-set=1000000000";
const LIMIT: Duration = Duration::from_secs(60);

/// The guest's latest RTC reading: its time and the host's when it came, seconds since 1970.
fn reading(vm: &RunningVm) -> Option<(i64, i64)> {
    let r = &vm.status()["guest"]["rtc"];
    Some((
        r["unix_seconds"].as_i64()?,
        r["host_unix_seconds"].as_i64()?,
    ))
}

/// The first reading that came at the host's second `after` or later.
fn reading_after(vm: &RunningVm, after: i64) -> (i64, i64) {
    vm.wait_until("an RTC reading", LIMIT, |vm| {
        reading(vm).is_some_and(|(_, host)| host >= after)
    });
    let r = reading(vm).unwrap();
    eprintln!("the guest's RTC {}, the host's clock {}", r.0, r.1);
    r
}

/// The reading is the set time moved on with the wall clock: its offset from the host's
/// clock is the first reading's, to within 2 s (the seconds of two clocks, each floored).
fn keeps_offset((guest, host): (i64, i64), offset: i64, when: &str) {
    assert!(guest < SET_TO + 3600, "{when}: still 2001, {guest}");
    assert!(
        (guest - host - offset).abs() <= 2,
        "{when}: the guest's RTC {guest} at the host's {host}, its offset {offset} lost"
    );
}

#[test]
fn the_time_the_guest_set_survives_a_snapshot_restored_later_and_a_local_handover() {
    let src = RunningVm::start("128M", GUEST);
    let (t0, h0) = reading_after(&src, 0);
    assert!((SET_TO..SET_TO + 5).contains(&t0), "the time set: {t0}");
    let offset = t0 - h0;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let out = src.snapshot(&file, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(src);
    std::thread::sleep(Duration::from_secs(2));
    let restored = RunningVm::restore(&file, &[]);
    let (t1, h1) = reading_after(&restored, h0 + 2);
    keeps_offset((t1, h1), offset, "restored");
    assert!(
        t1 > t0,
        "the RTC ran on while the snapshot waited: {t0} then {t1}"
    );

    let (dst, to) = common::unix_destination("128M", &[]);
    let out = ferry()
        .args(["migrate", "--local", "--to", to.as_str()])
        .arg("--api-socket")
        .arg(&restored.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let handed = reading_after(&dst, h1 + 1);
    keeps_offset(handed, offset, "handed over");
}
