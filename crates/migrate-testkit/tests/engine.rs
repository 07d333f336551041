//! The migration engine over the fake VMM, on real TCP loopback, without /dev/kvm.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ferry_migrate::destination::{self, ReceiveStats};
use ferry_migrate::scan::ZeroDetection;
use ferry_migrate::source::{self, SourceParams};
use ferry_migrate::wire::{self, Header, Hello, Kind, Role};
use ferry_migrate::{Control, MigrateError, MigrationStats, Phase, Policy, TimeoutAction};
use ferry_migrate_testkit::craft::{
    cat, data_hello, end, hello, main_hello, pages, record, section, zero_runs,
};
use ferry_migrate_testkit::{FakeVm, Writers};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

/// Parameters with a 1 s timeout that forces the switchover: a fast fake writer may never let
/// precopy converge, and the properties tested here must hold either way.
fn params(downtime_ms: u64, max_bandwidth: Option<u64>) -> SourceParams {
    let policy = Policy {
        downtime_limit: Duration::from_millis(downtime_ms),
        timeout: Some(Duration::from_secs(1)),
        timeout_action: TimeoutAction::Switchover,
    };
    SourceParams {
        max_bandwidth,
        ..SourceParams::new(policy, [3; 16])
    }
}

/// Accepts data channels on `listener` until `deadline` (shortened to 2 s for tests).
fn acceptor(listener: &TcpListener) -> impl FnMut(Instant) -> std::io::Result<TcpStream> + '_ {
    move |deadline: Instant| {
        listener.set_nonblocking(true)?;
        let deadline = deadline.min(Instant::now() + Duration::from_secs(2));
        loop {
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    return Ok(s);
                }
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        }
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
        let receiver = s.spawn(|| {
            let main = listener.accept().unwrap().0;
            destination::receive(dst, main, &mut acceptor(&listener))
        });
        let connect = || TcpStream::connect(addr);
        let sent = source::migrate(src, TcpStream::connect(addr).unwrap(), &connect, p, control);
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

/// An offload engine that fails every third batch: the senders scan those batches themselves
/// and every page still arrives right.
#[test]
fn offload_failures_fall_back_to_the_cpu_and_lose_nothing() {
    let mut src = FakeVm::new(16 * MIB, 2);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 11,
        zero_percent: 40,
        interval: Duration::from_micros(50),
    });
    let mut dst = FakeVm::new(16 * MIB, 2);
    let p = SourceParams {
        channels: 3,
        packet_pages: 32,
        zero: ZeroDetection::Offload,
        offload_fail_every: Some(3),
        ..params(20, None)
    };
    let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert!(
        stats.zero_scan_fallbacks > 0,
        "failures were injected: {stats:?}"
    );
    assert!(stats.pages_zero > 0, "zero pages were still found");
    assert!(src.contents() == dst.contents());
}

#[test]
fn every_channel_count_and_detector_moves_memory_exactly() {
    for (channels, zero) in [
        (1, ZeroDetection::Inline),
        (4, ZeroDetection::Inline),
        (2, ZeroDetection::None),
        (3, ZeroDetection::Offload),
    ] {
        let mut src = FakeVm::new(8 * MIB, 2);
        src.fill(3);
        src.start_writers(Writers {
            threads: 2,
            seed: u64::from(channels),
            zero_percent: 30,
            interval: Duration::from_micros(100),
        });
        let mut dst = FakeVm::new(8 * MIB, 2);
        let p = SourceParams {
            channels,
            packet_pages: 16,
            zero,
            ..params(30, None)
        };
        let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
        let stats = sent.unwrap();
        assert_eq!(received.unwrap().channels, channels);
        if zero == ZeroDetection::None {
            assert_eq!(
                stats.pages_zero, 0,
                "--zero-detection none sends every page as data"
            );
        }
        assert!(
            src.contents() == dst.contents(),
            "{channels} channels, {zero:?}"
        );
    }
}

