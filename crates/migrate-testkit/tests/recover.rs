//! Postcopy recovery over the fake VMM with a real userfaultfd and loopback TCP: the
//! connections are broken in postcopy (by a pause on the source, on the destination, and by a
//! recovery attempt that fails), both sides wait in postcopy-paused, and recoveries on a new
//! listener complete the migration with every page in its last version.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_migrate::destination::{self, IncomingControl, IncomingPhase};
use ferry_migrate::source::{self, Mode, Postcopy, Preempt, SourceParams};
use ferry_migrate::transport::Address;
use ferry_migrate::{Control, PageLanding, Phase, Policy};
use ferry_migrate_testkit::loopback::acceptor;
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;
const PAGE: usize = 4096;

fn wait_until(what: &str, done: impl Fn() -> bool, state: impl Fn() -> String) {
    eprintln!("waiting for {what}: {}", state());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {}",
            state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A listener on loopback and its address as a source writes it.
fn listener() -> (TcpListener, Address) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = Address::Tcp(l.local_addr().unwrap().to_string());
    (l, addr)
}

type Sent = Result<ferry_migrate::MigrationStats, ferry_migrate::MigrateError>;
type Received = Result<destination::ReceiveStats, ferry_migrate::MigrateError>;

/// Starts in `s` a destination that receives into `vms.1` what arrives on `at.0`, and a
/// source that migrates `vms.0` to `at.1` (the listener's address, or a proxy's before it).
fn spawn_pair<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    vms: (&'env mut FakeVm, &'env mut FakeVm),
    at: (&'env TcpListener, std::net::SocketAddr),
    params: &'env SourceParams,
    controls: (&'env Control, Arc<IncomingControl>),
) -> (
    std::thread::ScopedJoinHandle<'scope, Sent>,
    std::thread::ScopedJoinHandle<'scope, Received>,
) {
    let ((src, dst), (listener, to), (sc, dc)) = (vms, at, controls);
    let receiver = s.spawn(move || {
        let main = listener.accept().unwrap().0;
        let mut accept = acceptor(listener);
        destination::receive_with(dst, main, &mut accept, dc)
    });
    let sender = s.spawn(move || {
        let connect = || TcpStream::connect(to);
        source::migrate(src, TcpStream::connect(to).unwrap(), &connect, params, sc)
    });
    (sender, receiver)
}

#[test]
fn postcopy_survives_broken_connections_and_a_failed_recovery() {
    for preempt in [false, true] {
        recover_run(preempt, false);
    }
}

/// A recovery listener that is sent an HTTP request, garbage, a connection that says nothing
/// and one for another migration used to end the paused guest (a bad hello was a
/// non-recoverable error); and a source whose recovery met a peer that answered its hello and
/// then said nothing waited for ever (the Missing list was read without a deadline). Both sides
/// must stay paused, count the strangers, and recover afterwards.
#[test]
fn regression_strangers_on_a_recovery_listener_and_a_mute_recovery_peer_leave_both_sides_paused() {
    recover_run(false, true);
}

fn recover_run(preempt: bool, hostile: bool) {
    let size = 2 * 16 * MIB;
    // With the preempt connection, precopy lands through the guest's mapping: postcopy then
    // runs over the memory the destination holds (minor faults) across the recovery.
    let landing = match preempt {
        true => PageLanding::Mapping,
        false => PageLanding::File,
    };
    let mut src = FakeVm::new(size, 2);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 0x2ec,
        zero_percent: 10,
        interval: Duration::ZERO,
    });
    let mut dst = FakeVm::new(size, 2);
    dst.landing = landing;
    dst.start_writers_on_resume(Writers {
        threads: 1,
        seed: 0xd57,
        zero_percent: 10,
        interval: Duration::from_millis(20),
    });
    // Slow enough (32 MiB at 20 MB/s) that postcopy is still sending when it is broken.
    let params = SourceParams {
        max_bandwidth: Some(20_000_000),
        mode: Mode::Postcopy(Postcopy {
            after_passes: Some(1),
            preempt: Preempt::urgent_when(preempt),
            recover: true,
            ..Postcopy::default()
        }),
        channels: 2,
        // Short, so that a mute recovery peer is given up on quickly.
        peer_timeout: Some(Duration::from_secs(3)),
        ..SourceParams::new(
            Policy {
                downtime_limit: Duration::from_micros(1),
                auto_converge: None,
                ..Policy::default()
            },
            [0x5e; 16],
        )
    };
    // The limit holds for the whole migration: pass 1 takes ~1.6 s and postcopy as long.
    let (first, _) = listener();
    let addr = first.local_addr().unwrap();
    let source_control = Control::default();
    let dest_control = Arc::new(IncomingControl::default());
    let (sent, received) = std::thread::scope(|s| {
        let (sender, receiver) = spawn_pair(
            s,
            (&mut src, &mut dst),
            (&first, addr),
            &params,
            (&source_control, dest_control.clone()),
        );
        let state = || {
            let (s, d) = (source_control.progress(), dest_control.progress());
            format!(
                "source {:?} ({} recoveries) {:?}; destination {:?} {:?}",
                s.phase, s.recoveries, s.error, d.phase, d.error
            )
        };
        let paused_both = || {
            wait_until(
                "both sides paused",
                || {
                    source_control.progress().phase == Phase::PostcopyPaused
                        && dest_control.progress().phase == IncomingPhase::PostcopyPaused
                },
                state,
            )
        };
        let running_both = |n: u32| {
            wait_until(
                "both sides in postcopy again",
                || {
                    source_control.progress().phase == Phase::Postcopy
                        && source_control.progress().recoveries == n
                        && dest_control.progress().phase == IncomingPhase::Postcopy
                },
                state,
            )
        };
        // 1. A pause on the source breaks every connection.
        wait_until(
            "postcopy",
            || source_control.progress().phase == Phase::Postcopy,
            state,
        );
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            source_control.pause_postcopy(),
            "a migration in postcopy with recovery pauses"
        );
        paused_both();
        let (l2, a2) = listener();
        dest_control.recover_on(Box::new(l2));
        source_control.resume_postcopy(a2);
        running_both(1);
        // 2. A pause on the destination, then a recovery that fails: the source is sent to
        //    a "proxy" that drops the connection at once; both stay paused.
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            dest_control.pause_postcopy(),
            "a migration in postcopy with recovery pauses"
        );
        paused_both();
        let (dropper, dropper_addr) = listener();
        let dropping = s.spawn(move || drop(dropper.accept()));
        source_control.resume_postcopy(dropper_addr);
        dropping.join().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        paused_both();
        // 3. A later recovery still works.
        let (l3, a3) = listener();
        let l3_addr = l3.local_addr().unwrap();
        dest_control.recover_on(Box::new(l3));
        if hostile {
            // Strangers on the recovery listener: dropped and counted, the guest waits on.
            let rejected = dest_control.progress().rejected_connections;
            let mut http = TcpStream::connect(l3_addr).unwrap();
            http.write_all(format!("{:<64}", "GET / HTTP/1.1\r\nHost: ferry\r\n").as_bytes())
                .unwrap();
            let mut garbage = TcpStream::connect(l3_addr).unwrap();
            garbage.write_all(&[0xa5; 64]).unwrap();
            let silent = TcpStream::connect(l3_addr).unwrap();
            drop(silent);
            let mut other = TcpStream::connect(l3_addr).unwrap();
            other.write_all(&[0u8; 3]).unwrap();
            drop(other);
            wait_until(
                "the strangers dropped and counted",
                || dest_control.progress().rejected_connections >= rejected + 4,
                state,
            );
            assert_eq!(
                dest_control.progress().phase,
                IncomingPhase::PostcopyPaused,
                "{}",
                state()
            );
            // A peer that answers the source's recovery hello and then says nothing.
            let (mute, mute_addr) = listener();
            let muting = s.spawn(move || {
                let (mut c, _) = mute.accept().unwrap();
                let mut hello = [0u8; 64];
                c.read_exact(&mut hello).unwrap();
                // The source's own hello, status 0: accepted.
                c.write_all(&hello).unwrap();
                let mut rest = Vec::new();
                let _ = c.read_to_end(&mut rest); // until the source gives up
            });
            let gave_up_before = Instant::now();
            source_control.resume_postcopy(mute_addr);
            muting.join().unwrap();
            eprintln!(
                "the source gave up on the mute peer after {:?}",
                gave_up_before.elapsed()
            );
            wait_until(
                "the source paused again",
                || {
                    source_control
                        .progress()
                        .error
                        .is_some_and(|e| e.contains("what the destination lacks"))
                },
                state,
            );
            paused_both();
        }
        source_control.resume_postcopy(a3);
        (sender.join().unwrap(), receiver.join().unwrap())
    });
    let sent = sent.expect("the source completes after the recoveries");
    let received = received.expect("the destination completes after the recoveries");
    let pc = sent.postcopy.clone().expect("postcopy ran");
    assert_eq!(pc.recoveries, 2, "{pc:?}");
    assert!(pc.paused_ms > 0.0);
    let rpc = received.postcopy.clone().expect("postcopy here");
    assert_eq!(rpc.recoveries, 2);
    assert_eq!(dst.abandoned, None);
    assert_eq!(dst.state, src.state);
    let compared = dst.assert_holds_the_last_version_of(&src);
    let pages = (size / PAGE as u64) as usize;
    assert!(
        compared > pages / 4,
        "{compared} of {pages} pages compared (preempt {preempt})"
    );
}

