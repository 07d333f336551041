//! Postcopy over the fake VMM with a real userfaultfd and real loopback TCP, without
//! /dev/kvm: the source switches after pass 1 while its guest writes flat out, the
//! destination's guest (writer threads) runs at once and faults on pages that have not
//! arrived, and every page ends up in its last version.

use std::time::Duration;

use ferry_migrate::source::{Mode, Postcopy, Preempt, SourceParams};
use ferry_migrate::{Control, PageLanding, Phase, Policy, Progress, TimeoutAction};
use ferry_migrate_testkit::loopback::migrate;
use ferry_migrate_testkit::watching;
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;
const PAGE: usize = 4096;

/// Postcopy after pass 1; a downtime limit no flat-out guest meets, so precopy never
/// switches over by itself first.
fn postcopy_params(channels: u16, max_bandwidth: Option<u64>, preempt: bool) -> SourceParams {
    let policy = Policy {
        downtime_limit: Duration::from_micros(1),
        timeout: Some(Duration::from_secs(60)),
        timeout_action: TimeoutAction::Switchover,
        ..Policy::default()
    };
    SourceParams {
        channels,
        max_bandwidth,
        mode: Mode::Postcopy(Postcopy {
            after_passes: Some(1),
            preempt: Preempt::urgent_when(preempt),
            ..Postcopy::default()
        }),
        ..SourceParams::new(policy, [9; 16])
    }
}

/// Migrates a guest of `mib` MiB that writes flat out into a destination whose own writers
/// start at the resume; checks every page the destination's guest did not write against the
/// paused source, and returns (source stats, destination stats) for further checks.
/// Precopy's pages land in the destination as `landing` says: through the guest's mapping,
/// postcopy runs over the memory the destination holds (minor faults).
fn postcopy_run(
    mib: u64,
    channels: u16,
    max_bandwidth: Option<u64>,
    preempt: bool,
    control: &Control,
    landing: PageLanding,
) -> (
    ferry_migrate::MigrationStats,
    ferry_migrate::destination::ReceiveStats,
) {
    let size = mib * MIB * 2;
    let mut src = FakeVm::new(size, 2);
    src.fill(3);
    src.start_writers(Writers {
        threads: 2,
        seed: 0x5eed,
        zero_percent: 20,
        interval: Duration::ZERO,
    });
    let mut dst = FakeVm::new(size, 2);
    dst.landing = landing;
    // Slow enough that most pages are still the source's when the test compares them.
    dst.start_writers_on_resume(Writers {
        threads: 1,
        seed: 0xd57,
        zero_percent: 10,
        interval: Duration::from_millis(50),
    });
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &postcopy_params(channels, max_bandwidth, preempt),
        control,
    );
    let sent = sent.expect("the source's side");
    let received = received.expect("the destination's side");
    assert!(src.is_paused(), "the source ends paused");
    assert!(dst.resumed, "the destination runs the guest");
    assert_eq!(dst.abandoned, None);
    assert_eq!(dst.state, src.state, "device state moved");
    let compared = dst.assert_holds_the_last_version_of(&src);
    let pages = (size / PAGE as u64) as usize;
    assert!(
        compared > pages / 8,
        "{compared} of {pages} pages compared ({channels} channels)"
    );
    (sent, received)
}

#[test]
fn postcopy_after_one_pass_leaves_every_page_in_its_last_version() {
    let runs = [
        (1, false, PageLanding::File),
        (4, false, PageLanding::Mapping),
        (1, true, PageLanding::Mapping),
        (4, true, PageLanding::File),
    ];
    for (channels, preempt, landing) in runs {
        let (sent, received) =
            postcopy_run(8, channels, None, preempt, &Control::default(), landing);
        let pc = sent.postcopy.expect("the source switched to postcopy");
        assert_eq!(pc.after_passes, 1);
        assert!(
            pc.discarded_pages > 0,
            "a flat-out guest leaves pages dirty at the switch"
        );
        assert_eq!(
            pc.pages_background + pc.pages_requested,
            pc.discarded_pages,
            "every discarded page is sent once"
        );
        let here = received.postcopy.expect("the destination ran postcopy");
        assert_eq!(here.pages, pc.discarded_pages);
        assert_eq!(
            here.over_held,
            landing == PageLanding::Mapping,
            "over the memory held here when precopy landed through the mapping"
        );
        assert_eq!(sent.passes.len(), 1, "no final pass: postcopy replaces it");
    }
}

