//! The engine over a dirty log that starts all set (KVM's `KVM_DIRTY_LOG_INITIALLY_SET`,
//! modelled by `AllSetVm`): pass 1 arms each slice that holds data before it reads it, so no
//! write is lost and nothing is sent twice for the log's start; slices it never armed cost
//! nothing unless the guest populated them.

use std::time::Duration;

use ferry_migrate::source::SourceParams;
use ferry_migrate::{Control, Policy, TimeoutAction};
use ferry_migrate_testkit::all_set::AllSetVm;
use ferry_migrate_testkit::loopback::migrate;
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;
/// Pages of a MiB.
const PAGES_PER_MIB: u64 = MIB / 4096;

fn params() -> SourceParams {
    let policy = Policy {
        downtime_limit: Duration::from_millis(20),
        timeout: Some(Duration::from_secs(1)),
        timeout_action: TimeoutAction::Switchover,
        ..Policy::default()
    };
    SourceParams::new(policy, [5; 16])
}

/// Writers run through pass 1 over two regions of 68 MiB (the second starting off the
/// 64 MiB grid pass 1 arms in): the destination ends equal to the source, every slice pass 1
/// read was armed first, and no fetch resent a page for the log's start.
#[test]
fn a_log_started_all_set_loses_no_write() {
    let size = 136 * MIB;
    let mut inner = FakeVm::new(size, 2);
    inner.fill(7);
    inner.start_writers(Writers {
        threads: 2,
        seed: 52,
        zero_percent: 10,
        interval: Duration::from_micros(50),
    });
    let mut src = AllSetVm::new(inner);
    let mut dst = FakeVm::new(size, 2);
    let (sent, received) = migrate(&mut src, &mut dst, &params(), &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    // Slices of 64 MiB that hold data: two in each region.
    assert_eq!(src.arms, 4, "{stats:?}");
    assert_eq!(
        src.reported_unarmed, 0,
        "pass 1 armed all it read, so the first fetch had nothing unarmed to report"
    );
    assert!(
        src.vm.contents() == dst.contents(),
        "memory differs after {} passes",
        stats.passes.len()
    );
}

/// 256 MiB with 1 MiB populated at each end: pass 1 arms the two slices that hold it and no
/// other, the first fetch arms the 128 MiB between and finds nothing populated there, and
/// only the 2 MiB travel.
#[test]
fn never_touched_slices_cost_nothing_when_the_log_starts_all_set() {
    let size = 256 * MIB;
    let inner = FakeVm::new(size, 1);
    let page = vec![0xa5u8; MIB as usize];
    inner.write(0, &page).unwrap();
    inner.write(size - MIB, &page).unwrap();
    let mut src = AllSetVm::new(inner);
    let mut dst = FakeVm::new(size, 1);
    let (sent, received) = migrate(&mut src, &mut dst, &params(), &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert_eq!(src.arms, 2);
    assert_eq!(src.reported_unarmed, 0);
    assert_eq!(
        stats.pages_normal + stats.pages_zero,
        2 * PAGES_PER_MIB,
        "{stats:?}"
    );
    assert!(src.vm.contents() == dst.contents());
}

/// A page populated in a slice pass 1 never armed (it was a hole then) is reported by the
/// next fetch, which cannot tell when it was written; once armed there, a write is logged.
#[test]
fn a_page_populated_where_nothing_was_armed_is_reported() {
    use ferry_migrate::SourceVm;
    use ferry_migrate::bitmap::DirtyBitmap;
    let size = 128 * MIB;
    let mut src = AllSetVm::new(FakeVm::new(size, 1));
    src.start_dirty_log().unwrap();
    src.arm_dirty(0, 64 * MIB).unwrap();
    src.vm.write(100 * MIB, &[1; 8]).unwrap();
    let mut b = DirtyBitmap::new(&src.ram());
    src.fetch_dirty(&mut b).unwrap();
    assert_eq!((b.count(), src.reported_unarmed), (1, 1));
    src.vm.write(100 * MIB, &[2; 8]).unwrap();
    src.vm.write(MIB, &[2; 8]).unwrap();
    let mut b = DirtyBitmap::new(&src.ram());
    src.fetch_dirty(&mut b).unwrap();
    assert_eq!((b.count(), src.reported_unarmed), (2, 1), "both logged");
    src.stop_dirty_log();
}
