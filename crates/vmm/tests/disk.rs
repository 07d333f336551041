//! A VM with a disk (virtio-blk over a raw image) migrated over loopback on real KVM: on shared
//! storage (both VMs name one image) and with the disk copied beside RAM (`disk_copy`), the
//! guest re-reading every block it wrote on the destination; and migrations that fail leave
//! the source running as the image's only writer.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{TestVm, boot_config, config, forced_request, receive_from, wait_for_telemetry};
use ferry_migrate::Phase;
use ferry_vmm::devices::telemetry::GuestTelemetry;
use ferry_vmm::migration::MigrationRequest;
use ferry_vmm::request::{MigrationMode, PostcopyRequest};
use ferry_vmm::{DiskOptions, RunState, Vm, VmConfig};

const MIB: u64 = 1 << 20;
const MEMORY: u64 = 256 * MIB;
/// The guest writes 4 KiB blocks of its first 16 MiB at 4 MB/s, reads a fifth of its accesses
/// back, and re-reads every block it wrote in each verify pass.
const GUEST: &str = "ws=16M rate=20 disk=16M disk-rate=4 disk-read=20 verify-ms=200 log-ms=0";

/// A sparse raw image of `bytes` at `path`.
fn image(path: &Path, bytes: u64) -> PathBuf {
    std::fs::File::create(path).unwrap().set_len(bytes).unwrap();
    path.into()
}

fn with_disk(path: &Path, serial: &Path) -> VmConfig {
    VmConfig {
        disk: Some(path.to_str().unwrap().parse::<DiskOptions>().unwrap()),
        net: None,
        ..config(MEMORY, GUEST, serial)
    }
}

/// Full sweeps of the guest's disk verify: each re-read every block written before it got
/// there.
fn sweeps(g: &GuestTelemetry) -> u64 {
    g.disk.as_ref().map_or(0, |d| d.sweeps)
}

/// The guest's disk counters: blocks written, blocks read back, verify failures, request
/// errors.
fn disk(g: &GuestTelemetry) -> (u64, u64, u64, u64) {
    g.disk.as_ref().map_or((0, 0, 0, 0), |d| {
        (
            d.blocks_written,
            d.blocks_read,
            d.verify_failures,
            d.request_errors,
        )
    })
}

/// A source whose guest has written and read its disk back.
fn source(dir: &Path, image_path: &Path) -> TestVm {
    let src = boot_config(with_disk(image_path, &dir.join("source.log")));
    let g = src.wait_for("disk writes and reads", Duration::from_secs(60), |g| {
        let (w, r, _, _) = disk(g);
        w >= 200 && r >= 20
    });
    assert_eq!(disk(&g).2, 0, "no bad block before the move: {:?}", g.disk);
    src
}

/// Migrates `src` into a VM whose disk is `dst_image`, with `req` adjusted by `adjust`.
fn migrate(
    src: &TestVm,
    dir: &Path,
    dst_image: &Path,
    adjust: impl FnOnce(&mut MigrationRequest),
) -> (
    ferry_vmm::IncomingVm,
    Result<ferry_migrate::destination::ReceiveStats, ferry_migrate::MigrateError>,
    ferry_migrate::Progress,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(with_disk(dst_image, &dir.join("destination.log"))).unwrap();
    let mut req = forced_request(&listener);
    adjust(&mut req);
    let (received, progress) = receive_from(&src.handle(), &mut incoming, &listener, req);
    (incoming, received, progress)
}

/// The destination's guest goes on writing its disk and, in a whole sweep begun after the
/// move, reads back every block it wrote, all clean.
fn disk_verifies_clean(dst: &Vm) {
    let resumed = dst.handle().telemetry();
    let at = disk(&resumed);
    let g = wait_for_telemetry(
        &dst.handle(),
        "more disk writes and two whole verify sweeps on the destination",
        Duration::from_secs(90),
        |g| disk(g).0 > at.0 + 50 && sweeps(g) >= sweeps(&resumed) + 2,
    );
    let (_, _, failures, errors) = disk(&g);
    assert_eq!(
        failures, 0,
        "a block lost or stale after the move: {:?}",
        g.disk
    );
    assert_eq!(errors, 0, "a request failed after the move: {:?}", g.disk);
    common::verifies_clean(dst, 1);
}

#[test]
fn on_shared_storage_the_destination_takes_the_same_image_and_every_block_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let shared = image(&dir.path().join("shared.img"), 64 * MIB);
    let src = source(dir.path(), &shared);
    let (incoming, received, progress) = migrate(&src, dir.path(), &shared, |_| {});
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let stats = progress.stats.unwrap();
    assert_eq!(stats.state_chunks, 0, "no block is copied: {stats:?}");
    let dst = incoming.into_running().expect("resumed");
    disk_verifies_clean(&dst);
}

