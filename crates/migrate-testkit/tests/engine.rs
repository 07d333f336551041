//! The migration engine over the fake VMM, on real TCP loopback, without /dev/kvm: whole
//! migrations (memory equal at switchover, channels and zero detection, holes, the per-pass
//! barrier) with both ways of landing pages on the destination, and the source's failure paths (cancel, a dead or refusing destination). The
//! destination's answers to crafted streams are in `crafted.rs`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use ferry_migrate::scan::ZeroDetection;
use ferry_migrate::source::{self, SourceParams, TestHooks};
use ferry_migrate::wire::{self, Hello};
use ferry_migrate::{Control, MigrateError, PageLanding, Phase, Policy, TimeoutAction, Tuning};
use ferry_migrate_testkit::loopback::{
    migrate, migrate_flipping, migrate_into_slow, migrate_with_hooks,
};
use ferry_migrate_testkit::{FakeVm, Writers};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
/// Both ways a destination lands pages: each test of whole migrations runs with each.
const LANDINGS: [PageLanding; 2] = [PageLanding::Mapping, PageLanding::File];

/// Parameters with a 1 s timeout that forces the switchover: a fast fake writer may never let
/// precopy converge, and the properties tested here must hold either way.
fn params(downtime_ms: u64, max_bandwidth: Option<u64>) -> SourceParams {
    let policy = Policy {
        downtime_limit: Duration::from_millis(downtime_ms),
        timeout: Some(Duration::from_secs(1)),
        timeout_action: TimeoutAction::Switchover,
        ..Policy::default()
    };
    SourceParams {
        max_bandwidth,
        ..SourceParams::new(policy, [3; 16])
    }
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
        landing in prop_oneof![Just(PageLanding::Mapping), Just(PageLanding::File)],
    ) {
        let size = mib * MIB * regions as u64;
        let mut src = FakeVm::new(size, regions);
        src.fill(stride);
        src.start_writers(Writers { threads, seed, zero_percent, interval: Duration::from_micros(50) });
        let mut dst = FakeVm::new(size, regions);
        dst.landing = landing;
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
        zero: ZeroDetection::Offload.into(),
        ..params(20, None)
    };
    let hooks = TestHooks {
        zero_fail_every: Some(3),
    };
    let (sent, received) = migrate_with_hooks(&mut src, &mut dst, &p, &Control::default(), &hooks);
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
    for ((channels, zero), landing) in [
        (1, ZeroDetection::Inline),
        (4, ZeroDetection::Inline),
        (2, ZeroDetection::None),
        (3, ZeroDetection::Offload),
    ]
    .into_iter()
    .flat_map(|c| LANDINGS.map(|l| (c, l)))
    {
        let mut src = FakeVm::new(8 * MIB, 2);
        src.fill(3);
        src.start_writers(Writers {
            threads: 2,
            seed: u64::from(channels),
            zero_percent: 30,
            interval: Duration::from_micros(100),
        });
        let mut dst = FakeVm::new(8 * MIB, 2);
        dst.landing = landing;
        let p = SourceParams {
            channels,
            packet_pages: 16,
            zero: zero.into(),
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
            "{channels} channels, {zero:?}, {landing:?}"
        );
    }
}

/// Every pass rewrites the same pages, spread over four channels: an older copy must never
/// land after a newer one (the per-pass barrier).
#[test]
fn pages_rewritten_every_pass_arrive_in_their_last_version() {
    for landing in LANDINGS {
        let mut src = FakeVm::new(8 * MIB, 2);
        src.fill(1);
        src.start_writers(Writers {
            threads: 2,
            seed: 7,
            zero_percent: 30,
            interval: Duration::ZERO,
        });
        let mut dst = FakeVm::new(8 * MIB, 2);
        dst.landing = landing;
        let p = SourceParams {
            channels: 4,
            packet_pages: 8,
            ..params(5, None)
        };
        let (sent, received) = migrate(&mut src, &mut dst, &p, &Control::default());
        let stats = sent.unwrap();
        received.unwrap();
        assert!(stats.passes.len() >= 3, "{landing:?}: {:?}", stats.passes);
        assert!(src.contents() == dst.contents(), "{landing:?}");
    }
}

