//! Guest RAM on 2 MiB huge pages (`ferry run --hugepages`), on real KVM: the guest runs and
//! verifies clean, precopy and postcopy (whole 2 MiB pages, with and without the preempt
//! connection) migrate it into a huge-page destination, and a short pool is an error that names
//! the fix.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{config, receive_from, require_kvm, verifies_clean, wait_for_telemetry};
use ferry_migrate::source::Preempt;
use ferry_migrate::{Phase, TimeoutAction};
use ferry_vmm::memory::{HostPages, HugePagePool};
use ferry_vmm::migration::MigrationRequest;
use ferry_vmm::request::{MigrationMode, PostcopyRequest};
use ferry_vmm::{Vm, VmConfig};

const MIB: u64 = 1 << 20;
const MEMORY: u64 = 256 * MIB;
/// Raises the host's huge page pool by `pages` for the test's life.
fn reserve(pages: u64) -> HugePagePool {
    HugePagePool::reserve_more(pages).unwrap_or_else(|e| panic!("cannot reserve huge pages: {e}"))
}

fn huge(cmdline: &str, serial: &std::path::Path) -> VmConfig {
    VmConfig {
        balloon: true,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: HostPages::Huge2M,
        ..config(MEMORY, cmdline, serial)
    }
}

fn request(listener: &TcpListener, postcopy: bool) -> MigrationRequest {
    MigrationRequest {
        downtime_limit_ms: 300,
        timeout_ms: Some(60_000),
        timeout_action: TimeoutAction::Cancel,
        mode: if postcopy {
            MigrationMode::Postcopy(PostcopyRequest {
                after_passes: Some(1),
                ..PostcopyRequest::default()
            })
        } else {
            MigrationMode::Precopy
        },
        ..MigrationRequest::to(listener.local_addr().unwrap().to_string())
    }
}

/// Tests of this file that raise the pool take turns, so that each restores what it found.
static POOL_USERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Boots a huge-page guest that dirties `ws` at `rate` and waits for its first clean verify.
fn huge_source(cmdline: &str, dir: &std::path::Path) -> Vm {
    let src = Vm::boot(huge(cmdline, &dir.join("src.log"))).expect("boot on huge pages");
    let sh = src.handle();
    assert_eq!(sh.ram().host_pages(), HostPages::Huge2M);
    let before = wait_for_telemetry(&sh, "a clean verify pass", Duration::from_secs(60), |g| {
        g.verify_passes >= 1
    });
    assert_eq!(before.verify_failures, 0);
    src
}

#[test]
fn a_huge_page_guest_migrates_by_precopy() {
    require_kvm();
    let _turn = POOL_USERS.lock().unwrap_or_else(|e| e.into_inner());
    let _pool = reserve(2 * MEMORY / (2 * MIB) + 8);
    let dir = tempfile::tempdir().unwrap();
    let src = huge_source(
        "ws=64M pattern=random rate=100 verify-ms=200 log-ms=0",
        dir.path(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(huge("", &dir.path().join("dst.log"))).unwrap();
    let (received, progress) = receive_from(
        &src.handle(),
        &mut incoming,
        &listener,
        request(&listener, false),
    );
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let dst = incoming.into_running().expect("resumed");
    verifies_clean(&dst, 2);
    assert_eq!(dst.handle().ram().host_pages(), HostPages::Huge2M);
}

#[test]
fn a_huge_page_guest_migrates_by_postcopy_in_whole_huge_pages() {
    require_kvm();
    let _turn = POOL_USERS.lock().unwrap_or_else(|e| e.into_inner());
    let _pool = reserve(2 * MEMORY / (2 * MIB) + 8);
    for (channels, preempt) in [(1, false), (4, true)] {
        let dir = tempfile::tempdir().unwrap();
        let src = huge_source(
            "ws=128M pattern=random read=30 rate=max verify-ms=200 log-ms=0",
            dir.path(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut incoming = Vm::incoming(huge("", &dir.path().join("dst.log"))).unwrap();
        let mut req = request(&listener, true);
        req.channels = channels;
        if let MigrationMode::Postcopy(p) = &mut req.mode
            && preempt
        {
            p.preempt = Preempt::Urgent;
        }
        let (received, progress) = receive_from(&src.handle(), &mut incoming, &listener, req);
        let received =
            received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
        assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
        let stats = progress.stats.expect("statistics");
        let pc = stats.postcopy.clone().expect("switched to postcopy");
        assert!(
            pc.discarded_pages > 0,
            "a flat-out guest leaves dirty pages"
        );
        assert_eq!(
            pc.discarded_pages % 512,
            0,
            "discards are whole 2 MiB pages: {pc:?}"
        );
        assert_eq!(pc.pages_background + pc.pages_requested, pc.discarded_pages);
        let here = received.postcopy.expect("postcopy on the destination");
        let dst = incoming.into_running().expect("resumed");
        let after = verifies_clean(&dst, 3);
        eprintln!(
            "postcopy on 2 MiB pages, {channels} channel(s), preempt {preempt}: downtime {:.1} ms, postcopy {:.0} ms, {} pages discarded, {} requested in {} requests ({} resent), {} faults; fault to page mean {:.0} µs, p99 {} µs, max {} µs; the guest's longest write batch {:.1} ms",
            stats.downtime.total_ms,
            pc.duration_ms,
            pc.discarded_pages,
            pc.pages_requested,
            pc.requests,
            pc.pages_resent,
            here.faults,
            here.latencies.mean_us(),
            here.latencies.quantile_us(0.99),
            here.latencies.max_us,
            after.max_batch_ns as f64 / 1e6,
        );
    }
}

#[test]
fn a_short_huge_page_pool_is_an_error_that_names_the_fix() {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    // 64 GiB of huge pages is more than this host's pool and memory.
    let e = match Vm::boot(VmConfig {
        memory_bytes: 64 << 30,
        ..huge("", &dir.path().join("serial.log"))
    }) {
        Ok(_) => panic!("a pool too short for the guest is refused"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("reserve 32768 more") && e.contains("nr_hugepages"),
        "{e}"
    );
}
