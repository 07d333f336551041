//! A local handover gives guest RAM only to its owner (issue 48, item 2), over the fake VMM
//! with real Unix sockets and a real process of another uid (`nobody`, the test binary started
//! again by `stranger`; as root only, else each test says it skipped).
//!
//! What each proves: the source reads the destination's uid from the socket and refuses a
//! stranger before any descriptor is sent (the thief gets none and writes nothing, the guest
//! runs on untouched); the destination refuses a stranger source before it maps anything; the
//! default 0600 socket keeps a stranger from even connecting. Each has its control: with the
//! stranger's uid allowed, the same stranger does get the memory, so the test can see it.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry_migrate::destination::{self, IncomingControl, ReceiveStats};
use ferry_migrate::source::{self, SourceParams};
use ferry_migrate::transport::{Address, LocalPeerError, PeerRole};
use ferry_migrate::{Control, MigrateError, Policy};
use ferry_migrate_testkit::FakeVm;
use ferry_migrate_testkit::stranger::{self, NOBODY, Role, THIEF_BYTE, THIEF_PAGES};

const MIB: u64 = 1 << 20;
const GUEST: u64 = 16 * MIB;

/// The process started as a stranger runs this test, which plays its role.
#[test]
fn stranger_hook() {
    stranger::serve_if_asked();
}

fn params() -> SourceParams {
    let mut p = SourceParams::new(Policy::default(), [3; 16]);
    p.mode = ferry_migrate::source::Mode::Local;
    p.peer_timeout = Some(Duration::from_secs(10));
    p
}

/// A directory a stranger can look into (0755) and, with `owner`, make its socket in.
fn shared_dir(owner: Option<u32>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    if let Some(uid) = owner {
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid)).unwrap();
    }
    dir
}

/// Hands `src` over locally to a thief of uid `nobody` with `p`; the thief's report.
fn hand_over_to_a_thief(
    src: &mut FakeVm,
    p: &SourceParams,
) -> Option<(
    Result<ferry_migrate::MigrationStats, MigrateError>,
    stranger::Report,
)> {
    let dir = shared_dir(Some(NOBODY));
    let path = dir.path().join("thief.sock");
    let mut thief = stranger::spawn(Role::Thief, &path)?;
    thief.wait_for("listening");
    let stream = UnixStream::connect(&path).unwrap();
    let connect = || -> std::io::Result<UnixStream> { panic!("a local handover reconnected") };
    let sent = source::migrate(src, stream, &connect, p, &Control::default());
    Some((sent, thief.report()))
}

/// `e` is the source's refusal of a destination of uid `nobody`.
fn assert_refused_as_a_stranger_who_takes(e: &MigrateError) {
    assert!(
        matches!(
            e,
            MigrateError::LocalPeer(LocalPeerError::Stranger {
                role: PeerRole::Takes,
                uid: NOBODY,
                ..
            })
        ),
        "{e}"
    );
}

#[test]
fn a_destination_of_another_uid_gets_no_descriptor_and_writes_no_guest_page() {
    let mut src = FakeVm::new(GUEST, 1);
    src.fill(3);
    let before = src.contents();
    let Some((sent, thief)) = hand_over_to_a_thief(&mut src, &params()) else {
        return;
    };
    println!("guest pages written by strangers: {}", thief.pages_written);
    println!("descriptors given to another uid: {}", thief.descriptors);
    assert_eq!(
        (thief.descriptors, thief.pages_written),
        (0, 0),
        "{thief:?}"
    );
    assert_eq!(src.contents(), before, "the guest's memory is untouched");
    let e = sent.expect_err("a stranger is refused");
    assert_refused_as_a_stranger_who_takes(&e);
    let said = e.to_string();
    assert!(
        said.contains("pass --allow-uid 65534 if this is deliberate"),
        "{said}"
    );
    assert!(!src.is_paused(), "the guest runs on at the source");

    // The control: the same thief, its uid allowed, gets the memory and writes into it, and
    // the guest finds its pages (the bug as reproduced); so the zeros above are the check's.
    let mut p = params();
    p.allow_uids = vec![NOBODY];
    let (sent, thief) = hand_over_to_a_thief(&mut src, &p).expect("root still");
    let e = sent.expect_err("the thief answered Error");
    assert!(matches!(e, MigrateError::Remote(..)), "{e}");
    assert!(thief.descriptors >= 1, "{thief:?}");
    assert_eq!(thief.pages_written, THIEF_PAGES, "{thief:?}");
    let after = src.contents();
    let stolen = (THIEF_PAGES * 4096) as usize;
    assert!(after[..stolen].iter().all(|&b| b == THIEF_BYTE));
    assert_eq!(after[stolen..], before[stolen..]);
}

