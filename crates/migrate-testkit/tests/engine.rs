//! The migration engine over the fake VMM, on real TCP loopback, without /dev/kvm.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use ferry_migrate::destination::{self, ReceiveStats};
use ferry_migrate::source::{self, SourceParams};
use ferry_migrate::wire::{self, Header, Hello, Kind, Role, SectionId};
use ferry_migrate::{Control, MigrateError, MigrationStats, Phase, Policy, TimeoutAction};
use ferry_migrate_testkit::{FakeVm, Writers, gpa_of};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

/// Parameters with a 1 s timeout that forces the switchover: a fast fake writer may never let
/// precopy converge, and the properties tested here must hold either way.
fn params(downtime_ms: u64, max_bandwidth: Option<u64>) -> SourceParams {
    SourceParams {
        policy: Policy {
            downtime_limit: Duration::from_millis(downtime_ms),
            timeout: Some(Duration::from_secs(1)),
            timeout_action: TimeoutAction::Switchover,
        },
        max_bandwidth,
        uuid: [3; 16],
    }
}

/// Migrates `src` into `dst` over loopback; returns both sides' results.
fn migrate(
    src: &mut FakeVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    control: &Control,
) -> (
    Result<MigrationStats, MigrateError>,
    Result<ReceiveStats, MigrateError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let receiver = s.spawn(|| destination::receive(dst, listener.accept().unwrap().0));
        let sent = source::migrate(src, TcpStream::connect(addr).unwrap(), p, control);
        (sent, receiver.join().unwrap())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]

    /// Whatever the guest writes while precopy runs, the destination's memory equals the
    /// source's at switchover.
    #[test]
    fn destination_equals_source_at_switchover(
        mib in 4u64..24,
        regions in 1usize..3,
        threads in 0usize..3,
        seed in any::<u64>(),
        stride in 1u64..9,
        zero_percent in 0u8..50,
        downtime_ms in 1u64..200,
        limited in any::<bool>(),
    ) {
        let size = mib * MIB * regions as u64;
        let mut src = FakeVm::new(size, regions);
        src.fill(stride);
        src.start_writers(Writers { threads, seed, zero_percent, interval: Duration::from_micros(50) });
        let mut dst = FakeVm::new(size, regions);
        let limit = limited.then_some(200 * MIB);
        let (sent, received) = migrate(&mut src, &mut dst, &params(downtime_ms, limit), &Control::default());
        let stats = sent.unwrap();
        let received = received.unwrap();
        prop_assert!(src.is_paused(), "the source ends paused");
        prop_assert!(!src.is_logging(), "dirty logging is off afterwards");
        prop_assert!(dst.resumed);
        prop_assert_eq!(&dst.state, &src.state);
        prop_assert_eq!(received.pages + received.zero_pages, stats.pages_normal + stats.pages_zero);
        prop_assert!(src.contents() == dst.contents(), "memory differs after {} passes", stats.passes.len());
    }
}

