//! A mapped restore on real KVM, with the built-in guest's balloon driver: the guest filled
//! and freed memory before its snapshot, so the file holds data where the guest's free blocks
//! are; the VM mapped from it reads no page, inflates and deflates its balloon through the
//! mapped discard (that a discarded page then reads as zeros, not as the file's, is
//! `memory/mapped.rs`'s unit test: the guest does not look), and its guest verifies clean
//! before, during and after; its snapshot is refused.

mod common;

use std::time::Duration;

use common::{boot, config, verifies_clean, wait_for_telemetry, wait_migration};
use ferry_migrate::Phase;
use ferry_migrate::snapshot::Loading;
use ferry_vmm::snapshot::SnapshotRequest;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const BLOCK: u64 = 2 * MIB;

#[test]
fn a_mapped_vm_reads_no_page_inflates_its_balloon_and_verifies_clean() {
    let src = boot(GIB, "ws=64M rate=20 free=512M verify-ms=300 log-ms=0");
    src.wait_for(
        "the free memory filled and a verify pass",
        Duration::from_secs(120),
        |g| g.free_memory.is_some_and(|f| f.blocks_free > 0) && g.verify_passes >= 1,
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let h = src.handle();
    h.start_snapshot(SnapshotRequest {
        to: file.clone(),
        stop: true,
        ..SnapshotRequest::default()
    })
    .unwrap();
    assert_eq!(
        wait_migration(&h, Duration::from_secs(120)).phase,
        Phase::Completed
    );
    drop(src);

    let what = ferry_vmm::snapshot::describe(&file).unwrap();
    let base = config(GIB, "", &dir.path().join("serial.log"));
    let (vm, restored) =
        ferry_vmm::snapshot::restore(what.config(&base), &file, Loading::Mapped, true).unwrap();
    assert!(restored.lazy.is_none());
    assert_eq!(
        restored.stats.bytes_read, 0,
        "a mapped restore reads no page"
    );
    verifies_clean(&vm, 1);

    let h = vm.handle();
    h.set_balloon_target(256 * MIB).unwrap();
    wait_for_telemetry(&h, "256 MiB in the balloon", Duration::from_secs(60), |g| {
        g.free_memory
            .is_some_and(|f| u64::from(f.blocks_ballooned) * BLOCK == 256 * MIB)
    });
    let b = h.balloon().unwrap();
    assert_eq!(b.discarded_pages, 256 * MIB / 4096, "{b:?}");
    verifies_clean(&vm, 2);
    h.set_balloon_target(0).unwrap();
    wait_for_telemetry(&h, "the balloon deflated", Duration::from_secs(60), |g| {
        g.free_memory.is_some_and(|f| f.blocks_ballooned == 0)
    });
    verifies_clean(&vm, 2);
    assert!(
        matches!(
            h.start_snapshot(SnapshotRequest {
                to: dir.path().join("again.snap"),
                ..SnapshotRequest::default()
            }),
            Err(ferry_vmm::migration::StartError::Mapped)
        ),
        "a mapped VM is not snapshotted"
    );
}
