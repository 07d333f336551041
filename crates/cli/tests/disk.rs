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
    keep_with_snapshot(&image, &copy);
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

/// Issue 50: a snapshot records its image's size, mtime and allocated map; a restore given
/// the image after it changed is refused with what changed and the fix, taken with
/// `--disk-changed-ok`, and refused whatever the flag when its size changed.
#[test]
fn a_restore_with_an_image_changed_since_its_snapshot_is_refused_unless_told() {
    use std::os::unix::fs::FileExt;
    let images = tempfile::tempdir().unwrap();
    let image = image(&images.path().join("vm.img"));
    let src = source("256M", &image);
    let file = images.path().join("vm.snap");
    let out = src.snapshot(&file, &["--stop"]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(src);
    // A block past the guest's 16 MiB written after the snapshot: the mtime and the
    // allocated map change, and the guest, which never reads there, still verifies clean.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap();
    f.write_all_at(&[0xa5; 4096], 60 << 20).unwrap();
    let refused = |extra: &[&str]| {
        let mut args = vec!["run", "--restore", file.to_str().unwrap()];
        args.extend_from_slice(&["--disk", image.to_str().unwrap(), "--serial", "none"]);
        args.extend_from_slice(extra);
        refused_run(&args)
    };
    let e = refused(&[]);
    for want in [
        "changed since the snapshot was taken",
        "its mtime was",
        "its allocated map was",
        "cp -a",
        "--disk-changed-ok",
    ] {
        assert!(e.contains(want), "{want:?} in {e}");
    }
    let restored = RunningVm::restore(
        &file,
        &["--disk", image.to_str().unwrap(), "--disk-changed-ok"],
    );
    disk_verifies_clean(&restored);
    drop(restored);
    // Another size is refused, told or not.
    f.set_len(128 << 20).unwrap();
    let e = refused(&["--disk-changed-ok"]);
    assert!(
        e.contains("is 134217728 bytes and was 67108864 bytes"),
        "{e}"
    );
}

/// The stderr of a `ferry ARGS` that must fail before it runs a guest; one still running after
/// 30 s was not refused (it is killed).
fn refused_run(args: &[&str]) -> String {
    let mut child = common::ferry()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("ferry {args:?} was not refused: it ran\n{}", stderr(&out));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", stderr(&out));
    stderr(&out)
}

/// Copies `image` to `copy` as the README says to keep an image with its snapshot: sparse,
/// with its timestamps (the restore's check compares the mtime).
fn keep_with_snapshot(image: &std::path::Path, copy: &std::path::Path) {
    let out = std::process::Command::new("cp")
        .args(["-a", "--sparse=always"])
        .arg(image)
        .arg(copy)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
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
