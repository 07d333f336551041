//! Free page hinting and the balloon on real KVM, with the built-in guest's driver: a guest
//! that freed most of its memory migrates without sending it and verifies clean on the
//! destination, also while it keeps allocating, writing and freeing blocks (churn); the guest
//! gets its hinted blocks back (DONE) on the destination; inflate and deflate move its memory.

mod common;

use std::time::Duration;

use common::{TestVm, boot, config, migrate_into, require_kvm, verifies_clean, wait_for_telemetry};
use ferry_migrate::MigrationStats;
use ferry_vmm::Vm;
use ferry_vmm::devices::telemetry::GuestTelemetry;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// 2 MiB blocks of free memory, as the guest counts them.
const BLOCK: u64 = 2 * MIB;

/// Boots a guest that filled and freed `free` bytes and waits until its balloon driver runs.
fn freed_guest(memory: u64, params: &str) -> TestVm {
    let src = boot(memory, params);
    src.wait_for(
        "the free memory filled and a heartbeat",
        Duration::from_secs(120),
        |g| g.free_memory.is_some_and(|f| f.blocks_free > 0) && g.verify_passes >= 1,
    );
    assert!(
        src.handle().balloon().is_some_and(|b| b.driver_ok),
        "the guest's driver runs: {:?}",
        src.handle().balloon()
    );
    src
}

/// Migrates `src` into a new VM of `memory` bytes; returns it running and the statistics.
fn migrate(src: &TestVm, memory: u64, hints: bool) -> (Vm, MigrationStats) {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    let incoming = Vm::incoming(config(memory, "", &dir.path().join("serial.log"))).unwrap();
    let (dst, progress) = migrate_into(&src.handle(), incoming, |req| {
        req.free_page_hints = hints;
    });
    (dst, progress.stats.unwrap())
}

/// The destination's guest verifies clean and frees the blocks it held for hinting.
fn verifies_and_gets_its_blocks_back(dst: &Vm) -> GuestTelemetry {
    verifies_clean(dst, 2);
    wait_for_telemetry(
        &dst.handle(),
        "the guest's hinted blocks back after DONE",
        Duration::from_secs(30),
        |g| g.free_memory.is_some_and(|f| f.blocks_held == 0),
    )
}

#[test]
fn a_guest_that_freed_6g_of_8g_migrates_without_sending_it_and_verifies_clean() {
    let src = freed_guest(8 * GIB, "ws=256M rate=20 free=6G verify-ms=500 log-ms=0");
    let (dst, stats) = migrate(&src, 8 * GIB, true);
    let pages = 6 * GIB / 4096;
    eprintln!(
        "hinted: {} MB sent, {} pages skipped as hinted, {} rounds, total {:.0} ms, downtime {:.1} ms",
        stats.bytes_sent / 1_000_000,
        stats.pages_skipped_hinted,
        stats.hint_rounds,
        stats.total_ms,
        stats.downtime.total_ms
    );
    assert!(
        stats.pages_skipped_hinted > pages * 9 / 10,
        "most of the free memory is not sent: {stats:?}"
    );
    assert!(
        stats.bytes_sent < GIB,
        "only what the guest uses is sent: {} bytes",
        stats.bytes_sent
    );
    let after = verifies_and_gets_its_blocks_back(&dst);
    let free = after.free_memory.unwrap();
    assert_eq!(u64::from(free.blocks_free), 6 * GIB / BLOCK, "{free:?}");
    assert!(free.hint_rounds >= 1 && free.blocks_hinted > 0, "{free:?}");
}

