//! The telemetry record's decoding and counters ([`super::GuestTelemetry`]).

use super::*;

fn heartbeat(seq: u64, pages: u64) -> Report {
    Report {
        kind: Kind::Heartbeat as u16,
        seq,
        pages_written: pages,
        ..Report::default()
    }
}

#[test]
fn rate_gaps_and_losses() {
    let mut t = GuestTelemetry::default();
    t.record(&heartbeat(0, 0), 1_000_000_000);
    t.record(&heartbeat(1, 1_000_000), 1_100_000_000);
    t.record(&heartbeat(3, 3_000_000), 1_400_000_000);
    assert_eq!(t.heartbeats, 3);
    assert_eq!(t.lost_reports, 1);
    assert_eq!(t.max_report_gap_ns, 300_000_000);
    assert!(
        (t.write_rate_pages_per_s - 7_500_000.0).abs() < 1.0,
        "{}",
        t.write_rate_pages_per_s
    );
}

#[test]
fn no_rate_from_two_vcpus_reports_microseconds_apart() {
    let mut t = GuestTelemetry::default();
    let mut second = heartbeat(0, 1_000_000);
    second.vcpu = 1;
    t.record(&heartbeat(0, 10), 1_000_000_000);
    // vCPU 1's first report, 10 µs later, brings the million pages it wrote since boot.
    t.record(&second, 1_000_010_000);
    assert_eq!(t.write_rate_pages_per_s, 0.0, "no rate over 10 µs");
    t.record(&heartbeat(1, 20), 1_300_000_000);
    assert!(t.write_rate_pages_per_s > 0.0, "a rate once 300 ms passed");
}

#[test]
fn stale_counters_do_not_regress() {
    let mut t = GuestTelemetry::default();
    t.record(&heartbeat(5, 500), 10);
    t.record(&heartbeat(4, 400), 20);
    assert_eq!(t.pages_written, 500);
}

#[test]
fn verify_failures_keep_the_first_and_the_pages() {
    let mut t = GuestTelemetry::default();
    let mut detail = [0u64; report::DETAIL_WORDS];
    detail[report::verify::PASS] = 2;
    detail[report::verify::BAD_PAGES] = 1;
    detail[report::verify::LISTED] = 1;
    detail[report::verify::FIRST_BAD] = 0x1234;
    let r = Report {
        kind: Kind::Verify as u16,
        verify_passes: 2,
        verify_failures: 1,
        detail,
        ..Report::default()
    };
    t.record_bytes(&r.to_bytes(), 7).unwrap();
    assert_eq!(t.verify_failures, 1);
    assert_eq!(
        t.first_failed_verify.as_ref().unwrap().first_bad_pfns,
        vec![0x1234]
    );
    assert!(t.record_bytes(&[0; REPORT_SIZE], 8).is_err());
    assert_eq!(t.invalid_reports, 1);
}

#[test]
fn state_round_trips_counters_and_config() {
    let mut t = GuestTelemetry::default();
    let mut detail = [0u64; report::DETAIL_WORDS];
    detail[report::boot::WS_PAGES] = 77;
    let boot = Report {
        kind: Kind::Boot as u16,
        detail,
        ..Report::default()
    };
    t.record_bytes(&boot.to_bytes(), 5).unwrap();
    t.record(&heartbeat(1, 1000), 10);
    let back = GuestTelemetry::decode_state(&t.encode_state()).unwrap();
    assert_eq!(back.pages_written, 1000);
    assert_eq!(back.heartbeats, 1);
    assert_eq!(back.last_report_host_ns, Some(10));
    assert_eq!(back.config.clone().unwrap().working_set_pages, 77);
    assert_eq!(back.vcpus.len(), 1);
    let mut back = back;
    back.record(&heartbeat(2, 2000), 110);
    assert_eq!(
        back.migration_pause_ns,
        Some(100),
        "first report after the migration"
    );
    assert_eq!(back.migration_resumed_host_ns, Some(110));
    back.record(&heartbeat(3, 3000), 500);
    assert_eq!(
        back.migration_pause_ns,
        Some(100),
        "only the first gap counts"
    );
    assert_eq!(back.migration_resumed_host_ns, Some(110));
    assert!(GuestTelemetry::decode_state(&[0; 7]).is_err());
}

#[test]
fn each_vcpu_counts_its_own_and_the_guest_sums_them() {
    let mut t = GuestTelemetry::default();
    for (vcpu, seq, pages) in [(0, 0, 100), (3, 0, 30), (3, 2, 50), (0, 1, 120)] {
        let mut r = heartbeat(seq, pages);
        r.vcpu = vcpu;
        t.record(&r, 10 + seq);
    }
    assert_eq!(t.pages_written, 170);
    assert_eq!(t.heartbeats, 4);
    assert_eq!(t.lost_reports, 1, "vCPU 3 skipped its report 1");
    assert_eq!(
        t.vcpus.iter().map(|v| v.vcpu).collect::<Vec<_>>(),
        vec![0, 3]
    );
    let back = GuestTelemetry::decode_state(&t.encode_state()).unwrap();
    assert_eq!(back.vcpus[1].pages_written, 50);
    assert_eq!(back.pages_written, 170);
    let mut bad = t.encode_state();
    bad[8 * STATE_WORDS..8 * STATE_WORDS + 8].copy_from_slice(&5u64.to_le_bytes());
    assert!(
        GuestTelemetry::decode_state(&bad).is_err(),
        "vCPU 5 before vCPU 3"
    );
    let mut bad = t.encode_state();
    bad[8 * STATE_WORDS..8 * STATE_WORDS + 8].copy_from_slice(&256u64.to_le_bytes());
    assert!(GuestTelemetry::decode_state(&bad).is_err(), "vCPU 256");
    let mut stray = heartbeat(9, 1);
    stray.vcpu = 64;
    assert!(t.record_bytes(&stray.to_bytes(), 99).is_err());
    assert_eq!(
        (t.invalid_reports, t.vcpus.len()),
        (1, 2),
        "a report from vCPU 64 is refused"
    );
}

#[test]
fn layout_maps_indices_across_extents() {
    let l = GuestLayout {
        extents: vec![(0x200, 10), (0x100000, 5)],
        record_gpa: 0,
    };
    assert_eq!(l.page_gpa(0), Some(0x200 * 4096));
    assert_eq!(l.page_gpa(12), Some((0x100000 + 2) * 4096));
    assert_eq!(l.page_gpa(15), None);
}