#[test]
fn holes_are_neither_sent_nor_populated() {
    for landing in LANDINGS {
        let mut src = FakeVm::new(64 * MIB, 2);
        src.fill(64);
        let mut dst = FakeVm::new(64 * MIB, 2);
        dst.landing = landing;
        let (sent, received) = migrate(&mut src, &mut dst, &params(300, None), &Control::default());
        let stats = sent.unwrap();
        received.unwrap();
        let populated = 64 * MIB / 4096 / 64;
        assert_eq!(stats.pages_normal, populated);
        assert_eq!(stats.pages_skipped_holes, 64 * MIB / 4096 - populated);
        assert!(
            dst.allocated_bytes() <= 2 * populated * 4096 + MIB,
            "{landing:?}: {}",
            dst.allocated_bytes()
        );
        assert!(src.contents() == dst.contents(), "{landing:?}");
    }
}

/// Pass 1's progress is shown while it runs, against the populated memory it must send: what
/// is left falls, what was sent rises on a capped link, and an ETA is given. (It showed
/// "remaining 0" through all of pass 1, and "sent" moved only every 16 batches.)
#[test]
fn pass_one_shows_what_it_has_left_of_populated_memory_while_it_runs() {
    let mut src = FakeVm::new(32 * MIB, 1);
    src.fill(2); // half the pages populated: 16 MiB
    let mut dst = FakeVm::new(32 * MIB, 1);
    let control = Control::default();
    // 16 MB/s: pass 1 takes about a second.
    let (seen, (sent, received)) = ferry_migrate_testkit::watching(&control, || {
        migrate(&mut src, &mut dst, &params(300, Some(16_000_000)), &control)
    });
    sent.unwrap();
    received.unwrap();
    let pass1: Vec<_> = seen
        .iter()
        .filter(|p| p.phase == Phase::Precopy && p.pass == 0)
        .collect();
    let populated = 16 * MIB;
    assert!(
        pass1.iter().all(|p| p.remaining_bytes <= populated + MIB),
        "never more left than populated memory: {pass1:?}"
    );
    let left: Vec<u64> = pass1.iter().map(|p| p.remaining_bytes).collect();
    assert!(
        left.iter().any(|&l| l > populated / 2) && left.iter().any(|&l| l < populated / 2),
        "what is left falls through pass 1: {left:?}"
    );
    assert!(left.windows(2).all(|w| w[1] <= w[0]), "{left:?}");
    let mut sent: Vec<u64> = pass1.iter().map(|p| p.bytes_sent).collect();
    sent.dedup();
    assert!(
        sent.len() >= 8,
        "sent moves through pass 1, not by 8 MiB steps: {sent:?}"
    );
    assert!(
        pass1.iter().any(|p| p.eta_ms.is_some_and(|e| e > 0.0)),
        "an ETA while pass 1 runs"
    );
}

/// A running migration takes new settings at its next step: a lifted bandwidth cap lets it
/// finish far sooner than the cap allowed, and progress shows the settings in force.
#[test]
fn a_running_migration_takes_a_new_bandwidth_limit_and_downtime_limit() {
    let mut src = FakeVm::new(32 * MIB, 1);
    src.fill(1);
    let mut dst = FakeVm::new(32 * MIB, 1);
    let control = Control::default();
    let cap = 8_000_000;
    let (seen, (sent, received)) = ferry_migrate_testkit::watching(&control, || {
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                control
                    .tune(Tuning {
                        max_bandwidth: Some(None),
                        downtime_limit: Some(Duration::from_millis(700)),
                        ..Tuning::default()
                    })
                    .unwrap();
            });
            // 32 MiB at 8 MB/s: over 4 s of pass 1 had the cap stayed.
            migrate(&mut src, &mut dst, &params(300, Some(cap)), &control)
        })
    });
    let stats = sent.unwrap();
    received.unwrap();
    let first = seen
        .iter()
        .find(|p| p.phase == Phase::Precopy)
        .expect("progress in precopy was read");
    let last = seen.last().expect("progress was read");
    assert_eq!(first.settings.max_bandwidth, Some(cap), "{first:?}");
    assert_eq!(first.settings.downtime_limit_ms, 300);
    assert_eq!(last.settings.max_bandwidth, None, "{last:?}");
    assert_eq!(last.settings.downtime_limit_ms, 700);
    let capped_ms = stats.bytes_sent as f64 / cap as f64 * 1e3;
    assert!(
        stats.total_ms < capped_ms / 2.0,
        "the cap was lifted: {:.0} ms, {capped_ms:.0} ms at the cap",
        stats.total_ms
    );
}

