//! A VM with a disk through the `ferry` binary: `ferry run --disk`, and `ferry migrate
//! --disk-copy` between two `ferry run` processes whose images are files of their own, the
//! destination's guest re-reading every block it wrote.

mod common;

use std::time::Duration;

use common::{RunningVm, destination_with, ferry_output, start_migrate, stderr};

/// The guest's disk counter `name` in `ferry status`.
fn disk(vm: &RunningVm, name: &str) -> u64 {
    vm.status()["guest"]["disk"][name].as_u64().unwrap_or(0)
}

/// A sparse 64 MiB image at `path`.
fn image(path: &std::path::Path) -> std::path::PathBuf {
    std::fs::File::create(path)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    path.into()
}

/// A `ferry run` of `memory` with `image` as its disk, once its guest wrote 200 blocks.
fn source(memory: &str, image: &std::path::Path) -> RunningVm {
    let src = RunningVm::start_with(
        memory,
        "ws=16M rate=20 disk=16M disk-rate=4 verify-ms=200 log-ms=0",
        &["--disk", image.to_str().unwrap()],
    );
    src.wait_until("the API socket", Duration::from_secs(30), |vm| {
        vm.socket.exists()
    });
    src.wait_until("disk writes", Duration::from_secs(60), |vm| {
        disk(vm, "blocks_written") >= 200
    });
    src
}

/// Waits for two whole sweeps of `vm`'s disk (every block written, read back) and checks
/// that none found a bad block or a failed request, and that its memory verifies clean too.
fn disk_verifies_clean(vm: &RunningVm) {
    let sweeps = disk(vm, "sweeps");
    vm.wait_until("two whole disk sweeps", Duration::from_secs(90), |vm| {
        disk(vm, "sweeps") >= sweeps + 2
    });
    assert_eq!(disk(vm, "verify_failures"), 0, "{}", vm.status()["guest"]);
    assert_eq!(disk(vm, "request_errors"), 0, "{}", vm.status()["guest"]);
    vm.assert_verifies_clean();
}

#[test]
fn a_missing_image_is_refused_before_boot_with_the_command_that_makes_one() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing.img");
    let out = ferry_output(&[
        "run",
        "--disk",
        missing.to_str().unwrap(),
        "--serial",
        "none",
    ]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("nothing.img") && e.contains("truncate -s"),
        "{e}"
    );
    let out = ferry_output(&["run", "--disk", "x.img,cache=sometimes", "--serial", "none"]);
    assert_eq!(out.status.code(), Some(2), "a bad option is a usage error");
    assert!(stderr(&out).contains("cache="), "{}", stderr(&out));
}

#[test]
fn ferry_migrate_disk_copy_moves_a_disk_between_two_ferry_processes() {
    let images = tempfile::tempdir().unwrap();
    let src = source("256M", &image(&images.path().join("source.img")));
    let copy = images.path().join("copy.img");
    let (dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let migrate = start_migrate(&src, port, &["--disk-copy"]);
    let out = migrate.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    assert!(stdout.contains("iterative state"), "{stdout}");
    let err = stderr(&out);
    assert!(err.contains("disk copy: "), "the disk's own figures: {err}");
    assert!(copy.exists(), "the copy became the destination's image");
    disk_verifies_clean(&dst);
}

#[test]
fn a_snapshot_with_a_copy_of_its_image_restores_into_a_guest_whose_disk_reads_back_clean() {
    let images = tempfile::tempdir().unwrap();
    let image = image(&images.path().join("vm.img"));
    let src = source("256M", &image);
    // Saved with the guest left paused, so the image copied next is the one the state
    // describes (flushed by the save).
    let file = images.path().join("vm.snap");
    let out = src.snapshot(&file, &["--stop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let copy = images.path().join("vm-at-snap.img");
    std::fs::copy(&image, &copy).unwrap();
    drop(src);
    let without = ferry_output(&[
        "run",
        "--restore",
        file.to_str().unwrap(),
        "--serial",
        "none",
    ]);
    assert!(!without.status.success());
    assert!(stderr(&without).contains("--disk"), "{}", stderr(&without));
    let restored = RunningVm::restore(&file, &["--disk", copy.to_str().unwrap()]);
    disk_verifies_clean(&restored);
}

#[test]
fn a_local_handover_takes_the_disk_along_and_every_block_reads_back() {
    let images = tempfile::tempdir().unwrap();
    let image = image(&images.path().join("vm.img"));
    let src = source("512M", &image);
    // The same image on the same host: the destination opens it when the state arrives.
    let (dst, to) = common::unix_destination("512M", &["--disk", image.to_str().unwrap()]);
    let out = common::ferry()
        .args(["migrate", "--local", "--to", &to, "--api-socket"])
        .arg(&src.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    disk_verifies_clean(&dst);
}
