//! Issue 48: a VM whose RAM is still arriving (an incoming postcopy migration, a lazy restore
//! still loading) is never copied. A snapshot, a migration and a local handover tried then are
//! refused with the cause; once RAM is complete they are allowed, and what they made verifies
//! clean. Before, a snapshot of a postcopy destination reported success and its restore found
//! 201,058 bad pages: pages placed later with `UFFDIO_COPY` reach no dirty log.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{RunningVm, ferry, postcopy_migration, stderr, unix_destination};

const REFUSAL: &str = "RAM is not complete yet";

/// Tries of each kind: 1 in the test suite; the 20 with `FERRY_ARRIVING_TRIES=20`
/// (each try prints its line, and the copies it made verify clean or the test fails).
fn tries() -> usize {
    std::env::var("FERRY_ARRIVING_TRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn migrate(vm: &RunningVm, to: &str, extra: &[&str]) -> std::process::Output {
    ferry()
        .args(["migrate", "--to", to])
        .args(extra)
        .arg("--api-socket")
        .arg(&vm.socket)
        .output()
        .unwrap()
}

/// Every way out of `vm` while its RAM arrives: a snapshot, a migration, a local handover.
/// Each is refused with the cause and `vm` runs on, or (RAM complete by then) it succeeds:
/// returns how many were refused and the snapshot's file if one was written.
fn try_every_copy(vm: &RunningVm, dir: &Path) -> (usize, Option<std::path::PathBuf>) {
    let mut refused = 0;
    let file = dir.join("copy.snap");
    let out = vm.snapshot(&file, &[]);
    let written = match out.status.success() {
        true => Some(file),
        false => {
            assert!(stderr(&out).contains(REFUSAL), "{}", stderr(&out));
            refused += 1;
            None
        }
    };
    // Destinations nobody reaches unless the refusal failed: a refused start connects to
    // neither (the slot is refused before the connection).
    let out = migrate(vm, "tcp:127.0.0.1:9", &[]);
    assert!(!out.status.success());
    refused += usize::from(stderr(&out).contains(REFUSAL));
    let out = migrate(
        vm,
        &format!("unix:{}", dir.join("none.sock").display()),
        &["--local"],
    );
    assert!(!out.status.success());
    refused += usize::from(stderr(&out).contains(REFUSAL));
    assert_eq!(vm.status()["state"], "running", "the VM runs on");
    (refused, written)
}

#[test]
fn regression_a_postcopy_destination_is_not_copied_until_its_ram_is_complete() {
    for t in 0..tries() {
        // One data channel, then several, in turn.
        let channels = if t % 2 == 0 { "1" } else { "4" };
        let refused = a_postcopy_destination_copied_while_its_pages_come(channels);
        eprintln!(
            "postcopy destination, try {t}, {channels} channel(s): {refused} of 3 copies refused, every copy made verified clean"
        );
    }
}

/// One try: returns how many of the three copies were refused.
fn a_postcopy_destination_copied_while_its_pages_come(channels: &str) -> usize {
    // One pass at 10 MB/s, then postcopy: seconds in which the destination runs the guest
    // while its pages still come.
    let (_src, dst, following) = postcopy_migration(
        "ws=64M pattern=random rate=max verify-ms=200 log-ms=0",
        &["--channels", channels],
    );
    assert_eq!(dst.status()["ram_arriving"], "incoming_migration");
    let dir = tempfile::tempdir().unwrap();
    let (refused, written) = try_every_copy(&dst, dir.path());
    // Still in postcopy after the three tries: RAM arrived during each of them.
    if dst.phase() == "postcopy" {
        assert_eq!(refused, 3, "every copy refused while postcopy ran");
    }
    let out = following.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dst.status().get("ram_arriving").is_none());
    // Complete now: the snapshot is allowed, and its restore verifies every page.
    let file = written.unwrap_or_else(|| {
        let file = dir.path().join("after.snap");
        let out = dst.snapshot(&file, &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        file
    });
    dst.assert_verifies_clean();
    drop(dst);
    RunningVm::restore(&file, &[]).assert_verifies_clean();
    refused
}

#[test]
fn regression_a_lazy_restore_is_not_copied_until_all_of_ram_is_loaded() {
    for t in 0..tries() {
        let refused = a_lazy_restore_copied_while_it_loads();
        eprintln!(
            "lazy restore, try {t}: {refused} of 3 copies refused, every copy made verified clean"
        );
    }
}

/// One try: returns how many of the three copies were refused.
fn a_lazy_restore_copied_while_it_loads() -> usize {
    let src = RunningVm::start(
        "512M",
        "ws=256M pattern=random rate=100 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let out = src.snapshot(&file, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(src);
    let lazy = RunningVm::restore(&file, &["--lazy"]);
    let copies = tempfile::tempdir().unwrap();
    let arriving = lazy.status()["ram_arriving"] == "lazy_restore";
    let (refused, written) = try_every_copy(&lazy, copies.path());
    // RAM that still arrives after the three tries arrived during each of them: each must
    // have been refused (arriving never comes back once RAM is complete).
    if lazy.status()["ram_arriving"] == "lazy_restore" {
        assert_eq!(refused, 3, "every copy refused while the restore loaded");
    }
    eprintln!("lazy restore: RAM arriving when first looked at: {arriving}");
    lazy.wait_until("all of RAM loaded", Duration::from_secs(60), |vm| {
        vm.status().get("ram_arriving").is_none()
    });
    // The handover is allowed now, and the guest verifies where it went.
    let (dst, to) = unix_destination("512M", &[]);
    let out = migrate(&lazy, &to, &["--local"]);
    assert!(out.status.success(), "{}", stderr(&out));
    dst.assert_verifies_clean();
    if let Some(copy) = written {
        RunningVm::restore(&copy, &[]).assert_verifies_clean();
    }
    refused
}