/// Every pass rewrites the same pages, spread over four channels: an older copy must never
/// land after a newer one (the per-pass barrier).
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
    let p = SourceParams {
        channels: 4,
        packet_pages: 8,
        ..params(5, None)
    };
    let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert!(stats.passes.len() >= 3, "{:?}", stats.passes);
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

/// Reads a hello from `s` and answers it as an accepting destination of `memory` bytes.
fn accept_hello(s: &mut TcpStream, memory: u64) {
    let mut hello = [0u8; wire::HELLO_SIZE];
    s.read_exact(&mut hello).unwrap();
    let mut reply = Hello::decode(&hello).unwrap();
    reply.memory_size = memory;
    s.write_all(&reply.encode()).unwrap();
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
        let mut streams: Vec<TcpStream> = (0..3)
            .map(|_| {
                let mut s = listener.accept().unwrap().0;
                accept_hello(&mut s, 32 * MIB);
                s
            })
            .collect();
        let mut sink = vec![0u8; 1 << 20];
        streams[1].read_exact(&mut sink).unwrap();
        // The destination dies: every socket closes mid-precopy.
    });
    let connect = || TcpStream::connect(addr);
    let r = source::migrate(
        &mut src,
        TcpStream::connect(addr).unwrap(),
        &connect,
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

/// A crafted migration: the main connection's bytes, then each data connection's bytes
/// (each connection is opened in order and written whole).
fn feed(main: &[u8], data: &[Vec<u8>]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let main = listener.accept().unwrap().0;
            destination::receive(&mut dst, main, &mut acceptor(&listener))
        });
        let mut conns = vec![TcpStream::connect(addr).unwrap()];
        let _ = conns[0].write_all(main);
        for d in data {
            let mut c = TcpStream::connect(addr).unwrap();
            let _ = c.write_all(d);
            conns.push(c);
        }
        for c in &conns {
            let _ = c.shutdown(std::net::Shutdown::Write);
        }
        let r = receiver.join().unwrap();
        r.expect_err("a bad stream must be refused").to_string()
    })
}

/// A crafted stream: name, main connection bytes, data connections' bytes, expected error.
type Crafted = (&'static str, Vec<u8>, Vec<Vec<u8>>, &'static str);

