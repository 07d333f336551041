//! Postcopy between two VMs of this process over loopback TCP, on real KVM: the source
//! switches after pass 1 while its guest dirties its working set flat out, the destination's
//! vCPU faults on pages that have not arrived (userfaultfd), and the guest's own verify passes
//! stay clean on the destination.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{boot, config, receive_from, require_kvm, verifies_clean};
use ferry_migrate::source::Preempt;
use ferry_migrate::{Phase, TimeoutAction};
use ferry_vmm::migration::MigrationRequest;
use ferry_vmm::request::{MigrationMode, PostcopyRequest};
use ferry_vmm::{RunState, Vm};

const MIB: u64 = 1 << 20;

#[test]
fn postcopy_after_one_pass_with_a_flat_out_guest_verifies_clean_at_1_and_4_channels_with_and_without_preempt()
 {
    for (channels, preempt) in [(1, false), (4, false), (1, true), (4, true)] {
        let src = boot(
            512 * MIB,
            "ws=128M pattern=random read=30 rate=max verify-ms=200 log-ms=0",
        );
        let before = src.wait_for("a clean verify pass", Duration::from_secs(60), |g| {
            g.verify_passes >= 1
        });
        assert_eq!(before.verify_failures, 0);
        require_kvm();
        let dir = tempfile::tempdir().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut incoming =
            Vm::incoming(config(512 * MIB, "", &dir.path().join("serial.log"))).unwrap();
        let req = MigrationRequest {
            // No flat-out guest fits 1 ms: precopy never switches over by itself.
            downtime_limit_ms: 1,
            timeout_ms: Some(60_000),
            timeout_action: TimeoutAction::Cancel,
            channels,
            mode: MigrationMode::Postcopy(PostcopyRequest {
                after_passes: Some(1),
                preempt: Preempt::urgent_when(preempt),
                ..PostcopyRequest::default()
            }),
            ..MigrationRequest::to(listener.local_addr().unwrap().to_string())
        };
        let (received, progress) = receive_from(&src.handle(), &mut incoming, &listener, req);
        let received =
            received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
        assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
        assert_eq!(
            src.handle().state(),
            RunState::Paused,
            "the source ends paused"
        );
        let stats = progress.stats.expect("statistics");
        let pc = stats
            .postcopy
            .clone()
            .expect("the migration switched to postcopy");
        assert_eq!(pc.after_passes, 1);
        assert!(
            pc.discarded_pages > 0,
            "a flat-out guest leaves dirty pages: {pc:?}"
        );
        assert_eq!(pc.pages_background + pc.pages_requested, pc.discarded_pages);
        let here = received.postcopy.expect("postcopy on the destination");
        // Several channels land precopy's pages through the guest's mapping: postcopy then
        // runs over the memory held here (minor faults); one channel into sparse RAM writes
        // through the file, and postcopy punches and copies (missing faults).
        assert_eq!(here.over_held, channels > 1, "{here:?}");
        let dst = incoming.into_running().expect("resumed");
        let resumed = dst.handle().telemetry();
        let after = verifies_clean(&dst, 3);
        assert!(
            after.pages_written > resumed.pages_written,
            "the guest keeps writing"
        );
        eprintln!(
            "postcopy, {channels} channel(s), preempt {preempt}, over held memory {}: downtime {:.1} ms ({:?}), drain {:.0} ms, postcopy {:.0} ms, {} pages discarded, {} requested in {} requests, {} zero-filled here, {} faults; fault to page mean {:.0} µs, p50 {} µs, p99 {} µs, max {} µs; the guest's longest write batch {:.1} ms, {} batches over 1 ms",
            here.over_held,
            stats.downtime.total_ms,
            stats.downtime,
            stats.drain_ms,
            pc.duration_ms,
            pc.discarded_pages,
            pc.pages_requested,
            pc.requests,
            here.zero_fills,
            here.faults,
            here.latencies.mean_us(),
            here.latencies.quantile_us(0.5),
            here.latencies.quantile_us(0.99),
            here.latencies.max_us,
            after.max_batch_ns as f64 / 1e6,
            after.slow_batches
        );
    }
}
