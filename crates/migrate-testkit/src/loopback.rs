//! A migration between two fake VMs over real loopback TCP, as the engine tests run it: the
//! destination on a thread of its own, accepting its data channels from the same listener.

#![forbid(unsafe_code)]

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ferry_migrate::destination::{self, ReceiveStats};
use ferry_migrate::source::{self, SourceParams, TestHooks};
use ferry_migrate::{Control, MigrateError, MigrationStats};

use crate::FakeVm;

/// Longest an acceptor waits for a data channel: a loopback connect is immediate, so 2 s only
/// bounds a test whose source never connects (the engine's own bound is longer).
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Accepts data channels on `listener` until `deadline` (shortened to `ACCEPT_TIMEOUT`).
pub fn acceptor(listener: &TcpListener) -> impl FnMut(Instant) -> std::io::Result<TcpStream> + '_ {
    move |deadline: Instant| {
        listener.set_nonblocking(true)?;
        let deadline = deadline.min(Instant::now() + ACCEPT_TIMEOUT);
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
pub fn migrate(
    src: &mut FakeVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    control: &Control,
) -> (
    Result<MigrationStats, MigrateError>,
    Result<ReceiveStats, MigrateError>,
) {
    migrate_with_hooks(src, dst, p, control, &TestHooks::default())
}

/// [`migrate`] with faults injected into the source.
pub fn migrate_with_hooks(
    src: &mut FakeVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    control: &Control,
    hooks: &TestHooks,
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
        let sent = source::migrate_with_hooks(
            src,
            TcpStream::connect(addr).unwrap(),
            &connect,
            p,
            control,
            hooks,
        );
        (sent, receiver.join().unwrap())
    })
}
