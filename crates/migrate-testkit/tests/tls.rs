//! Migrations over mutual TLS, over the fake VMM on real loopback TCP: every connection of a
//! postcopy migration with its preempt connection runs TLS, and peers that fail a check are
//! refused before any migration byte is read while the destination waits on, untouched.

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_migrate::destination::{self, IncomingControl, IncomingPhase};
use ferry_migrate::source::{self, Mode, Postcopy, Preempt, SourceParams};
use ferry_migrate::transport::tls::pki::Ca;
use ferry_migrate::transport::tls::{DestinationTls, Side, SourceTls, TlsFiles};
use ferry_migrate::transport::{Address, Dialer, Listener};
use ferry_migrate::{Control, MigrateError, Policy, TimeoutAction};
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(5);

fn names(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

fn params(channels: u16, postcopy: bool) -> SourceParams {
    let policy = Policy {
        downtime_limit: if postcopy {
            Duration::from_micros(1)
        } else {
            Duration::from_millis(300)
        },
        timeout: Some(Duration::from_secs(60)),
        timeout_action: TimeoutAction::Switchover,
        ..Policy::default()
    };
    SourceParams {
        channels,
        mode: if postcopy {
            Mode::Postcopy(Postcopy {
                after_passes: Some(1),
                preempt: Preempt::Urgent,
                ..Postcopy::default()
            })
        } else {
            Mode::Precopy
        },
        ..SourceParams::new(policy, [5; 16])
    }
}

/// Cancels a waiting destination when a check fails while it listens.
struct CancelOnPanic<'a>(&'a IncomingControl);

impl Drop for CancelOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.cancel();
        }
    }
}

fn writing_source(size: u64) -> FakeVm {
    let mut src = FakeVm::new(size, 2);
    src.fill(3);
    src.start_writers(Writers {
        threads: 2,
        seed: 0x7157,
        zero_percent: 20,
        interval: Duration::from_micros(200),
    });
    src
}

/// A TLS listener on loopback for the destination's files in `dir`.
fn tls_listener(dir: &Path, allow: &[String]) -> (Box<dyn Listener>, Address) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = Address::Tcp(l.local_addr().unwrap().to_string());
    let tls = DestinationTls::new(&TlsFiles::in_dir(dir, Side::Destination), allow).unwrap();
    (Arc::new(tls).listener(Box::new(l)), at)
}

fn dialer(dir: &Path, at: &Address) -> Dialer {
    let tls = SourceTls::new(&TlsFiles::in_dir(dir, Side::Source), None).unwrap();
    Dialer::new(at.clone(), Some(Arc::new(tls))).unwrap()
}

fn migrate_through(
    src: &mut FakeVm,
    dialer: &Dialer,
    p: &SourceParams,
) -> Result<ferry_migrate::MigrationStats, MigrateError> {
    let main = dialer.connect(WAIT).map_err(MigrateError::from)?;
    let connect = || dialer.connect(WAIT).map_err(std::io::Error::other);
    source::migrate(src, main, &connect, p, &Control::default())
}

#[test]
fn a_postcopy_migration_with_its_preempt_connection_runs_every_connection_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    Ca::new("ferry test CA")
        .unwrap()
        .write_dir(dir.path(), &names(&["127.0.0.1"]), &names(&["source.test"]))
        .unwrap();
    let (listener, at) = tls_listener(dir.path(), &names(&["source.test"]));
    let size = 16 * MIB;
    let mut src = writing_source(size);
    let mut dst = FakeVm::new(size, 2);
    // The destination's guest runs at the resume and faults on pages still at the source.
    dst.start_writers_on_resume(Writers {
        threads: 1,
        seed: 0xd57,
        zero_percent: 10,
        interval: Duration::from_millis(20),
    });
    let control = Arc::new(IncomingControl::default());
    let dialer = dialer(dir.path(), &at);
    let (sent, received) = std::thread::scope(|s| {
        let d = s.spawn(|| destination::listen(&mut dst, listener.as_ref(), &control, &|| true));
        let sent = migrate_through(&mut src, &dialer, &params(4, true));
        (sent, d.join().unwrap())
    });
    let sent = sent.expect("the source's side");
    let received = received.expect("the destination's side");
    assert!(sent.postcopy.is_some(), "the migration went to postcopy");
    assert!(received.postcopy.is_some());
    assert_eq!(control.progress().rejected_connections, 0);
    assert!(dst.resumed);
    assert_eq!(dst.state, src.state, "device state moved");
    let compared = dst.assert_holds_the_last_version_of(&src);
    assert!(compared > 0);
}

#[test]
fn refused_peers_leave_the_destination_waiting_untouched_and_a_good_source_then_migrates() {
    let (dir, foreign) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ca = Ca::new("ferry test CA").unwrap();
    ca.write_dir(dir.path(), &names(&["127.0.0.1"]), &names(&["source.test"]))
        .unwrap();
    // Signed by the right CA, but for a name the destination does not allow.
    ca.write_dir(
        foreign.path(),
        &names(&["127.0.0.1"]),
        &names(&["intruder.test"]),
    )
    .unwrap();
    let (listener, at) = tls_listener(dir.path(), &names(&["source.test"]));
    let size = 8 * MIB;
    let mut src = writing_source(size);
    let mut dst = FakeVm::new(size, 2);
    let before = dst.contents();
    let control = Arc::new(IncomingControl::default());
    let p = params(2, false);
    let refusal = |control: &IncomingControl, count: u64| {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let pr = control.progress();
            if pr.rejected_connections >= count {
                assert_eq!(pr.phase, IncomingPhase::Waiting, "{pr:?}");
                return pr.last_rejection.unwrap_or_default();
            }
            assert!(std::time::Instant::now() < deadline, "{pr:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let (sent, received, phase_after_refusals) = std::thread::scope(|s| {
        let d = s.spawn(|| destination::listen(&mut dst, listener.as_ref(), &control, &|| true));
        // A failed check below must not leave the destination waiting forever.
        let _cancel = CancelOnPanic(&control);

        // A plaintext source: refused at its first byte.
        let plain: Dialer = at.clone().into();
        let e = migrate_through(&mut src, &plain, &p)
            .unwrap_err()
            .to_string();
        let why = refusal(&control, 1);
        assert!(why.contains("sent plaintext, not TLS"), "{why}");
        assert!(e.contains("requires TLS"), "{e}");

        // A source whose certificate's name is not allowed.
        let e = migrate_through(&mut src, &dialer(foreign.path(), &at), &p)
            .unwrap_err()
            .to_string();
        let why = refusal(&control, 2);
        assert!(
            why.contains(
                "carries intruder.test, none of the names this destination allows (source.test)"
            ),
            "{why}"
        );
        assert!(
            e.contains("the destination refused this source's TLS"),
            "{e}"
        );
        assert!(!src.is_paused(), "a refused source keeps running");
        let phase_after_refusals = control.progress().phase;

        let sent = migrate_through(&mut src, &dialer(dir.path(), &at), &p);
        (sent, d.join().unwrap(), phase_after_refusals)
    });
    assert_eq!(phase_after_refusals, IncomingPhase::Waiting);
    sent.expect("the good source's migration");
    received.expect("the destination's side");
    assert_ne!(dst.contents(), before, "the good source's pages arrived");
    assert_eq!(control.progress().rejected_connections, 2);
    assert!(src.is_paused());
    assert!(
        dst.contents() == src.contents(),
        "every page in its last version"
    );
}