/// A driver that hints 1 block per 20 ms heartbeat takes 10 s for a round over 1 GiB (512
/// blocks): the migration, which takes about a second (a few on a loaded machine), switches
/// over in the middle of it. The hints that came are used, the rest of the
/// free memory is sent, and on the destination the guest reads DONE and gets every held block
/// back.
#[test]
fn a_migration_in_the_middle_of_a_round_of_hints_verifies_and_frees_the_held_blocks() {
    let src = freed_guest(
        2 * GIB,
        "ws=64M rate=20 free=1G hint-batch=1 heartbeat-ms=20 verify-ms=300 log-ms=0",
    );
    let (dst, stats) = migrate(&src, 2 * GIB, true);
    let free_pages = GIB / 4096;
    assert!(
        stats.pages_skipped_hinted > 0 && stats.pages_skipped_hinted < free_pages / 2,
        "some of the free memory was hinted before the switchover, not all: {stats:?}"
    );
    let on_source = src.handle().telemetry().free_memory.unwrap();
    assert!(
        on_source.blocks_held > 0 && u64::from(on_source.blocks_held) < GIB / BLOCK,
        "the round was unfinished at the pause: {on_source:?}"
    );
    let after = verifies_and_gets_its_blocks_back(&dst);
    assert_eq!(
        u64::from(after.free_memory.unwrap().blocks_free),
        GIB / BLOCK,
        "every held block is free again"
    );
}

#[test]
fn with_churn_during_the_migration_every_block_the_guest_holds_verifies() {
    let src = freed_guest(
        2 * GIB,
        "ws=128M rate=20 free=1G churn=200 verify-ms=200 log-ms=0",
    );
    src.wait_for("the churn running", Duration::from_secs(30), |g| {
        g.free_memory.is_some_and(|f| f.blocks_churned > 64)
    });
    let (dst, stats) = migrate(&src, 2 * GIB, true);
    assert!(stats.pages_skipped_hinted > 0, "{stats:?}");
    // Free-memory counters come with heartbeats (they are not part of the migrated state).
    let first = wait_for_telemetry(
        &dst.handle(),
        "a heartbeat on the destination",
        Duration::from_secs(30),
        |g| g.free_memory.is_some(),
    );
    let before = first.free_memory.unwrap();
    let after = verifies_and_gets_its_blocks_back(&dst);
    let after_free = after.free_memory.unwrap();
    assert!(
        after_free.blocks_churned > before.blocks_churned,
        "the churn goes on on the destination, each block verified before it is freed: {after_free:?}"
    );
}

#[test]
fn without_hints_the_free_memory_is_sent() {
    let src = freed_guest(GIB, "ws=64M rate=20 free=512M verify-ms=300 log-ms=0");
    let (dst, stats) = migrate(&src, GIB, false);
    assert_eq!((stats.hint_rounds, stats.pages_skipped_hinted), (0, 0));
    assert!(stats.bytes_sent > 512 * MIB, "{}", stats.bytes_sent);
    verifies_clean(&dst, 1);
}

#[test]
fn inflating_gives_memory_back_to_the_host_and_deflating_returns_it() {
    let src = freed_guest(GIB, "ws=64M rate=20 free=512M verify-ms=300 log-ms=0");
    let h = src.handle();
    let before = h.status().memory_allocated_bytes;
    h.set_balloon_target(256 * MIB).unwrap();
    let g = src.wait_for("256 MiB in the balloon", Duration::from_secs(30), |g| {
        g.free_memory
            .is_some_and(|f| u64::from(f.blocks_ballooned) * BLOCK == 256 * MIB)
    });
    let b = h.balloon().unwrap();
    assert_eq!(b.actual_bytes, 256 * MIB, "{b:?}");
    assert_eq!(b.discarded_pages, 256 * MIB / 4096, "{b:?}");
    let after = h.status().memory_allocated_bytes;
    assert!(
        before - after >= 200 * MIB,
        "the host got the memory back: {before} -> {after} allocated bytes"
    );
    h.set_balloon_target(0).unwrap();
    src.wait_for("the balloon deflated", Duration::from_secs(30), |g| {
        g.free_memory.is_some_and(|f| f.blocks_ballooned == 0)
    });
    assert_eq!(h.balloon().unwrap().actual_bytes, 0);
    assert!(g.verify_failures == 0);
    assert!(
        h.set_balloon_target(2 * GIB).is_err(),
        "more than the VM has"
    );
}
