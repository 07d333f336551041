//! Precopy with the VMM's dirty ring (`VmConfig::dirty_ring`) on real KVM: two vCPUs write at
//! random into small rings that fill again and again (each fill is the vCPU thread's own
//! harvest), the syncs harvest the rest, and the guest verifies every page on the destination.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{TestVm, boot_config, config, receive_from, verifies_clean};
use ferry_migrate::{MigrationStats, Phase, TimeoutAction};
use ferry_vmm::migration::MigrationRequest;
use ferry_vmm::{IncomingVm, SerialOutput, Vm, VmConfig};

const MIB: u64 = 1 << 20;

/// Migrates `src` (booted from `c`) into a VM of the same config, with a 300 ms downtime limit
/// and the request as `adjust` leaves it; the destination, resumed and completed, and the
/// statistics.
fn migrate(
    src: &TestVm,
    c: VmConfig,
    dir: &std::path::Path,
    adjust: impl FnOnce(&mut MigrationRequest),
) -> (IncomingVm, MigrationStats) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(VmConfig {
        serial: SerialOutput::File(dir.join("destination.log")),
        ..c
    })
    .unwrap();
    let mut req = MigrationRequest {
        downtime_limit_ms: 300,
        timeout_ms: Some(60_000),
        timeout_action: TimeoutAction::Cancel,
        ..MigrationRequest::to(listener.local_addr().unwrap().to_string())
    };
    adjust(&mut req);
    let (received, progress) = receive_from(&src.handle(), &mut incoming, &listener, req);
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    (incoming, progress.stats.unwrap())
}

#[test]
fn a_guest_tracked_by_small_dirty_rings_migrates_and_verifies_clean() {
    let dir = tempfile::tempdir().unwrap();
    let serial = dir.path().join("source.log");
    let mut c = config(
        512 * MIB,
        "ws=128M pattern=random rate=60 verify-ms=200",
        &serial,
    );
    c.vcpus = 2;
    // The smallest ring: two vCPUs at 60 MB/s fill 256 entries every ~35 ms each.
    c.dirty_ring = Some(256);
    let src = boot_config(c.clone());
    let before = src.wait_for("a clean verify pass", Duration::from_secs(60), |g| {
        g.vcpus.len() == 2 && g.vcpus.iter().all(|v| v.verify_passes >= 1)
    });
    assert_eq!(before.verify_failures, 0);

    let (incoming, stats) = migrate(&src, c, dir.path(), |_| {});
    assert!(
        stats.passes.len() >= 2 && stats.passes[1].pages > 0,
        "the rings reported pages written during pass 1: {:?}",
        stats.passes
    );
    let dst = incoming.into_running().expect("resumed");
    verifies_clean(&dst, 2);
}

/// One vCPU writes flat out while two compute; a per-vCPU dirty limit holds the writer to it
/// (it sleeps) and leaves the computing vCPUs alone (they never sleep for it), and the guest
/// verifies clean on the destination.
#[test]
fn a_dirty_limit_slows_the_writing_vcpu_alone() {
    const LIMIT: u64 = 20_000_000;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(
        512 * MIB,
        "ws=128M pattern=random verify-ms=300 compute=2",
        &dir.path().join("source.log"),
    );
    c.vcpus = 3;
    c.dirty_ring = Some(1024);
    let src = boot_config(c.clone());
    src.wait_for(
        "a verify pass and the computing vCPUs' work",
        Duration::from_secs(60),
        |g| {
            g.vcpus.len() == 3
                && g.vcpus[0].verify_passes >= 1
                && g.vcpus[1..].iter().all(|v| v.work_units > 0)
        },
    );
    let (incoming, stats) = migrate(&src, c, dir.path(), |r| {
        r.timeout_action = TimeoutAction::Switchover;
        r.dirty_limit = Some(LIMIT);
    });
    assert_eq!(stats.dirty_limit_min, Some(LIMIT));
    assert_eq!(stats.vcpus.len(), 3, "{:?}", stats.vcpus);
    let writer = stats.vcpus[0];
    assert!(writer.limited_ms > 0.0, "the writer slept: {writer:?}");
    for v in &stats.vcpus[1..] {
        assert_eq!(v.limited_ms, 0.0, "a computing vCPU slept: {v:?}");
    }
    // The writer dirtied at most the limit over precopy, with a ring's worth and a burst of
    // slack; flat out it dirties tens of times more.
    let precopy_s = (stats.total_ms - stats.downtime.total_ms) / 1e3;
    let dirtied = writer.dirtied_pages * 4096;
    eprintln!(
        "precopy {precopy_s:.2} s, {} passes, per vCPU {:?}",
        stats.passes.len(),
        stats.vcpus
    );
    let allowed = LIMIT as f64 * (precopy_s + 0.1) + 1024.0 * 4096.0;
    assert!(
        (dirtied as f64) < allowed * 1.2,
        "the writer dirtied {dirtied} bytes in {precopy_s:.2} s under a {LIMIT} B/s limit"
    );
    // And it was slowed to the limit, not stopped: a quarter of it at least (loose, for a
    // loaded machine; unloaded it reaches about three quarters in so short a precopy).
    assert!(
        dirtied as f64 > LIMIT as f64 * precopy_s / 4.0,
        "the writer dirtied only {dirtied} bytes in {precopy_s:.2} s under a {LIMIT} B/s limit"
    );
    // What the computing vCPUs had done on the source when it paused.
    let on_source = src.handle().telemetry();
    let dst = incoming.into_running().expect("resumed");
    let resumed = dst.handle().telemetry();
    let after = common::wait_for_telemetry(
        &dst.handle(),
        "two verify passes, and work past the source's, on the destination",
        Duration::from_secs(60),
        |g| {
            g.vcpus.len() == 3
                && g.vcpus[0].verify_passes >= resumed.vcpus[0].verify_passes + 2
                && (1..3).all(|i| g.vcpus[i].work_units > on_source.vcpus[i].work_units)
        },
    );
    assert_eq!(after.verify_failures, 0, "{:?}", after.first_failed_verify);
}

/// Without the dirty ring the VMM cannot tell which vCPU wrote a page: a migration asked for a
/// dirty limit fails before it sends anything, says how to get one, and the guest runs on.
#[test]
fn a_dirty_limit_without_the_ring_is_refused_and_the_guest_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(256 * MIB, "ws=32M rate=20", &dir.path().join("source.log"));
    let src = boot_config(c);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(config(256 * MIB, "", &dir.path().join("dst.log"))).unwrap();
    let req = MigrationRequest {
        dirty_limit: Some(10_000_000),
        ..MigrationRequest::to(listener.local_addr().unwrap().to_string())
    };
    let (received, progress) = receive_from(&src.handle(), &mut incoming, &listener, req);
    assert!(received.is_err());
    assert_eq!(progress.phase, Phase::Failed, "{progress:?}");
    let why = progress.error.clone().unwrap_or_default();
    assert!(why.contains("--dirty-ring"), "{why}");
    let before = src.handle().telemetry().pages_written;
    src.wait_for(
        "the source guest writing on",
        Duration::from_secs(30),
        |g| g.pages_written > before,
    );
}