/// With the background stream held to 4 MiB/s, the destination's guest touches pages long
/// before the walk reaches them: they come by request, and the latencies are measured.
#[test]
fn a_destination_guest_gets_the_pages_it_waits_for_by_request() {
    for (preempt, landing) in [
        (false, PageLanding::File),
        (true, PageLanding::File),
        (false, PageLanding::Mapping),
        (true, PageLanding::Mapping),
    ] {
        requested_pages_arrive(preempt, landing);
    }
}

fn requested_pages_arrive(preempt: bool, landing: PageLanding) {
    let control = Control::default();
    let (seen, (sent, received)) = watching(&control, || {
        postcopy_run(4, 2, Some(4 * MIB), preempt, &control, landing)
    });
    let pc = sent.postcopy.expect("postcopy");
    // Progress in postcopy is postcopy's own: what is left, the requests, no predicted pause.
    let postcopy: Vec<&Progress> = seen.iter().filter(|p| p.phase == Phase::Postcopy).collect();
    assert!(
        postcopy
            .iter()
            .any(|p| p.remaining_bytes > 0 && p.eta_ms.is_some()),
        "{postcopy:?}"
    );
    assert!(postcopy.iter().all(|p| p.expected_downtime_ms.is_none()));
    assert!(
        postcopy.iter().any(|p| p.postcopy_requests > 0),
        "requests shown while postcopy runs: {postcopy:?}"
    );
    // The phases in order, the discard rounds named as what they are.
    let phases: Vec<Phase> = sent
        .timeline
        .iter()
        .map(|s| s.phase)
        .fold(vec![], |mut v, p| {
            if v.last() != Some(&p) {
                v.push(p);
            }
            v
        });
    let at = |phase| phases.iter().position(|&p| p == phase);
    assert!(
        at(Phase::Precopy) < at(Phase::Discarding)
            && at(Phase::Discarding) < at(Phase::Switchover)
            && at(Phase::Switchover) < at(Phase::Postcopy)
            && at(Phase::Precopy).is_some(),
        "{phases:?}"
    );
    assert!(pc.pages_requested > 0, "{pc:?}");
    assert!(pc.requests > 0);
    // Without a preempt connection, requests after the resume go on the main connection
    // (MAIN_PAGES), not behind the data channels' background stream.
    match preempt {
        false => assert!(pc.pages_on_main > 0, "{pc:?}"),
        true => assert_eq!(pc.pages_on_main, 0, "{pc:?}"),
    }
    // Either way the reader sent requested pages itself, with no hand-off.
    assert!(pc.pages_forwarded > 0, "{pc:?}");
    let here = received.postcopy.expect("postcopy here");
    println!(
        "preempt {preempt}, {landing:?}: requested {} of {} pages in {} requests; fault to page: mean {:.0} µs, p50 {} µs, p99 {} µs, max {} µs",
        pc.pages_requested,
        pc.discarded_pages,
        pc.requests,
        here.latencies.mean_us(),
        here.latencies.quantile_us(0.5),
        here.latencies.quantile_us(0.99),
        here.latencies.max_us
    );
    assert!(here.latencies.requests > 0, "{here:?}");
    assert_eq!(
        pc.latency_max_us, here.latencies.max_us,
        "Done carries them"
    );
    assert_eq!(
        here.latencies.buckets.iter().sum::<u64>(),
        here.latencies.requests,
        "every measured request is in one bucket"
    );
}