/// Every pass rewrites the same pages: an older copy must never land after a newer one.
#[test]
fn pages_rewritten_every_pass_arrive_in_their_last_version() {
    let mut src = FakeVm::new(8 * MIB, 2);
    src.fill(1);
    src.start_writers(Writers {
        threads: 2,
        seed: 7,
        zero_percent: 30,
        interval: Duration::ZERO,
    });
    let mut dst = FakeVm::new(8 * MIB, 2);
    let (sent, received) = migrate(&mut src, &mut dst, &params(5, None), &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert!(stats.passes.len() >= 2, "{:?}", stats.passes);
    assert!(src.contents() == dst.contents());
}

#[test]
fn holes_are_neither_sent_nor_populated() {
    let mut src = FakeVm::new(64 * MIB, 2);
    src.fill(64);
    let mut dst = FakeVm::new(64 * MIB, 2);
    let (sent, received) = migrate(&mut src, &mut dst, &params(300, None), &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    let populated = 64 * MIB / 4096 / 64;
    assert_eq!(stats.pages_normal, populated);
    assert_eq!(stats.pages_skipped_holes, 64 * MIB / 4096 - populated);
    assert!(
        dst.allocated_bytes() <= 2 * populated * 4096 + MIB,
        "{}",
        dst.allocated_bytes()
    );
    assert!(src.contents() == dst.contents());
}

#[test]
fn cancel_leaves_the_source_running_and_a_second_migration_succeeds() {
    let mut src = FakeVm::new(32 * MIB, 1);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 1,
        zero_percent: 0,
        interval: Duration::from_micros(100),
    });
    let control = Control::default();
    let mut dst = FakeVm::new(32 * MIB, 1);
    let (sent, received) = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(150));
            control.cancel();
        });
        // 20 MB/s: the 32 MiB first pass takes well over the 150 ms before the cancel.
        migrate(&mut src, &mut dst, &params(300, Some(20_000_000)), &control)
    });
    assert!(matches!(sent, Err(MigrateError::Cancelled)), "{sent:?}");
    assert_eq!(control.progress().phase, Phase::Cancelled);
    let err = received.unwrap_err().to_string();
    assert!(
        err.contains("cancelled"),
        "the destination is told why: {err}"
    );
    assert!(!dst.resumed);
    assert!(!src.is_paused() && !src.is_logging());
    let before = src.writes();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        src.writes() > before,
        "the guest keeps running after a cancel"
    );

    let mut dst = FakeVm::new(32 * MIB, 1);
    let (sent, received) = migrate(&mut src, &mut dst, &params(50, None), &Control::default());
    sent.unwrap();
    received.unwrap();
    assert!(src.contents() == dst.contents());
}

#[test]
fn a_dead_destination_leaves_the_source_running() {
    let mut src = FakeVm::new(32 * MIB, 1);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 2,
        zero_percent: 0,
        interval: Duration::from_micros(100),
    });
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let killer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; wire::HELLO_SIZE];
        s.read_exact(&mut hello).unwrap();
        let mut reply = Hello::decode(&hello).unwrap();
        reply.memory_size = 32 * MIB;
        s.write_all(&reply.encode()).unwrap();
        let mut sink = vec![0u8; 1 << 20];
        s.read_exact(&mut sink).unwrap();
        // The destination dies: the socket closes mid-precopy.
    });
    let r = source::migrate(
        &mut src,
        TcpStream::connect(addr).unwrap(),
        &params(300, Some(50_000_000)),
        &Control::default(),
    );
    killer.join().unwrap();
    let err = r.unwrap_err();
    assert!(
        matches!(
            err,
            MigrateError::Io { .. } | MigrateError::Truncated { .. }
        ),
        "{err}"
    );
    assert!(!src.is_paused() && !src.is_logging());
}

#[test]
fn memory_size_mismatch_is_refused_on_both_sides() {
    let mut src = FakeVm::new(8 * MIB, 1);
    let mut dst = FakeVm::new(16 * MIB, 1);
    let (sent, received) = migrate(&mut src, &mut dst, &params(300, None), &Control::default());
    for e in [
        sent.unwrap_err().to_string(),
        received.unwrap_err().to_string(),
    ] {
        assert!(
            e.contains("memory sizes differ") && e.contains("same --memory"),
            "{e}"
        );
    }
    assert!(!src.is_paused());
}

