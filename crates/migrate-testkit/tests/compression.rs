//! Page compression (`--compression`) over the fake VMM on real TCP loopback, without
//! /dev/kvm: whole migrations with compressed records land every page right whichever way the
//! destination lands them, `auto` tries both ways and loses nothing, and the destination refuses a
//! compressed record it did not agree to or whose frame is not its pages.

use std::time::Duration;

use ferry_migrate::wire::{Capabilities, Header, Kind};
use ferry_migrate::{Compression, Control, PageLanding, Policy, SourceParams, TimeoutAction};
use ferry_migrate_testkit::craft::{cat, data_hello, main_hello, main_hello_asking, record};
use ferry_migrate_testkit::loopback::{feed, migrate};
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;

fn params(compression: Compression, max_bandwidth: Option<u64>) -> SourceParams {
    let policy = Policy {
        downtime_limit: Duration::from_millis(30),
        timeout: Some(Duration::from_secs(2)),
        timeout_action: TimeoutAction::Switchover,
        ..Policy::default()
    };
    SourceParams {
        channels: 2,
        packet_pages: 32,
        compression,
        max_bandwidth,
        ..SourceParams::new(policy, [5; 16])
    }
}

#[test]
fn compressed_pages_land_exactly_while_the_guest_writes() {
    for landing in [PageLanding::Mapping, PageLanding::File] {
        let mut src = FakeVm::new(16 * MIB, 2);
        src.fill(1);
        src.start_writers(Writers {
            threads: 2,
            seed: 11,
            zero_percent: 20,
            interval: Duration::from_micros(50),
        });
        let mut dst = FakeVm::new(16 * MIB, 2);
        dst.landing = landing;
        let p = params(Compression::Zstd { level: 3 }, None);
        let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
        let stats = sent.unwrap();
        let received = received.unwrap();
        assert!(
            src.contents() == dst.contents(),
            "{landing:?}: memory differs"
        );
        let c = stats.compression.expect("compression statistics");
        assert!(c.records_compressed > 0, "{landing:?}: {c:?}");
        assert_eq!(received.compressed_records, c.records_compressed);
        assert!(
            c.bytes_out * 4 < c.bytes_in,
            "{landing:?}: mostly-zero pages compress: {c:?}"
        );
        assert!(c.cpu_seconds > 0.0 && received.decompress_cpu_ns > 0);
        // The wire carried fewer bytes than the data pages hold.
        assert!(stats.bytes_sent < stats.pages_normal * 4096, "{stats:?}");
    }
}

/// A migration under a bandwidth limit still compresses its first pass. (How the limit counts
/// a compressed page is `compress.rs`'s `WireShare` unit test; this checks no pacing time.)
#[test]
fn a_limited_migration_sends_its_first_pass_compressed() {
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(1);
    let mut dst = FakeVm::new(16 * MIB, 1);
    let p = params(Compression::Zstd { level: 1 }, Some(4_000_000));
    let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert!(src.contents() == dst.contents());
    let pass1 = &stats.passes[0];
    assert!(
        pass1.bytes * 4 < pass1.pages * 4096,
        "pass 1 sent {} bytes for {} pages",
        pass1.bytes,
        pass1.pages
    );
}

/// `auto` decides batch by batch and lands every page either way; which way wins here
/// depends on how fast this build's destination takes pages (its choice against the rates is
/// `compress.rs`'s unit test, its speed `ferry bench compression`'s).
#[test]
fn auto_tries_both_ways_and_lands_every_page() {
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(1);
    let mut dst = FakeVm::new(16 * MIB, 1);
    let p = params(Compression::Auto { level: 1 }, None);
    let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert!(src.contents() == dst.contents());
    let c = stats.compression.expect("compression statistics");
    // One batch in 16 goes the way the estimates do not pick, to keep them current.
    assert!(
        c.records_raw > 0 && c.records_compressed > 0,
        "auto did not try both ways: {c:?}"
    );
}

/// A CompressedPages record of the pages at `gpas`, `count` of them, whose frame holds `data`.
fn compressed(gpas: &[u64], count: u32, data: &[u8]) -> Vec<u8> {
    let mut payload: Vec<u8> = gpas.iter().flat_map(|a| a.to_le_bytes()).collect();
    payload.extend(zstd::bulk::compress(data, 1).unwrap());
    record(
        Header::new(Kind::CompressedPages, count, payload.len() as u64),
        &payload,
    )
}

#[test]
fn a_compressed_record_not_agreed_or_not_its_pages_is_refused() {
    let page = vec![0x5a; 4096];
    let asking = main_hello_asking(Capabilities::COMPRESS);
    let table = [
        (
            "without the capability",
            main_hello(),
            compressed(&[0x1000], 1, &page),
            "without the compress capability",
        ),
        (
            "a frame one page short",
            asking.clone(),
            compressed(&[0x1000, 0x2000], 2, &page),
            "decodes to 4096 bytes, not the 8192 of its 2 pages",
        ),
        (
            "a frame one page long",
            asking.clone(),
            compressed(&[0x1000], 1, &[page.clone(), page.clone()].concat()),
            "a compressed record of 1 pages is malformed",
        ),
        (
            "no frame at all",
            asking.clone(),
            record(
                Header::new(Kind::CompressedPages, 1, 8),
                &0x1000u64.to_le_bytes(),
            ),
            "is 8 bytes: no room for a frame",
        ),
    ];
    for landing in [PageLanding::Mapping, PageLanding::File] {
        for (name, main, data, want) in &table {
            let err = feed(main, &[cat(&[data_hello(1), data.clone()])], landing);
            assert!(err.contains(want), "{name}, {landing:?}: got '{err}'");
        }
    }
}