/// A destination that asks for a page outside guest RAM: the source refuses it with the reason
/// and, the guest having been handed over, stays paused.
#[test]
fn a_request_outside_ram_ends_the_migration_and_the_source_stays_paused() {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    use ferry_migrate::source;
    use ferry_migrate::wire::{self, Header, Hello, Kind};

    let memory = 4 * MIB;
    let mut src = FakeVm::new(memory, 1);
    src.fill(1);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = |l: &TcpListener| {
        let mut s = l.accept().unwrap().0;
        let mut raw = [0u8; wire::HELLO_SIZE];
        s.read_exact(&mut raw).unwrap();
        // Granting whatever was asked: the reply echoes the hello.
        s.write_all(&Hello::decode(&raw).unwrap().encode()).unwrap();
        s
    };
    let destination = std::thread::spawn(move || {
        let mut main = accept(&listener);
        let mut data = accept(&listener);
        let drain = std::thread::spawn(move || {
            let _ = std::io::copy(&mut data, &mut std::io::sink());
        });
        loop {
            let mut h = [0u8; wire::HEADER_SIZE];
            main.read_exact(&mut h).unwrap();
            let h = Header::decode(&h).unwrap();
            let mut payload = vec![0u8; h.len as usize];
            main.read_exact(&mut payload).unwrap();
            if h.kind == Kind::Postcopy {
                break;
            }
        }
        main.write_all(&ferry_migrate_testkit::craft::record(
            Header::new(Kind::Resumed, 0, wire::RESUMED_SIZE),
            &[0; wire::RESUMED_SIZE as usize],
        ))
        .unwrap();
        main.write_all(&ferry_migrate_testkit::craft::runs(
            Kind::PageRequest,
            &[(1 << 40, 1)],
        ))
        .unwrap();
        // Hold the connection until the source gives up on it.
        let _ = std::io::copy(&mut main, &mut std::io::sink());
        drain.join().unwrap();
    });
    let connect = || TcpStream::connect(addr);
    let r = source::migrate(
        &mut src,
        TcpStream::connect(addr).unwrap(),
        &connect,
        &SourceParams {
            channels: 1,
            ..postcopy_params(1, None, false)
        },
        &Control::default(),
    );
    let err = r.expect_err("a request outside RAM is refused").to_string();
    assert!(err.contains("requested pages outside RAM"), "{err}");
    assert!(
        src.is_paused(),
        "the guest was handed over: the source stays paused"
    );
    destination.join().unwrap();
}

/// `Postcopy::max_bandwidth` (QEMU's max-postcopy-bandwidth) paces the background push from
/// the switch on, while precopy before it ran unlimited. A bound from below on the time a
/// limiter must take, so a slow machine cannot fail it.
#[test]
fn a_postcopy_bandwidth_limit_paces_the_background_push() {
    const LIMIT: u64 = 16_000_000;
    let size = 32 * MIB;
    let mut src = FakeVm::new(size, 2);
    src.fill(3);
    src.start_writers(Writers {
        threads: 2,
        seed: 0xba4d,
        zero_percent: 0,
        interval: Duration::ZERO,
    });
    let mut dst = FakeVm::new(size, 2);
    let mut params = postcopy_params(2, None, false);
    if let Mode::Postcopy(p) = &mut params.mode {
        p.max_bandwidth = Some(LIMIT);
    }
    let (sent, received) = migrate(&mut src, &mut dst, &params, &Control::default());
    let stats = sent.expect("the source's side");
    received.expect("the destination's side");
    let pc = stats.postcopy.clone().expect("switched to postcopy");
    let pushed = pc.pages_background * PAGE as u64;
    assert!(pushed >= 2 * MIB, "too little pushed to measure: {stats:?}");
    let rate = pushed as f64 / (pc.duration_ms / 1e3);
    assert!(
        rate <= LIMIT as f64 * 1.25,
        "the push ran at {rate:.0} B/s over a limit of {LIMIT}: {pc:?}"
    );
    assert!(src.contents() == dst.contents(), "memory differs");
}