/// Sends `bytes` to a fresh fake destination of 8 MiB and returns its error.
fn feed(bytes: &[u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    std::thread::scope(|s| {
        let receiver = s.spawn(|| destination::receive(&mut dst, listener.accept().unwrap().0));
        let mut c = TcpStream::connect(addr).unwrap();
        let _ = c.write_all(bytes);
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = c.read_to_end(&mut sink);
        let r = receiver.join().unwrap();
        r.expect_err("a bad stream must be refused").to_string()
    })
}

fn hello(memory: u64) -> Vec<u8> {
    Hello {
        role: Role::Main,
        channel: 0,
        uuid: [1; 16],
        memory_size: memory,
        status: 0,
    }
    .encode()
    .to_vec()
}

fn record(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

fn pages(gpas: &[u64]) -> Vec<u8> {
    let mut v = record(Header::pages(gpas.len() as u32), &[]);
    for g in gpas {
        v.extend_from_slice(&g.to_le_bytes());
    }
    v.extend(std::iter::repeat_n(0xab, gpas.len() * 4096));
    v
}

fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}

#[test]
fn crafted_bad_streams_are_refused_with_a_clear_error() {
    let ok = hello(8 * MIB);
    let end1 = record(Header::new(Kind::EndOfPass, 1, 0), &[]);
    let state = record(Header::device_state(SectionId::Vcpu, 1, 3), b"abc");
    let mut bad_magic = ok.clone();
    bad_magic[0] = b'X';
    let mut bad_version = ok.clone();
    bad_version[8] = 9;
    let full = cat(&[ok.clone(), pages(&[0x1000]), end1.clone(), state.clone()]);
    let table: Vec<(&str, Vec<u8>, &str)> = vec![
        ("bad magic", bad_magic, "bad magic"),
        (
            "bad version",
            bad_version,
            "protocol version 9 is not supported",
        ),
        ("wrong memory size", hello(16 * MIB), "memory sizes differ"),
        (
            "truncated hello",
            ok[..20].to_vec(),
            "closed the connection while reading the hello",
        ),
        (
            "truncated header",
            cat(&[ok.clone(), vec![1, 0, 0]]),
            "closed the connection while receiving the migration",
        ),
        (
            "truncated page",
            full[..ok.len() + 16 + 8 + 100].to_vec(),
            "closed the connection while receiving pages",
        ),
        (
            "truncated before Complete",
            full.clone(),
            "closed the connection",
        ),
        (
            "address out of range",
            cat(&[ok.clone(), pages(&[8 * MIB])]),
            "outside guest RAM",
        ),
        (
            "address in the gap",
            cat(&[ok.clone(), pages(&[1 << 40])]),
            "outside guest RAM",
        ),
        (
            "unaligned address",
            cat(&[ok.clone(), pages(&[0x1001])]),
            "not page aligned",
        ),
        (
            "oversized batch",
            cat(&[
                ok.clone(),
                Header::new(Kind::Pages, 100_000, 100_000 * 4104)
                    .encode()
                    .to_vec(),
            ]),
            "exceeds the limit of 512",
        ),
        (
            "oversized section",
            cat(&[
                ok.clone(),
                end1.clone(),
                Header::device_state(SectionId::Vcpu, 1, 1 << 30)
                    .encode()
                    .to_vec(),
            ]),
            "exceeds the limit of 1048576",
        ),
        (
            "unknown kind",
            cat(&[
                ok.clone(),
                vec![42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ]),
            "unknown record kind 42",
        ),
        (
            "pass out of order",
            cat(&[ok.clone(), record(Header::new(Kind::EndOfPass, 2, 0), &[])]),
            "end of pass 2 after pass 0",
        ),
        (
            "state before memory",
            cat(&[ok.clone(), state.clone()]),
            "device state before any memory pass",
        ),
        (
            "pages after state",
            cat(&[ok.clone(), end1.clone(), state.clone(), pages(&[0])]),
            "Pages record after device state",
        ),
        (
            "complete without state",
            cat(&[
                ok.clone(),
                end1.clone(),
                record(Header::new(Kind::Complete, 0, 0), &[]),
            ]),
            "Complete without any device state",
        ),
        (
            "unknown section",
            cat(&[
                ok.clone(),
                end1.clone(),
                record(Header::device_state(SectionId::Serial, 1, 1), b"x"),
                record(Header::new(Kind::Complete, 0, 0), &[]),
            ]),
            "the fake VM has only a vCPU section",
        ),
        (
            "resumed from the source",
            cat(&[
                ok.clone(),
                record(Header::new(Kind::Resumed, 0, 24), &[0; 24]),
            ]),
            "Resumed record from the source",
        ),
    ];
    for (name, bytes, want) in table {
        let err = feed(&bytes);
        assert!(err.contains(want), "{name}: got '{err}'");
    }
    // And a well-formed stream is accepted, so the table above fails for the stated reasons.
    let good = cat(&[full, record(Header::new(Kind::Complete, 0, 0), &[])]);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    std::thread::scope(|s| {
        let r = s.spawn(|| destination::receive(&mut dst, listener.accept().unwrap().0));
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(&good).unwrap();
        let mut sink = Vec::new();
        let _ = c.read_to_end(&mut sink);
        r.join().unwrap().unwrap();
    });
    assert!(dst.resumed);
    assert_eq!(&dst.contents()[0x1000..0x1004], &[0xab; 4]);
    let _ = gpa_of(&dst, 0);
}
