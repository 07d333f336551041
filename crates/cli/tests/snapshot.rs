//! Snapshots through the `ferry` binary on real VMs: a live snapshot of a guest that writes,
//! restored eagerly and lazily into two clones at once, each verifying every page of its
//! working set; `--stop`; and files a restore must refuse.

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, partials, stderr};

/// Stops `vm` through its API and returns what its `ferry run` printed.
fn shut_down(vm: RunningVm) -> String {
    assert!(vm.control("shutdown").status.success());
    stderr(&vm.finish(Duration::from_secs(30)))
}

#[test]
fn a_live_snapshot_restores_eagerly_and_lazily_into_two_clones_that_verify_clean() {
    let src = RunningVm::start(
        "512M",
        "ws=128M pattern=random rate=100 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    // Past the page cache: the restores below read what the disk holds.
    let out = src.snapshot(&file, &["--direct-io"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    assert!(
        stderr(&out).contains("snapshot written"),
        "{}",
        stderr(&out)
    );
    assert!(text.contains("downtime"), "statistics as a table: {text}");
    assert_eq!(partials(dir.path()), 0);
    assert_eq!(src.status()["state"], "running", "the guest runs on");
    src.assert_verifies_clean();
    // The file costs what the guest used: the working set, not the 512M of RAM.
    let allocated = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&file).unwrap().blocks() * 512
    };
    assert!(allocated < 200 << 20, "{allocated} bytes allocated");
    drop(src);
    // Two clones of one file at once, one read eagerly, one lazily.
    let eager = RunningVm::restore(&file, &[]);
    let lazy = RunningVm::restore(&file, &["--lazy"]);
    for vm in [&eager, &lazy] {
        assert_eq!(vm.status()["state"], "running");
        vm.assert_verifies_clean();
    }
    let said = shut_down(eager);
    assert!(
        said.contains("restored") && said.contains("MiB of data read"),
        "{said}"
    );
    let said = shut_down(lazy);
    assert!(said.contains("all of RAM in place"), "{said}");
}

#[test]
fn stop_leaves_the_guest_paused_and_bad_files_are_refused_with_their_cause() {
    let src = RunningVm::start(
        "256M",
        "ws=32M pattern=random rate=50 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let dir = tempfile::tempdir().unwrap();
    // A snapshot that cannot be written fails, leaves nothing and the guest running.
    let nowhere = dir.path().join("missing/vm.snap");
    let out = src.snapshot(&nowhere, &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("the guest runs on"),
        "{}",
        stderr(&out)
    );
    assert_eq!(src.status()["state"], "running");
    let file = dir.path().join("vm.snap");
    let out = src.snapshot(&file, &["--stop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("paused (--stop)"), "{}", stderr(&out));
    assert_eq!(src.status()["state"], "paused");
    drop(src);
    let good = std::fs::read(&file).unwrap();
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("cut short", good[..good.len() - 8192].to_vec(), "cut short"),
        (
            "flipped header byte",
            {
                let mut b = good.clone();
                b[100] ^= 1;
                b
            },
            "header is damaged",
        ),
        ("not a snapshot", b"hello".to_vec(), "not a ferry snapshot"),
    ];
    for (what, bytes, expected) in cases {
        let bad = dir.path().join("bad.snap");
        std::fs::write(&bad, bytes).unwrap();
        let out = ferry()
            .args(["run", "--serial", "none", "--restore"])
            .arg(&bad)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{what}");
        assert!(stderr(&out).contains(expected), "{what}: {}", stderr(&out));
    }
    let out = ferry()
        .args(["run", "--restore"])
        .arg(&file)
        .args(["--memory", "1G"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a usage error: {}",
        stderr(&out)
    );
}

/// Issue 48: under a file size limit (`ulimit -f`, systemd's `LimitFSIZE=`) a snapshot failed
/// by killing the VMM and its guest with SIGXFSZ; a file that was not a snapshot at the path
/// was replaced, and the snapshot was readable by anyone. Now the snapshot fails with the
/// limit named, leaves no partial file, and the guest runs on; a file of another kind is
/// refused and kept unless `--replace`; a snapshot is 0600.
#[test]
fn regression_a_snapshot_survives_the_file_size_limit_and_replaces_only_what_it_may() {
    use std::os::unix::fs::PermissionsExt;
    let src = RunningVm::start(
        "256M",
        "ws=32M pattern=random rate=50 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let limit = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", src.child.id()))
        .arg("--fsize=1048576:")
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(limit.success());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let out = src.snapshot(&file, &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("file size limit"), "{}", stderr(&out));
    assert_eq!(
        src.status()["state"],
        "running",
        "the VMM lives and the guest runs on"
    );
    assert!(!file.exists());
    assert_eq!(partials(dir.path()), 0);
    let limit = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", src.child.id()))
        .arg("--fsize=unlimited:")
        .status()
        .unwrap();
    assert!(limit.success());

    std::fs::write(&file, b"precious").unwrap();
    let out = src.snapshot(&file, &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not a ferry snapshot"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
    let out = src.snapshot(&file, &["--replace"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    assert_eq!(partials(dir.path()), 0);
    src.assert_verifies_clean();
}