/// A timeout set on a running migration acts with its timeout action (cancel) within a step,
/// and the source keeps running.
#[test]
fn a_timeout_set_on_a_running_migration_cancels_it() {
    let mut src = FakeVm::new(32 * MIB, 1);
    src.fill(1);
    let mut dst = FakeVm::new(32 * MIB, 1);
    let control = Control::default();
    let policy = Policy {
        timeout: None,
        timeout_action: TimeoutAction::Cancel,
        ..Policy::default()
    };
    let p = SourceParams {
        max_bandwidth: Some(4_000_000),
        ..SourceParams::new(policy, [3; 16])
    };
    let (sent, _) = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            control
                .tune(Tuning {
                    timeout: Some(Some(Duration::from_millis(400))),
                    ..Tuning::default()
                })
                .unwrap();
        });
        migrate(&mut src, &mut dst, &p, &control)
    });
    assert!(
        matches!(sent, Err(MigrateError::Timeout(t)) if t == Duration::from_millis(400)),
        "{sent:?}"
    );
    assert!(!src.is_paused(), "the source runs on");
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

/// Regression test for the idle guest that paused for up to 105 ms although its final pass
/// carried ~10 MB: pass 1's tail was still in socket buffers, being digested by a slow
/// destination, when the source paused, and the final pass queued behind it. With progress
/// acknowledgements the source waits (the guest running) until the destination has taken in
/// what was in flight, so the pause carries only the final pass.
#[test]
fn an_idle_guest_pauses_only_after_a_slow_destination_took_in_pass_1() {
    const RATE: u64 = 24_000_000; // per data channel: 48 MB/s for the pair
    let mut src = FakeVm::new(48 * MIB, 1);
    src.fill(1);
    let mut dst = FakeVm::new(48 * MIB, 1);
    let p = SourceParams::new(
        Policy {
            downtime_limit: Duration::from_millis(300),
            timeout: None,
            timeout_action: TimeoutAction::Cancel,
            ..Policy::default()
        },
        [9; 16],
    );
    let (sent, received) = migrate_into_slow(&mut src, &mut dst, &p, &Control::default(), RATE);
    let stats = sent.unwrap();
    received.unwrap();
    assert!(src.contents() == dst.contents());
    assert!(stats.converged, "{stats:?}");
    // Pass 1 went out faster than the destination took it in, so there was a tail to wait for.
    assert!(stats.drain_ms > 0.0, "no drain: {stats:?}");
    // When the guest paused, at most a few ms of data at the destination's rate were in flight
    // (the policy settles at 2 ms; 1 MiB is 20 ms at 48 MB/s).
    assert!(
        stats.in_flight_at_pause_bytes < MIB,
        "{} bytes in flight at the pause",
        stats.in_flight_at_pause_bytes
    );
    // Everything sent was acknowledged by the end (the destination counts 16 bytes per pass
    // end on each data channel that the source's count leaves out).
    assert!(
        stats.acked_bytes + 1024 >= stats.bytes_sent - wire::HELLO_SIZE as u64,
        "{stats:?}"
    );
    // The final pass of an idle guest is empty, and the pause does not wait for pass 1 (the
    // in-flight bound above says so; the pause's length is printed, not bounded: a loaded
    // machine stretched a 20 ms pause to 74 ms once, where a few MB of pass 1 in the socket
    // buffers would have taken ~200 ms at 48 MB/s).
    let final_pass = stats.passes.last().unwrap();
    assert!(final_pass.paused && final_pass.pages == 0, "{final_pass:?}");
    eprintln!("paused {:.1} ms", stats.downtime.total_ms);
}