/// A destination that falls silent once every page is sent (a stopped process keeps its
/// sockets open and its kernel answers keepalives) kept the source waiting 60 s for its Done,
/// whatever the operator's peer timeout: a test that stopped a destination at that moment
/// waited for the source's pause in vain. The source must pause within its peer timeout.
#[test]
fn regression_a_destination_silent_after_the_last_page_pauses_the_source_within_its_peer_timeout() {
    use ferry_migrate::wire::Kind;
    use ferry_migrate_testkit::proxy::{Direction, Proxy};

    let size = 2 * 8 * MIB;
    let mut src = FakeVm::new(size, 2);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 0x51e,
        zero_percent: 10,
        interval: Duration::ZERO,
    });
    let mut dst = FakeVm::new(size, 2);
    dst.start_writers_on_resume(Writers {
        threads: 1,
        seed: 0xd57,
        zero_percent: 10,
        interval: Duration::from_millis(20),
    });
    let peer_timeout = Duration::from_secs(1);
    let params = SourceParams {
        mode: Mode::Postcopy(Postcopy {
            after_passes: Some(1),
            recover: true,
            ..Postcopy::default()
        }),
        channels: 2,
        peer_timeout: Some(peer_timeout),
        ..SourceParams::new(
            Policy {
                downtime_limit: Duration::from_micros(1),
                auto_converge: None,
                ..Policy::default()
            },
            [0x5e; 16],
        )
    };
    let (l, _) = listener();
    let proxy = Proxy::start(&l.local_addr().unwrap().to_string(), u64::MAX);
    // Every page goes through; the destination's Done (and all after it) is held.
    proxy.hold_at(Direction::ToSource, Kind::Done);
    let via: std::net::SocketAddr = proxy.address().parse().unwrap();
    let source_control = Control::default();
    let dest_control = Arc::new(IncomingControl::default());
    let (sent, received, waited) = std::thread::scope(|s| {
        let (sender, receiver) = spawn_pair(
            s,
            (&mut src, &mut dst),
            (&l, via),
            &params,
            (&source_control, dest_control.clone()),
        );
        let state = || {
            let (s, d) = (source_control.progress(), dest_control.progress());
            format!(
                "source {:?} {:?}; destination {:?} {:?}",
                s.phase, s.error, d.phase, d.error
            )
        };
        assert!(
            proxy.wait_struck(Duration::from_secs(30)),
            "the destination never sent Done: {}",
            state()
        );
        let held = Instant::now();
        while source_control.progress().phase != Phase::PostcopyPaused
            && held.elapsed() < Duration::from_secs(30)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let waited = held.elapsed();
        let at = state();
        // Ends a source still waiting too, so that a failure below is not a hang.
        source_control.give_up();
        (
            sender.join().unwrap(),
            receiver.join().unwrap(),
            (waited, at),
        )
    });
    let (waited, at) = waited;
    eprintln!(
        "the source paused {waited:?} after the Done was held (peer timeout {peer_timeout:?})"
    );
    assert!(
        waited < Duration::from_secs(30),
        "the source did not pause within 30 s: {at}"
    );
    assert!(sent.is_err(), "a source given up on does not complete");
    received.expect("the destination installed every page and said Done");
    assert_eq!(dst.state, src.state);
    dst.assert_holds_the_last_version_of(&src);
}