#[test]
fn a_disk_no_host_shares_is_copied_beside_ram_and_every_block_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let own = image(&dir.path().join("source.img"), 64 * MIB);
    let src = source(dir.path(), &own);
    let copy = dir.path().join("copy.img");
    let (incoming, received, progress) = migrate(&src, dir.path(), &copy, |r| r.disk_copy = true);
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let stats = progress.stats.unwrap();
    assert!(stats.state_chunks > 0, "the disk went in chunks: {stats:?}");
    assert!(
        stats.state_chunk_bytes < 32 * MIB,
        "only what the guest wrote went, not the 64 MiB image: {stats:?}"
    );
    assert!(copy.exists(), "the copy became the destination's image");
    assert!(!dir.path().join("copy.img.ferry-incoming").exists());
    let dst = incoming.into_running().expect("resumed");
    disk_verifies_clean(&dst);
}

/// A VM whose guest, its RAM nearly idle, writes its disk as fast as the device answers
/// (about 8 MB/s of 4 KiB requests).
fn flat_out(dir: &Path, image: &Path, log: &str) -> VmConfig {
    let guest = "ws=4M rate=1 disk=32M disk-rate=max disk-read=20 verify-ms=200 log-ms=0";
    VmConfig {
        disk: Some(image.to_str().unwrap().parse::<DiskOptions>().unwrap()),
        net: None,
        ..config(MEMORY, guest, &dir.join(log))
    }
}

/// A disk copy over a 6 MB/s link, slower than a [`flat_out`] guest writes, with no throttle
/// to slow the guest: only the mirror can.
fn over_a_slow_link(listener: &TcpListener) -> MigrationRequest {
    MigrationRequest {
        disk_copy: true,
        max_bandwidth: Some(6_000_000),
        auto_converge: false,
        timeout_action: ferry_migrate::TimeoutAction::Cancel,
        ..forced_request(listener)
    }
}

#[test]
fn a_guest_writing_its_disk_faster_than_the_link_is_held_by_the_mirror_and_the_copy_ends() {
    let dir = tempfile::tempdir().unwrap();
    let own = image(&dir.path().join("source.img"), 64 * MIB);
    // Without the mirror this copy never ends: the test cancels at its timeout.
    let src = boot_config(flat_out(dir.path(), &own, "source.log"));
    let before = src.wait_for("disk writes", Duration::from_secs(60), |g| disk(g).0 >= 500);
    let copy = dir.path().join("copy.img");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(flat_out(dir.path(), &copy, "destination.log")).unwrap();
    let req = MigrationRequest {
        downtime_limit_ms: 300,
        ..over_a_slow_link(&listener)
    };
    let started = Instant::now();
    let (received, progress) = receive_from(&src.handle(), &mut incoming, &listener, req);
    let took = started.elapsed();
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let status = src.handle().disk().expect("a disk");
    let written = disk(&src.handle().telemetry()).0 - disk(&before).0;
    eprintln!(
        "migrated in {took:?} ({} passes, {} bytes); the guest wrote {written} blocks \
         meanwhile; its writers were held {:.0} ms",
        progress.pass, progress.bytes_sent, status.mirror_held_ms
    );
    assert!(
        status.mirror_held_ms > 0.0,
        "the guest outran the link, so the mirror held it: {status:?}"
    );
    let dst = incoming.into_running().expect("resumed");
    disk_verifies_clean(&dst);
}

#[test]
fn a_destination_without_the_image_refuses_at_the_state_load_and_the_source_keeps_its_disk() {
    let dir = tempfile::tempdir().unwrap();
    let own = image(&dir.path().join("source.img"), 64 * MIB);
    let src = source(dir.path(), &own);
    // Shared storage was assumed, but the destination's image is an empty file.
    let empty = image(&dir.path().join("empty.img"), 0);
    let (_incoming, received, progress) = migrate(&src, dir.path(), &empty, |_| {});
    let e = received.expect_err("the destination cannot open a 0-byte image as the disk");
    assert!(e.to_string().contains("bytes"), "{e}");
    assert_eq!(progress.phase, Phase::Failed, "{progress:?}");
    assert_eq!(
        src.handle().state(),
        RunState::Running,
        "the source runs on"
    );
    let at = disk(&src.handle().telemetry());
    let deadline = Instant::now() + Duration::from_secs(60);
    let g = src.wait_for(
        "the source's guest writes its disk on",
        deadline - Instant::now(),
        |g| disk(g).0 > at.0 + 50,
    );
    assert_eq!(disk(&g).2, 0, "{:?}", g.disk);
}