/// Issue 48 (review): a migration that copies guest RAM over a Unix socket (no `local`) to a
/// listener of another uid is refused after the hello, as a handover is: not a page goes.
#[test]
fn a_copying_migration_to_a_listener_of_another_uid_is_refused_before_any_page() {
    let mut src = FakeVm::new(GUEST, 1);
    src.fill(3);
    let mut p = params();
    p.mode = ferry_migrate::source::Mode::Precopy;
    let Some((sent, thief)) = hand_over_to_a_thief(&mut src, &p) else {
        return;
    };
    let e = sent.expect_err("a stranger is refused");
    assert_refused_as_a_stranger_who_takes(&e);
    assert_eq!(
        (thief.descriptors, thief.pages_written),
        (0, 0),
        "{thief:?}"
    );
    assert!(!src.is_paused() && !src.is_logging(), "nothing started");
}

/// Waits on `listener` for the stranger's handover into `dst`, until the stranger ended (and
/// a little more, for a connection it made just before).
fn receive_from_a_stranger(
    dst: &mut FakeVm,
    listener: &dyn ferry_migrate::transport::Listener,
    control: &Arc<IncomingControl>,
    path: &Path,
) -> Option<(Result<ReceiveStats, MigrateError>, stranger::Report)> {
    let source = stranger::spawn(Role::Source { memory: GUEST }, path)?;
    let ended = AtomicBool::new(false);
    let ended_at = std::sync::Mutex::new(None::<Instant>);
    std::thread::scope(|s| {
        let report = s.spawn(|| {
            let r = source.report();
            *ended_at.lock().unwrap() = Some(Instant::now());
            ended.store(true, Ordering::Release);
            r
        });
        let keep_waiting = || {
            !ended.load(Ordering::Acquire)
                || ended_at
                    .lock()
                    .unwrap()
                    .is_some_and(|t| t.elapsed() < Duration::from_millis(500))
        };
        let received = destination::listen(dst, listener, control, &keep_waiting);
        Some((received, report.join().unwrap()))
    })
}

#[test]
fn a_source_of_another_uid_is_refused_before_its_memory_is_mapped() {
    let dir = shared_dir(None);
    let at = Address::Unix(dir.path().join("in.sock"));
    // Deliberately loose (`--incoming-socket-mode 666`), so that the stranger can connect and
    // the destination's own check is what stops it.
    let listener = at.listen_with_mode(0o666).unwrap();
    let mut dst = FakeVm::new(GUEST, 1);
    let before = dst.contents();
    let control = Arc::new(IncomingControl::default());
    let path = dir.path().join("in.sock");
    let Some((received, source)) = receive_from_a_stranger(&mut dst, &*listener, &control, &path)
    else {
        return;
    };
    assert_eq!(source.connect_error, None, "the socket is 0666");
    let e = received.expect_err("a stranger source is refused");
    assert!(
        matches!(
            e,
            MigrateError::LocalPeer(LocalPeerError::Stranger {
                role: PeerRole::Gives,
                uid: NOBODY,
                ..
            })
        ),
        "{e}"
    );
    let told = source.result.unwrap_or_default();
    assert!(told.contains("refused to take guest RAM"), "{told}");
    assert!(!dst.resumed);
    assert_eq!(
        dst.contents(),
        before,
        "the stranger's memory was not mapped"
    );
    println!("descriptors taken from another uid: 0");
    drop(listener);

    // The control: its uid allowed, the same stranger's guest is taken, memory and all.
    let at = Address::Unix(dir.path().join("in2.sock"));
    let listener = at.listen_with_mode(0o666).unwrap();
    let mut dst = FakeVm::new(GUEST, 1);
    let control = Arc::new(IncomingControl::default());
    control.set_allow_uids(vec![NOBODY]);
    let path = dir.path().join("in2.sock");
    let (received, source) =
        receive_from_a_stranger(&mut dst, &*listener, &control, &path).expect("root still");
    received.expect("an allowed uid hands over");
    assert_eq!(source.result.as_deref(), Some("ok"));
    assert!(dst.resumed);
    let theirs = FakeVm::new(GUEST, 1);
    theirs.fill(stranger::SOURCE_FILL);
    assert_eq!(
        dst.contents(),
        theirs.contents(),
        "the stranger's memory is mapped"
    );
}

#[test]
fn a_source_of_another_uid_cannot_use_a_default_incoming_socket() {
    let dir = shared_dir(None);
    let path = dir.path().join("in.sock");
    let listener = Address::Unix(path.clone()).listen().unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut dst = FakeVm::new(GUEST, 1);
    let before = dst.contents();
    let control = Arc::new(IncomingControl::default());
    let Some((received, source)) = receive_from_a_stranger(&mut dst, &*listener, &control, &path)
    else {
        return;
    };
    // Either it could not even connect (the socket is 0600 and it is not root), or it did and
    // was refused by its uid; both mean no descriptor of it was taken.
    match &source.connect_error {
        Some(why) => {
            assert!(why.contains("ermission denied"), "{why}");
            let e = received.expect_err("nobody came");
            assert!(e.to_string().contains("gave up waiting"), "{e}");
        }
        None => {
            let e = received.expect_err("refused");
            assert!(matches!(e, MigrateError::LocalPeer(_)), "{e}");
        }
    }
    assert!(!dst.resumed);
    assert_eq!(dst.contents(), before);
    println!("descriptors taken from another uid: 0");
}
