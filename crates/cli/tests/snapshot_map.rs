//! Mapped restores through the `ferry` binary on real VMs (`ferry run --restore FILE --map`):
//! two clones mapped from one snapshot at once, each verifying every page of its working set
//! while it writes its own copy of them; what a mapped VM refuses (a migration, a local
//! handover, a snapshot), naming the cause and the fix; and `--map` with `--lazy`.

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, free_port, stderr};

fn refused(out: &std::process::Output, what: &str) {
    let said = stderr(out);
    assert!(!out.status.success(), "{what}: {said}");
    for want in ["mapped from its snapshot file", "--map", "without --map"] {
        assert!(said.contains(want), "{what}: {want:?} in {said}");
    }
}

#[test]
fn two_clones_mapped_from_one_snapshot_verify_clean_and_refuse_to_be_moved() {
    let src = RunningVm::start(
        "512M",
        "ws=128M pattern=random rate=100 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let out = src.snapshot(&file, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(src);
    let before = std::fs::read(&file).unwrap();

    let a = RunningVm::restore(&file, &["--map"]);
    let b = RunningVm::restore(&file, &["--map"]);
    for vm in [&a, &b] {
        assert_eq!(vm.status()["state"], "running");
        // Each guest writes its working set at 100 pages/s and verifies all of it: its own
        // copy of each page it wrote, the file's of each it has not.
        vm.assert_verifies_clean();
    }
    assert_eq!(
        std::fs::read(&file).unwrap(),
        before,
        "the guests' writes never reach the file"
    );

    // Nothing that finds guest memory in the VM's memfd starts: each names the fix.
    let port = free_port();
    let out = ferry()
        .args(["migrate", "--to", &format!("tcp:127.0.0.1:{port}")])
        .arg("--api-socket")
        .arg(&a.socket)
        .output()
        .unwrap();
    refused(&out, "a migration");
    let to = format!("unix:{}", dir.path().join("handover.sock").display());
    let out = ferry()
        .args(["migrate", "--local", "--to", &to])
        .arg("--api-socket")
        .arg(&a.socket)
        .output()
        .unwrap();
    refused(&out, "a local handover");
    let out = a.snapshot(&dir.path().join("again.snap"), &[]);
    refused(&out, "a snapshot");
    assert!(!dir.path().join("again.snap").exists());
    assert_eq!(a.status()["state"], "running", "the guest runs on");
    a.assert_verifies_clean();

    for vm in [a, b] {
        assert!(vm.control("shutdown").status.success());
        let said = stderr(&vm.finish(Duration::from_secs(30)));
        assert!(said.contains("mapped"), "{said}");
    }
}

#[test]
fn map_and_lazy_are_two_ways_of_restoring_and_map_needs_a_restore() {
    let out = ferry()
        .args(["run", "--restore", "vm.snap", "--map", "--lazy"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--lazy"), "{}", stderr(&out));
    let out = ferry().args(["run", "--map"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--restore"), "{}", stderr(&out));
}