#[test]
fn crafted_bad_streams_are_refused_with_a_clear_error() {
    let ok = main_hello();
    let state = section(1, 0, b"abc");
    let complete = record(Header::new(Kind::Complete, 0, 0), &[]);
    let mut bad_magic = ok.clone();
    bad_magic[0] = b'X';
    let mut bad_version = ok.clone();
    bad_version[8] = 9;
    let good_data = cat(&[
        data_hello(1),
        pages(&[0x1000]),
        zero_runs(&[(0x4000, 2)]),
        end(1),
    ]);
    // (name, main bytes, data channel bytes, expected error)
    let table: Vec<Crafted> = vec![
        ("bad magic", bad_magic, vec![], "bad magic"),
        (
            "bad version",
            bad_version,
            vec![],
            "protocol version 9 is not supported",
        ),
        (
            "wrong memory size",
            hello(Role::Main, 0, 1, 16 * MIB, 1),
            vec![],
            "memory sizes differ",
        ),
        (
            "no channels",
            hello(Role::Main, 0, 1, 8 * MIB, 0),
            vec![],
            "0 data channels announced",
        ),
        (
            "data role first",
            data_hello(1),
            vec![],
            "the first connection must be the main channel",
        ),
        (
            "truncated hello",
            ok[..20].to_vec(),
            vec![],
            "closed the connection while reading the hello",
        ),
        // Data channel handshake misuse.
        (
            "unknown uuid",
            ok.clone(),
            vec![hello(Role::Data, 1, 9, 8 * MIB, 1)],
            "not the one in progress",
        ),
        (
            "channel id out of range",
            ok.clone(),
            vec![data_hello(2)],
            "out of range 1..=1",
        ),
        (
            "channel id zero",
            ok.clone(),
            vec![data_hello(0)],
            "out of range 1..=1",
        ),
        (
            "duplicate channel",
            hello(Role::Main, 0, 1, 8 * MIB, 2),
            vec![
                hello(Role::Data, 1, 1, 8 * MIB, 2),
                hello(Role::Data, 1, 1, 8 * MIB, 2),
            ],
            "data channel 1 connected twice",
        ),
        (
            "channel never connects",
            hello(Role::Main, 0, 1, 8 * MIB, 2),
            vec![hello(Role::Data, 1, 1, 8 * MIB, 2)],
            "data channel(s) 2 never connected",
        ),
        (
            "second main connection",
            ok.clone(),
            vec![main_hello()],
            "extra connections must be data channels",
        ),
        // Page records on a data channel.
        (
            "address out of range",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[8 * MIB])])],
            "outside guest RAM",
        ),
        (
            "address far out",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[1 << 40])])],
            "outside guest RAM",
        ),
        (
            "unaligned address",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[0x1001])])],
            "not page aligned",
        ),
        (
            "unordered addresses",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[0x2000, 0x1000])])],
            "not strictly increasing",
        ),
        (
            "page twice in a pass",
            ok.clone(),
            vec![cat(&[data_hello(1), pages(&[0x1000]), pages(&[0x1000])])],
            "sent twice in one pass",
        ),
        (
            "zero run leaves RAM",
            ok.clone(),
            vec![cat(&[data_hello(1), zero_runs(&[(8 * MIB - 4096, 2)])])],
            "leaves its RAM region",
        ),
        (
            "empty zero run",
            ok.clone(),
            vec![cat(&[data_hello(1), zero_runs(&[(0, 0)])])],
            "is empty",
        ),
        (
            "oversized batch",
            ok.clone(),
            vec![cat(&[
                data_hello(1),
                Header::new(Kind::Pages, 100_000, 100_000 * 4104)
                    .encode()
                    .to_vec(),
            ])],
            "exceeds the limit of 512",
        ),
        (
            "closed mid-batch",
            ok.clone(),
            vec![pages(&[0x1000])[..200].to_vec()]
                .into_iter()
                .map(|p| cat(&[data_hello(1), p]))
                .collect(),
            "closed the connection while receiving pages",
        ),
        (
            "state on a data channel",
            ok.clone(),
            vec![cat(&[data_hello(1), state.clone()])],
            "DeviceState record on a data channel",
        ),
        // The main channel.
        (
            "pages on the main channel",
            cat(&[ok.clone(), pages(&[0])]),
            vec![data_hello(1)],
            "Pages record on the main channel",
        ),
        (
            "unknown kind",
            cat(&[
                ok.clone(),
                vec![42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ]),
            vec![data_hello(1)],
            "unknown record kind 42",
        ),
        (
            "pass out of order",
            cat(&[ok.clone(), end(2)]),
            vec![data_hello(1)],
            "end of pass 2 after pass 0",
        ),
        (
            "state before memory",
            cat(&[ok.clone(), state.clone()]),
            vec![data_hello(1)],
            "device state before any memory pass",
        ),
        (
            "oversized section",
            cat(&[
                ok.clone(),
                end(1),
                Header::device_state(1 << 30).encode().to_vec(),
            ]),
            vec![cat(&[data_hello(1), end(1)])],
            "exceeds the limit of 1048592",
        ),
        (
            "complete without state",
            cat(&[ok.clone(), end(1), complete.clone()]),
            vec![cat(&[data_hello(1), end(1)])],
            "Complete without any device state",
        ),
        (
            "unknown section for this VMM",
            cat(&[ok.clone(), end(1), section(2, 0, b"x"), complete.clone()]),
            vec![good_data.clone()],
            "the fake VM has only a vCPU section",
        ),
        (
            "one section instance twice",
            cat(&[
                ok.clone(),
                end(1),
                section(1, 1, b"a"),
                section(1, 1, b"b"),
                complete.clone(),
            ]),
            vec![good_data.clone()],
            "section 1 instance 1 sent twice",
        ),
        (
            "section shorter than its header",
            cat(&[
                ok.clone(),
                end(1),
                record(Header::new(Kind::DeviceState, 0, 8), &[1; 8]),
            ]),
            vec![good_data.clone()],
            "shorter than its 16-byte section header",
        ),
        (
            "resumed from the source",
            cat(&[
                ok.clone(),
                record(Header::new(Kind::Resumed, 0, 24), &[0; 24]),
            ]),
            vec![data_hello(1)],
            "Resumed record on the main channel",
        ),
        (
            "truncated before Complete",
            cat(&[ok.clone(), end(1), state.clone()]),
            vec![good_data.clone()],
            "closed the connection",
        ),
    ];
    for (name, main, data, want) in table {
        let err = feed(&main, &data);
        assert!(err.contains(want), "{name}: got '{err}'");
    }
}