#[test]
fn a_disk_copy_cancelled_leaves_the_source_running_and_no_file_at_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    let own = image(&dir.path().join("source.img"), 64 * MIB);
    let src = source(dir.path(), &own);
    let copy = dir.path().join("copy.img");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(with_disk(&copy, &dir.path().join("destination.log"))).unwrap();
    let req = MigrationRequest {
        disk_copy: true,
        // 2 MB/s: the copy is still running when it is cancelled.
        max_bandwidth: Some(2_000_000),
        ..forced_request(&listener)
    };
    let part = dir.path().join("copy.img.ferry-incoming");
    cancel_when(
        &src,
        &mut incoming,
        &listener,
        req,
        "the copy started arriving",
        || part.exists(),
    );
    drop(incoming);
    assert!(!copy.exists(), "no image appeared at the destination");
    assert!(
        !dir.path().join("copy.img.ferry-incoming").exists(),
        "the partial copy went"
    );
    assert_eq!(src.handle().state(), RunState::Running);
    let at = disk(&src.handle().telemetry());
    let g = src.wait_for(
        "the source's guest writes its disk on",
        Duration::from_secs(60),
        |g| disk(g).0 > at.0 + 50,
    );
    assert_eq!(disk(&g).2, 0, "{:?}", g.disk);
}

#[test]
fn a_disk_copy_is_in_sync_before_postcopy_hands_the_guest_over() {
    let dir = tempfile::tempdir().unwrap();
    let own = image(&dir.path().join("source.img"), 64 * MIB);
    let src = source(dir.path(), &own);
    let copy = dir.path().join("copy.img");
    let (incoming, received, progress) = migrate(&src, dir.path(), &copy, |r| {
        r.disk_copy = true;
        // No guest fits 1 ms: the switch to postcopy after pass 1 ends precopy.
        r.downtime_limit_ms = 1;
        r.mode = MigrationMode::Postcopy(PostcopyRequest {
            after_passes: Some(1),
            ..PostcopyRequest::default()
        });
    });
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let stats = progress.stats.unwrap();
    assert!(stats.postcopy.is_some(), "switched to postcopy: {stats:?}");
    assert!(stats.state_chunks > 0, "{stats:?}");
    // The disk's chunks all went before the switch: the guest runs there with the whole disk.
    let dst = incoming.into_running().expect("resumed");
    disk_verifies_clean(&dst);
}

#[test]
fn a_disk_copy_cancelled_while_the_mirror_holds_the_guest_lets_it_go() {
    let dir = tempfile::tempdir().unwrap();
    let own = image(&dir.path().join("source.img"), 64 * MIB);
    let src = boot_config(flat_out(dir.path(), &own, "source.log"));
    src.wait_for("disk writes", Duration::from_secs(60), |g| disk(g).0 >= 500);
    let copy = dir.path().join("copy.img");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(flat_out(dir.path(), &copy, "destination.log")).unwrap();
    // A downtime limit no pass can meet: the copy mirrors until it is cancelled.
    let req = MigrationRequest {
        downtime_limit_ms: 1,
        ..over_a_slow_link(&listener)
    };
    let held = || src.handle().disk().expect("a disk").mirror_held_ms;
    cancel_when(
        &src,
        &mut incoming,
        &listener,
        req,
        "the mirror held the guest's writers",
        || held() > 0.0,
    );
    drop(incoming);
    assert!(!dir.path().join("copy.img.ferry-incoming").exists());
    assert_eq!(src.handle().state(), RunState::Running);
    let (at, held_at_cancel) = (disk(&src.handle().telemetry()), held());
    let g = src.wait_for(
        "the source's guest writes its disk on, flat out",
        Duration::from_secs(60),
        |g| disk(g).0 > at.0 + 2000,
    );
    assert_eq!(
        held(),
        held_at_cancel,
        "no writer is held once the copy ended"
    );
    assert_eq!(disk(&g).2, 0, "{:?}", g.disk);
}

/// Migrates `src` into `incoming` with `req`, cancels it once `ready` says so (within a
/// minute, else the test fails naming `what`), and checks it ended cancelled with the
/// destination taking no guest.
fn cancel_when(
    src: &TestVm,
    incoming: &mut ferry_vmm::IncomingVm,
    listener: &TcpListener,
    req: MigrationRequest,
    what: &str,
    ready: impl Fn() -> bool,
) {
    let received = std::thread::scope(|s| {
        let deadline = Instant::now() + Duration::from_secs(90);
        let r = s.spawn(move || {
            ferry_vmm::migration::receive(incoming, listener, &|| Instant::now() < deadline)
        });
        let control = src.handle().start_migration(req).unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        while !ready() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(ready(), "{what}");
        control.cancel();
        r.join().unwrap()
    });
    assert!(received.is_err(), "the destination took no guest");
    let progress = common::wait_migration(&src.handle(), Duration::from_secs(60));
    assert_eq!(progress.phase, Phase::Cancelled, "{progress:?}");
}
