//! A bandwidth cap limits the bytes the link carries, as it says: a zero page costs the few
//! bytes of its run, not 4 KiB, and pages with data go no faster than the cap on average.

use ferry_migrate::source::SourceParams;
use ferry_migrate::{Control, Policy};
use ferry_migrate_testkit::FakeVm;
use ferry_migrate_testkit::loopback::migrate;

const MIB: u64 = 1 << 20;

fn capped(rate: u64) -> SourceParams {
    SourceParams {
        max_bandwidth: Some(rate),
        ..SourceParams::new(Policy::default(), [0x5a; 16])
    }
}

/// 64 MiB of populated zeros under a 2 MB/s cap: charged 4 KiB a page, pass 1 alone would take
/// 33 s; charged what the link carries, the migration takes what the senders take to scan.
#[test]
fn a_cap_charges_a_zero_page_what_it_costs_on_the_wire() {
    let size = 64 * MIB;
    let mut src = FakeVm::new(size, 1);
    src.write(0, &vec![0u8; size as usize]).unwrap();
    let mut dst = FakeVm::new(size, 1);
    let (sent, received) = migrate(&mut src, &mut dst, &capped(2_000_000), &Control::default());
    let stats = sent.expect("the capped migration of zeros");
    received.expect("the destination's side");
    assert!(
        stats.pages_zero >= size / 4096,
        "every page went as a zero page: {}",
        stats.pages_zero
    );
    // At the cap, 4 KiB a page would be 33.5 s; a quarter of that would already mean the cap
    // charged far more than the link carried.
    assert!(
        stats.total_ms < 8_000.0,
        "{:.0} ms for {} bytes on the wire under a 2 MB/s cap",
        stats.total_ms,
        stats.bytes_sent
    );
    assert_eq!(src.contents(), dst.contents());
}

/// 16 MiB of data under an 8 MB/s cap: the average rate stays at the cap (give or take the
/// batch being handed over when the limiter is asked).
#[test]
fn a_capped_migration_of_data_keeps_to_the_cap_on_average() {
    let size = 16 * MIB;
    let cap = 8_000_000u64;
    let mut src = FakeVm::new(size, 2);
    src.fill(1);
    let mut dst = FakeVm::new(size, 2);
    let (sent, received) = migrate(&mut src, &mut dst, &capped(cap), &Control::default());
    let stats = sent.expect("the capped migration");
    received.expect("the destination's side");
    let rate = stats.bytes_sent as f64 / (stats.total_ms / 1000.0);
    assert!(
        rate <= cap as f64 * 1.25,
        "{:.1} MB/s on average under an {} MB/s cap ({} bytes in {:.0} ms)",
        rate / 1e6,
        cap / 1_000_000,
        stats.bytes_sent,
        stats.total_ms
    );
    assert_eq!(src.contents(), dst.contents());
}