/// A byte changed on the way in a data channel: its page data with page checksums, or the
/// start of its records without. The destination refuses the record naming it, in its own
/// words; the source reports it as the destination's, and runs on with its memory intact.
#[test]
fn a_changed_byte_is_refused_by_the_destination_and_the_source_runs_on() {
    let cases = [
        (
            true,
            100_000,
            "Pages record's payload checksum does not match (its addresses and page data",
        ),
        (
            false,
            (wire::HELLO_SIZE + wire::HEADER_SIZE + 3) as u64,
            "record's payload checksum does not match",
        ),
    ];
    for (checksum_pages, at, want) in cases {
        let mut src = FakeVm::new(4 * MIB, 1);
        src.fill(4);
        let before = src.contents();
        let mut dst = FakeVm::new(4 * MIB, 1);
        let p = SourceParams {
            channels: 1,
            checksum_pages,
            ..params(300, None)
        };
        let (sent, received) = migrate_flipping(&mut src, &mut dst, &p, wire::Role::Data, at);
        let here = received.expect_err("the destination refuses").to_string();
        assert!(here.contains(want), "destination: {here}");
        assert!(
            !here.contains("reported an error"),
            "the destination blames the source: {here}"
        );
        let there = sent.expect_err("the source fails").to_string();
        assert!(
            there.contains("the destination reported an error") && there.contains(want),
            "source: {there}"
        );
        assert!(!dst.resumed);
        assert!(!src.is_paused(), "the source runs on");
        assert!(src.contents() == before, "the source's memory is intact");
    }
}

/// Regression (a postcopy pause that waited ~10-40 ms for a discard list): the source counts
/// every byte it writes exactly as the destination counts what it takes in, pass ends and the
/// postcopy marker on the data channels included. A count short by even one record header
/// made acknowledgements look ahead of what was sent, so a 40-byte discard list seemed applied
/// before the destination had read it. Several passes and every channel count, both ends read
/// at the end of a migration, must agree to the byte (hellos are not counted on either side).
#[test]
fn the_source_counts_every_byte_the_destination_acknowledges() {
    for channels in [1, 3] {
        let mut src = FakeVm::new(16 * MIB, 2);
        src.fill(5);
        src.start_writers(Writers {
            threads: 1,
            seed: 11,
            zero_percent: 10,
            interval: Duration::from_millis(2),
        });
        let mut dst = FakeVm::new(16 * MIB, 2);
        let p = SourceParams {
            channels,
            ..params(1, None)
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let control = std::sync::Arc::new(ferry_migrate::destination::IncomingControl::default());
        let (sent, received) = std::thread::scope(|s| {
            let dst = &mut dst;
            let (listener, control) = (&listener, control.clone());
            let receiver = s.spawn(move || {
                let main = listener.accept().unwrap().0;
                let mut accept = ferry_migrate_testkit::loopback::acceptor(listener);
                ferry_migrate::destination::receive_with(dst, main, &mut accept, control)
            });
            let sent = source::migrate(
                &mut src,
                TcpStream::connect(addr).unwrap(),
                &|| TcpStream::connect(addr),
                &p,
                &Control::default(),
            );
            (sent, receiver.join().unwrap())
        });
        let stats = sent.unwrap();
        received.unwrap();
        assert!(
            stats.passes.len() >= 3,
            "several passes: {:?}",
            stats.passes
        );
        assert_eq!(
            stats.bytes_sent - wire::HELLO_SIZE as u64,
            control.progress().bytes_received,
            "{channels} channels: the source's count (main hello excluded) against the destination's"
        );
    }
}
