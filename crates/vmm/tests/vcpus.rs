//! VMs with many vCPUs on real KVM: a thread per vCPU, the built-in guest starting every vCPU
//! and running its workload on each one's share of the working set, pause, resume and stop
//! acting on all of them, every vCPU's state migrating and every vCPU verifying its share on
//! the destination, and a fault on one vCPU naming it.

mod common;

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{boot_config, config, migrate_into, require_kvm, verifies_clean, wait_migration};
use ferry_migrate::Phase;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::{RunState, Vm, VmConfig};

const MIB: u64 = 1 << 20;

fn with_vcpus(vcpus: u8, cmdline: &str, serial: &std::path::Path) -> VmConfig {
    VmConfig {
        vcpus,
        ..config(512 * MIB, cmdline, serial)
    }
}

/// A VM of `n` vCPUs running the built-in guest with `cmdline`, once every vCPU verified.
fn boot_verified(n: u8, cmdline: &str, serial: &std::path::Path) -> common::TestVm {
    let src = boot_config(with_vcpus(n, cmdline, serial));
    src.wait_for("every vCPU verified", Duration::from_secs(60), |g| {
        every_vcpu_verified(g, n)
    });
    src
}

/// Migrates `src` (of `n` vCPUs) into a fresh destination with a forced switchover; returns
/// the running destination and the source's last progress.
fn migrate_forced(
    src: &common::TestVm,
    n: u8,
    serial: &std::path::Path,
) -> (ferry_vmm::Vm, ferry_migrate::Progress) {
    let incoming = Vm::incoming(with_vcpus(n, "", serial)).unwrap();
    migrate_into(&src.handle(), incoming, |_| {})
}

#[test]
fn pause_resume_and_stop_act_on_every_vcpu() {
    for n in [4, 16] {
        let dir = tempfile::tempdir().unwrap();
        let src = boot_verified(
            n,
            "ws=64M rate=50 verify-ms=200 log-ms=0",
            &dir.path().join("s"),
        );
        let h = src.handle();
        assert_eq!(
            (h.status().vcpus, h.status().vcpu_threads),
            (n, usize::from(n))
        );
        h.pause().unwrap();
        assert_eq!(h.state(), RunState::Paused);
        let (cpu, written) = (h.vcpu_cpu_ns(), h.telemetry().pages_written);
        std::thread::sleep(Duration::from_millis(300));
        let spent = h.vcpu_cpu_ns() - cpu;
        assert!(
            spent < 20_000_000,
            "{n} vCPUs paused used {spent} ns of CPU in 300 ms"
        );
        assert_eq!(
            h.telemetry().pages_written,
            written,
            "nothing written while paused"
        );
        let paused = h.telemetry();
        h.resume().unwrap();
        src.wait_for(
            "writes on every vCPU after resume",
            Duration::from_secs(10),
            |g| {
                g.vcpus
                    .iter()
                    .zip(&paused.vcpus)
                    .all(|(v, p)| v.pages_written > p.pages_written)
            },
        );
        drop(src);
        assert_eq!(h.state(), RunState::Stopped, "{n} vCPUs: the VM stopped");
        assert_eq!(h.status().vcpu_threads, 0, "no vCPU thread is left");
    }
}

/// Every vCPU of the source has run its share and verified it once.
fn every_vcpu_verified(g: &ferry_vmm::devices::telemetry::GuestTelemetry, n: u8) -> bool {
    g.vcpus.len() == usize::from(n) && g.vcpus.iter().all(|v| v.verify_passes >= 1)
}

#[test]
fn every_vcpu_s_state_migrates_and_the_guest_verifies_clean() {
    for n in [1, 4, 16] {
        require_kvm();
        let dir = tempfile::tempdir().unwrap();
        let src = boot_verified(
            n,
            "ws=64M rate=20 pattern=random read=20 verify-ms=200 log-ms=0",
            &dir.path().join("s"),
        );
        let (dst, progress) = migrate_forced(&src, n, &dir.path().join("d"));
        assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
        let status = dst.handle().status();
        assert_eq!((status.vcpus, status.vcpu_threads), (n, usize::from(n)));
        let after = verifies_clean(&dst, 2);
        // Every vCPU's TSC and the VM's kvmclock continue from where they stopped: each
        // vCPU's clock never went back (a verify failure if it had) and did not leap forward
        // across the pause (its longest batch, pause included, is far below a leap).
        for v in &after.vcpus {
            assert!(
                v.max_batch_ns < 2_000_000_000,
                "{n} vCPUs: vCPU {}'s clock leapt {} ms across the migration",
                v.vcpu,
                v.max_batch_ns / 1_000_000
            );
        }
    }
}

