//! Iterative device state over the fake VMM, without /dev/kvm: a 256 MiB device whose blocks
//! change while precopy runs goes in chunks beside guest RAM, its pending bytes shown in
//! progress and counted by the policy, and arrives whole; a destination that cannot take
//! chunks leaves the source running with nothing lost.

use std::time::Duration;

use ferry_migrate::source::SourceParams;
use ferry_migrate::{Control, Policy};
use ferry_migrate_testkit::loopback::migrate;
use ferry_migrate_testkit::{FakeVm, Writers, watching};

const MIB: u64 = 1 << 20;

fn params() -> SourceParams {
    SourceParams {
        channels: 2,
        ..SourceParams::new(
            Policy {
                timeout: Some(Duration::from_secs(60)),
                timeout_action: ferry_migrate::TimeoutAction::Switchover,
                ..Policy::default()
            },
            [0x1e; 16],
        )
    }
}

/// A source with 32 MiB of RAM that a writer changes and a disk of `disk_mib` whose blocks
/// another writer rewrites, one every 20 ms (13 MB/s of changed blocks: precopy converges).
fn source(disk_mib: u64) -> FakeVm {
    let mut src = FakeVm::new(32 * MIB, 2);
    src.fill(5);
    src.add_disk(disk_mib * MIB);
    src.start_disk_writer(0xd15c, Duration::from_millis(20));
    src.start_writers(Writers {
        threads: 1,
        seed: 0x17e,
        zero_percent: 10,
        interval: Duration::from_millis(1),
    });
    src
}

#[test]
fn a_device_s_large_state_that_changes_during_precopy_arrives_whole() {
    let mut src = source(256);
    let mut dst = FakeVm::new(32 * MIB, 2);
    dst.add_disk(256 * MIB);
    let control = Control::default();
    let (seen, (sent, received)) = watching(&control, || {
        migrate(&mut src, &mut dst, &params(), &control)
    });
    let stats = sent.expect("the source's side");
    let received = received.expect("the destination's side");
    assert!(src.is_paused() && dst.resumed, "the guest moved");
    let (from, to) = (src.disk.as_ref().unwrap(), dst.disk.as_ref().unwrap());
    assert!(from.contents() == to.contents(), "the disk differs");
    assert!(src.contents() == dst.contents(), "memory differs");
    // Every block went once, and the blocks the writer changed after theirs went again.
    let blocks = 256 * MIB / ferry_migrate_testkit::disk::BLOCK as u64;
    assert!(stats.state_chunks > blocks, "{stats:?}");
    assert_eq!(received.state_chunks, stats.state_chunks);
    assert_eq!(received.state_chunk_bytes, stats.state_chunk_bytes);
    assert!(
        seen.iter().any(|p| p.state_remaining_bytes > 0),
        "progress showed the device's pending bytes"
    );
    assert!(
        seen.iter()
            .all(|p| p.state_remaining_bytes <= p.remaining_bytes),
        "the device's pending bytes are part of what is left"
    );
    // The bandwidth times the 300 ms downtime limit: more than nothing, less than a 100 GB/s
    // link would carry.
    let allowance = from.allowance();
    assert!(
        allowance > 0 && allowance < 30_000_000_000,
        "the engine told the device what the pause could carry: {allowance}"
    );
}

/// The switchover waits for the destination's devices (QEMU's switchover-ack): with the disk
/// held not ready, a migration that would fit stays in precopy, and completes once released.
/// The destination asks its device again at every pass end, so a release is seen even when
/// no chunk follows it.
#[test]
fn the_switchover_waits_until_the_destination_s_device_is_ready() {
    let mut src = source(16);
    let mut dst = FakeVm::new(32 * MIB, 2);
    let disk = dst.add_disk(16 * MIB);
    disk.hold_ready();
    let control = Control::default();
    let held_through = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            // Once pass 1 (every block once) ended, precopy would fit soon: hold it a while.
            while control.progress().pass < 2 && control.progress().phase.is_active() {
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_millis(500));
            let phase = control.progress().phase;
            disk.release_ready();
            phase
        });
        let (sent, received) = migrate(&mut src, &mut dst, &params(), &control);
        sent.expect("the source's side");
        received.expect("the destination's side");
        watcher.join().unwrap()
    });
    assert_eq!(
        held_through,
        ferry_migrate::Phase::Precopy,
        "paused before ready"
    );
    assert!(src.disk.as_ref().unwrap().contents() == dst.disk.as_ref().unwrap().contents());
}

/// A destination whose VMM takes no chunks does not grant the capability; the source's VM
/// then cannot save its disk in the pause, and says so: the migration fails, the guest runs on
/// here, and nothing is lost.
#[test]
fn a_destination_without_the_device_leaves_the_source_running() {
    // Larger than the fake saves as sections in the pause.
    let mut src = source(64);
    let mut dst = FakeVm::new(32 * MIB, 2);
    let (sent, _) = migrate(&mut src, &mut dst, &params(), &Control::default());
    let e = sent.expect_err("the disk cannot go");
    assert!(e.to_string().contains("iterative state"), "{e}");
    assert!(!src.is_paused(), "the guest runs on");
    assert!(!dst.resumed);
}
