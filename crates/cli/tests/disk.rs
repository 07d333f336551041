//! A VM with a disk through the `ferry` binary: `ferry run --disk`, and `ferry migrate
//! --disk-copy` between two `ferry run` processes whose images are files of their own, the
//! destination's guest re-reading every block it wrote; a snapshot's image check at restore;
//! and a disk copy's failures (a destination killed, the link cut, in the disk pass, while the
//! mirror holds the guest, and at the switchover), each leaving the source's guest reading its
//! image back clean.

mod common;

use std::time::Duration;

use common::{RunningVm, destination_with, ferry_output, start_migrate, stderr};
use ferry_migrate::wire::Kind;
use ferry_migrate_testkit::proxy::{Direction, Proxy};

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
    source_of(
        "ws=16M rate=20 disk=16M disk-rate=4 verify-ms=200 log-ms=0",
        memory,
        image,
    )
}

/// A guest that, its RAM nearly idle, writes its disk as fast as the device answers (about
/// 8 MB/s of 4 KiB requests): faster than [`mirrored_disk_copy`]'s link.
const FLAT_OUT: &str = "ws=4M rate=1 disk=32M disk-rate=max disk-read=20 verify-ms=200 log-ms=0";

/// A `ferry run` of `memory` whose guest runs `guest` with `image` as its disk, once it wrote
/// 200 blocks.
fn source_of(guest: &str, memory: &str, image: &std::path::Path) -> RunningVm {
    let src = RunningVm::start_with(memory, guest, &["--disk", image.to_str().unwrap()]);
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
    let stats = images.path().join("stats.json");
    let migrate = start_migrate(
        &src,
        port,
        &["--disk-copy", "--stats-out", stats.to_str().unwrap()],
    );
    let out = migrate.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    assert!(stdout.contains("iterative state"), "{stdout}");
    let err = stderr(&out);
    assert!(err.contains("disk copy: "), "the disk's own figures: {err}");
    assert!(copy.exists(), "the copy became the destination's image");
    // The statistics file carries the disk's figures, and `ferry report` shows them.
    let written: serde_json::Value = serde_json::from_str(&common::read(&stats)).unwrap();
    assert!(
        written["disk"]["stats"]["chunks"].as_u64() > Some(0),
        "{}",
        written["disk"]
    );
    let svg = images.path().join("report.svg");
    let report = ferry_output(&[
        "report",
        stats.to_str().unwrap(),
        "-o",
        svg.to_str().unwrap(),
    ]);
    assert!(report.status.success(), "{}", stderr(&report));
    assert!(
        common::read(&svg).contains("disk copy: "),
        "in the report's title"
    );
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

/// Issue 50: a local handover passes the disk image's descriptor with guest RAM, and the new
/// process takes over that open file rather than opening its `--disk` path. So the image may
/// be moved after the source started, and another file put at its path: the guest keeps its
/// own disk (every block reads back clean) and writes on into the moved file, the same inode,
/// while the file at the path stays untouched. Opening the path instead would give the guest
/// the other file's zeros.
#[test]
fn a_local_handover_takes_the_disk_along_by_its_descriptor_and_every_block_reads_back() {
    use std::os::unix::fs::MetadataExt;
    let images = tempfile::tempdir().unwrap();
    let image = image(&images.path().join("vm.img"));
    let src = source("512M", &image);
    let (dst, to) = common::unix_destination("512M", &["--disk", image.to_str().unwrap()]);
    let moved = images.path().join("vm.img.moved");
    std::fs::rename(&image, &moved).unwrap();
    let inode = std::fs::metadata(&moved).unwrap().ino();
    let decoy = self::image(&image);
    let out = common::ferry()
        .args(["migrate", "--local", "--to", &to, "--api-socket"])
        .arg(&src.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let written = disk(&dst, "blocks_written");
    let mtime = |m: std::fs::Metadata| (m.mtime(), m.mtime_nsec());
    let before = mtime(std::fs::metadata(&moved).unwrap());
    disk_verifies_clean(&dst);
    assert!(
        disk(&dst, "blocks_written") > written,
        "the guest writes on"
    );
    let after = std::fs::metadata(&moved).unwrap();
    assert_eq!(after.ino(), inode);
    assert_ne!(
        mtime(after),
        before,
        "the new process writes the moved image"
    );
    assert_eq!(
        std::fs::metadata(&decoy).unwrap().blocks(),
        0,
        "nothing wrote the file now at the path"
    );
}

/// The destination's partial copy of `image` (`disk_copy::incoming`).
fn incoming_part(image: &std::path::Path) -> std::path::PathBuf {
    let mut part = image.as_os_str().to_owned();
    part.push(".ferry-incoming");
    part.into()
}

/// A disk copy from `src` through `to_port` at 2 MB/s (so that its disk pass lasts seconds),
/// once the copy started arriving at `image`'s partial file.
fn slow_disk_copy(src: &RunningVm, to_port: u16, image: &std::path::Path) -> std::process::Child {
    let migrate = start_migrate(
        src,
        to_port,
        &[
            "--disk-copy",
            "--max-bandwidth",
            "2M",
            "--peer-timeout",
            "5s",
        ],
    );
    let part = incoming_part(image);
    src.wait_until("the disk copy arriving", Duration::from_secs(30), |_| {
        part.exists()
    });
    migrate
}

/// `ferry migrate`'s failure, within 30 s: its stdout and stderr.
fn migration_fails(migrate: std::process::Child) -> String {
    let out = migrate.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(!out.status.success(), "the migration failed: {text}");
    text
}

/// The source runs on as its image's only writer: running, not handed over, its guest writing
/// its disk and reading every block back clean.
fn source_runs_on(src: &RunningVm) {
    assert_eq!(src.status()["state"], "running");
    let written = disk(src, "blocks_written");
    src.wait_until(
        "the source's guest writing on",
        Duration::from_secs(60),
        |vm| disk(vm, "blocks_written") > written + 50,
    );
    disk_verifies_clean(src);
}

/// Issue 50: a destination killed while the disk's chunks arrive leaves its partial file (it
/// cannot remove it); the source runs on, and the next migration to that path is refused naming
/// the file and saying to remove it; once it is removed, the migration completes.
#[test]
fn a_destination_killed_in_the_disk_pass_leaves_the_source_running_and_its_file_named() {
    let images = tempfile::tempdir().unwrap();
    let src = source("256M", &image(&images.path().join("source.img")));
    let copy = images.path().join("copy.img");
    let (mut dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let migrate = slow_disk_copy(&src, port, &copy);
    dst.child.kill().unwrap();
    dst.child.wait().unwrap();
    migration_fails(migrate);
    source_runs_on(&src);
    assert!(!copy.exists(), "no image appeared");
    assert!(
        incoming_part(&copy).exists(),
        "a killed process leaves its file"
    );

    let (_dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let err = migration_fails(start_migrate(&src, port, &["--disk-copy"]));
    assert!(
        err.contains("copy.img.ferry-incoming is in the way of the disk copy")
            && err.contains("remove it"),
        "{err}"
    );
    assert_eq!(src.status()["state"], "running");

    std::fs::remove_file(incoming_part(&copy)).unwrap();
    let (dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let out = start_migrate(&src, port, &["--disk-copy"])
        .wait_with_output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    disk_verifies_clean(&dst);
}

/// Issue 50: every connection cut while the disk's chunks arrive: the source runs on, the
/// destination gives up and removes its partial file.
#[test]
fn a_link_cut_in_the_disk_pass_leaves_the_source_running_and_no_file_at_the_destination() {
    let images = tempfile::tempdir().unwrap();
    let src = source("256M", &image(&images.path().join("source.img")));
    let copy = images.path().join("copy.img");
    let (dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let proxy = Proxy::start(&format!("127.0.0.1:{port}"), 10 << 30);
    let migrate = slow_disk_copy(&src, proxy_port(&proxy), &copy);
    assert!(proxy.cut_all() > 0, "connections to cut");
    migration_fails(migrate);
    let out = dst.finish(Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(!incoming_part(&copy).exists(), "the partial copy went");
    assert!(!copy.exists(), "no image appeared");
    source_runs_on(&src);
}

/// Issue 50: every connection cut at the switchover (the guest paused, the disk in sync, the
/// device state about to go): the source stays paused and handed over, as any migration cut
/// there (it cannot know whether the destination runs the guest); resumed by force, its guest
/// reads its image back clean; the destination removed its partial file.
#[test]
fn a_link_cut_at_a_disk_copys_switchover_leaves_the_source_resumable_and_its_image_whole() {
    let images = tempfile::tempdir().unwrap();
    let src = source("256M", &image(&images.path().join("source.img")));
    let copy = images.path().join("copy.img");
    let (dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let proxy = Proxy::start(&format!("127.0.0.1:{port}"), 10 << 30);
    proxy.hold_at(Direction::ToDestination, Kind::DeviceState);
    let migrate = start_migrate(
        &src,
        proxy_port(&proxy),
        &["--disk-copy", "--peer-timeout", "5s"],
    );
    assert!(
        proxy.wait_struck(Duration::from_secs(60)),
        "the device state reached"
    );
    assert!(proxy.cut_all() > 0, "connections to cut");
    let err = migration_fails(migrate);
    assert_eq!(src.status()["state"], "paused", "{err}");
    let out = dst.finish(Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(!incoming_part(&copy).exists(), "the partial copy went");
    assert!(!copy.exists(), "no image appeared");
    let out = common::ferry()
        .args(["resume", "--risk-running-twice", "--api-socket"])
        .arg(&src.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    source_runs_on(&src);
}

/// A disk copy from a [`FLAT_OUT`] `src` through `to_port` at 6 MB/s, with no throttle and a
/// downtime limit no pass meets, so that only the mirror can slow the guest (as in
/// `vmm/tests/disk.rs`); returned once `GET /migration` shows the mirror on and `GET /vm`
/// shows it holding the guest's writers.
fn mirrored_disk_copy(src: &RunningVm, to_port: u16) -> std::process::Child {
    let migrate = start_migrate(
        src,
        to_port,
        &[
            "--disk-copy",
            "--max-bandwidth",
            "6M",
            "--auto-converge",
            "off",
            "--downtime-limit",
            "1ms",
            "--peer-timeout",
            "5s",
        ],
    );
    src.wait_until("the mirror on", Duration::from_secs(60), |vm| {
        // 404 until `ferry migrate` started it.
        ferry_vmm::api::client::request(&vm.socket, "GET", "/migration")
            .is_ok_and(|m| m["disk"]["stats"]["mirror"] == true)
    });
    src.wait_until(
        "the mirror holding the guest's writers",
        Duration::from_secs(30),
        |vm| held_ms(vm) > 0.0,
    );
    migrate
}

/// How long the mirror of `vm`'s last disk copy held its guest's writers, ms (`GET /vm`).
fn held_ms(vm: &RunningVm) -> f64 {
    vm.status_of("/vm")["disk"]["mirror_held_ms"]
        .as_f64()
        .unwrap_or(0.0)
}

/// The source, its copy failed while the mirror held its guest, lets its writers go: the
/// guest writes its disk on, flat out, while the time held stays where it was.
fn mirror_lets_go(src: &RunningVm) {
    let (written, held) = (disk(src, "blocks_written"), held_ms(src));
    src.wait_until(
        "the source's guest writing its disk on, flat out",
        Duration::from_secs(60),
        |vm| disk(vm, "blocks_written") > written + 2000,
    );
    assert_eq!(held_ms(src), held, "no writer is held once the copy ended");
}

/// Issue 50: a destination killed while the mirror holds the source's guest: the source's
/// copy fails, its writers are let go and its guest writes on, reading its image back clean;
/// no image appears (the killed process leaves its partial file).
#[test]
fn a_destination_killed_while_the_mirror_holds_the_guest_lets_it_go() {
    let images = tempfile::tempdir().unwrap();
    let src = source_of(FLAT_OUT, "256M", &image(&images.path().join("source.img")));
    let copy = images.path().join("copy.img");
    let (mut dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let migrate = mirrored_disk_copy(&src, port);
    let fault = std::time::Instant::now();
    dst.child.kill().unwrap();
    dst.child.wait().unwrap();
    migration_fails(migrate);
    eprintln!("the copy failed {:?} after the kill", fault.elapsed());
    assert_eq!(src.status()["state"], "running");
    mirror_lets_go(&src);
    disk_verifies_clean(&src);
    assert!(!copy.exists(), "no image appeared");
    assert!(
        incoming_part(&copy).exists(),
        "a killed process leaves its file"
    );
}

/// Issue 50: every connection cut while the mirror holds the source's guest: the source's
/// copy fails, its writers are let go and its guest writes on, reading its image back clean;
/// the destination gives up and removes its partial file.
#[test]
fn a_link_cut_while_the_mirror_holds_the_guest_lets_it_go_and_leaves_no_file() {
    let images = tempfile::tempdir().unwrap();
    let src = source_of(FLAT_OUT, "256M", &image(&images.path().join("source.img")));
    let copy = images.path().join("copy.img");
    let (dst, port) = destination_with("256M", &["--disk", copy.to_str().unwrap()]);
    let proxy = Proxy::start(&format!("127.0.0.1:{port}"), 10 << 30);
    let migrate = mirrored_disk_copy(&src, proxy_port(&proxy));
    let fault = std::time::Instant::now();
    assert!(proxy.cut_all() > 0, "connections to cut");
    migration_fails(migrate);
    eprintln!("the copy failed {:?} after the cut", fault.elapsed());
    let out = dst.finish(Duration::from_secs(30));
    eprintln!("the destination exited {:?} after the cut", fault.elapsed());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(!incoming_part(&copy).exists(), "the partial copy went");
    assert!(!copy.exists(), "no image appeared");
    assert_eq!(src.status()["state"], "running");
    mirror_lets_go(&src);
    disk_verifies_clean(&src);
}

fn proxy_port(proxy: &Proxy) -> u16 {
    proxy.address().rsplit(':').next().unwrap().parse().unwrap()
}