/// The well-formed version of the streams above is accepted: so each row fails for the reason
/// it states, and pages and zero runs land where they should.
#[test]
fn a_crafted_good_stream_is_accepted() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    std::thread::scope(|s| {
        let r = s.spawn(|| {
            let main = listener.accept().unwrap().0;
            destination::receive(&mut dst, main, &mut acceptor(&listener))
        });
        let mut main = TcpStream::connect(addr).unwrap();
        main.write_all(&main_hello()).unwrap();
        let mut data = TcpStream::connect(addr).unwrap();
        data.write_all(&cat(&[
            data_hello(1),
            pages(&[0x1000, 0x2000]),
            end(1),
            zero_runs(&[(0x1000, 1)]),
            end(2),
        ]))
        .unwrap();
        data.shutdown(std::net::Shutdown::Write).unwrap();
        main.write_all(&cat(&[
            end(1),
            end(2),
            section(1, 0, b"abc"),
            record(Header::new(Kind::Complete, 0, 0), &[]),
        ]))
        .unwrap();
        let mut sink = Vec::new();
        let _ = main.read_to_end(&mut sink);
        r.join().unwrap().unwrap();
    });
    assert!(dst.resumed);
    let mem = dst.contents();
    assert_eq!(
        &mem[0x1000..0x1004],
        &[0; 4],
        "pass 2's zero run replaced pass 1's data"
    );
    assert_eq!(&mem[0x2000..0x2004], &[0xab; 4]);
}

/// A destination that refuses a data channel (here: as a duplicate id) ends the migration; the
/// source says why and keeps running.
#[test]
fn a_refused_data_channel_leaves_the_source_running() {
    let mut src = FakeVm::new(8 * MIB, 1);
    src.fill(2);
    src.start_writers(Writers {
        threads: 1,
        seed: 5,
        zero_percent: 0,
        interval: Duration::from_micros(200),
    });
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let refuser = std::thread::spawn(move || {
        let mut main = listener.accept().unwrap().0;
        accept_hello(&mut main, 8 * MIB);
        let mut data = listener.accept().unwrap().0;
        let mut hello = [0u8; wire::HELLO_SIZE];
        data.read_exact(&mut hello).unwrap();
        let mut reply = Hello::decode(&hello).unwrap();
        reply.status = wire::Refusal::ChannelId as u32;
        data.write_all(&reply.encode()).unwrap();
    });
    let connect = || TcpStream::connect(addr);
    let r = source::migrate(
        &mut src,
        TcpStream::connect(addr).unwrap(),
        &connect,
        &params(300, None),
        &Control::default(),
    );
    refuser.join().unwrap();
    let err = r.unwrap_err().to_string();
    assert!(err.contains("data channel 1 refused"), "{err}");
    assert!(!src.is_paused() && !src.is_logging());
    let before = src.writes();
    std::thread::sleep(Duration::from_millis(50));
    assert!(src.writes() > before, "the guest keeps running");
}