/// With `shared=1` every vCPU writes every page, each its own word: a byte changed in vCPU 2's
/// word of a page is found by vCPU 2 alone, naming the page; and such a guest migrates with
/// every vCPU verifying clean.
#[test]
fn vcpus_sharing_pages_check_their_own_words_and_migrate_clean() {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    // A sweep of 4096 pages at 1 MB/s takes ~16 s: a page half a sweep ahead of vCPU 2's
    // writer stays as the test left it for several verify passes.
    let src = boot_verified(
        4,
        "ws=16M rate=1 shared=1 verify-ms=100 log-ms=0",
        &dir.path().join("s"),
    );
    let g = src.handle().telemetry();
    assert_eq!(g.verify_failures, 0);
    let pages = g.config.as_ref().unwrap().working_set_pages;
    let layout = g.layout.clone().expect("layout report");
    let vcpu2 = &g.vcpus[2];
    // vCPU 2 started at page pages * 2 / 4 and writes sequentially.
    let victim = (pages / 2 + vcpu2.pages_written + pages / 2) % pages;
    let gpa = layout.page_gpa(victim).unwrap();
    src.handle().ram().write(gpa + 2 * 8 + 3, &[0x5a]).unwrap();
    let g = src.wait_for("a failed verify pass", Duration::from_secs(30), |g| {
        g.verify_failures >= 1
    });
    let failed = g.first_failed_verify.expect("the failed pass");
    assert_eq!(
        (failed.vcpu, failed.bad_pages, failed.first_bad_pfns),
        (2, 1, vec![gpa / 4096]),
        "vCPU 2 found exactly its word's page"
    );
    for v in g.vcpus.iter().filter(|v| v.vcpu != 2) {
        assert_eq!(v.verify_failures, 0, "vCPU {}'s words are intact", v.vcpu);
    }
    drop(src);

    let src = boot_verified(
        4,
        "ws=32M rate=10 pattern=random shared=1 verify-ms=200 log-ms=0",
        &dir.path().join("s2"),
    );
    let (dst, _) = migrate_forced(&src, 4, &dir.path().join("d"));
    verifies_clean(&dst, 2);
}

#[test]
fn a_fault_on_one_vcpu_stops_the_vm_naming_that_vcpu() {
    let dir = tempfile::tempdir().unwrap();
    let src = boot_config(with_vcpus(
        4,
        "ws=16M rate=20 log-ms=0 fault-after-ms=300 fault-vcpu=2",
        &dir.path().join("s"),
    ));
    let h = src.handle();
    let reason = h
        .wait_stopped(Some(Duration::from_secs(60)))
        .expect("the fault stops the VM");
    let text = reason.to_string();
    assert!(
        text.contains("exception 6 on vCPU 2"),
        "the stop names the vCPU: {text}"
    );
    assert_eq!(h.telemetry().exception.map(|e| e.vcpu), Some(2));
}

/// A destination that cannot take the guest (another vCPU count, no balloon) refuses it at the
/// handshake: the source never pauses, keeps running, and is told the flag that fixes it; the
/// destination goes on waiting for a source it can take.
#[test]
fn a_destination_configured_differently_is_refused_before_the_source_pauses() {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    let src = boot_config(with_vcpus(
        4,
        "ws=64M rate=50 verify-ms=200 log-ms=0",
        &dir.path().join("s"),
    ));
    src.wait_for("a verify pass", Duration::from_secs(60), |g| {
        g.verify_passes >= 1
    });
    let mismatches = [
        (
            with_vcpus(2, "", &dir.path().join("d1")),
            "start the destination with --vcpus 4",
        ),
        (
            VmConfig {
                balloon: false,
                dirty_ring: None,
                ..with_vcpus(4, "", &dir.path().join("d2"))
            },
            "start the destination with --balloon on",
        ),
    ];
    for (config, fix) in mismatches {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut incoming = Vm::incoming(config).unwrap();
        let req = MigrationRequest::to(listener.local_addr().unwrap().to_string());
        let source_ended = AtomicBool::new(false);
        let (received, progress) = std::thread::scope(|s| {
            let (incoming, listener, ended) = (&mut incoming, &listener, &source_ended);
            let r = s.spawn(move || {
                migration::receive(incoming, listener, &|| !ended.load(Ordering::Acquire))
            });
            src.handle().start_migration(req).unwrap();
            let progress = wait_migration(&src.handle(), Duration::from_secs(30));
            source_ended.store(true, Ordering::Release);
            (r.join().unwrap(), progress)
        });
        assert!(received.is_err(), "no guest arrived on the destination");
        assert_eq!(progress.phase, Phase::Failed, "{progress:?}");
        let error = progress.error.unwrap_or_default();
        assert!(error.contains(fix), "source: {error}");
        assert!(
            progress.stats.as_ref().is_some_and(|s| s.passes.is_empty()),
            "nothing was sent: {:?}",
            progress.stats
        );
        assert_eq!(
            src.handle().state(),
            RunState::Running,
            "the source never paused"
        );
    }
    let before = src.handle().telemetry().pages_written;
    src.wait_for("the guest writing on", Duration::from_secs(10), |g| {
        g.pages_written > before
    });
}
