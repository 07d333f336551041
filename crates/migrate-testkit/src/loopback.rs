//! A migration between two fake VMs over real loopback TCP, as the engine tests run it: the
//! destination on a thread of its own, accepting its data channels from the same listener.
//! [`migrate_into_slow`] makes the destination's data channels take data in at a bounded rate
//! (a destination still digesting pass 1 when the source pauses its guest).

#![forbid(unsafe_code)]

use std::io::{IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ferry_migrate::destination::{self, ReceiveStats};
use ferry_migrate::source::{self, SourceParams, TestHooks};
use ferry_migrate::transport::Stream;
use ferry_migrate::wire::Role;
use ferry_migrate::{Control, MigrateError, MigrationStats, SourceVm};

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

/// A connection whose reads are paced to `rate` bytes per second from its first read on, and
/// that may change one byte on the way in, as a faulty link would.
#[derive(Debug)]
pub struct Slow {
    inner: TcpStream,
    rate: u64,
    /// When the first read happened, and the bytes read since.
    since: Option<(Instant, u64)>,
    /// The offset of the byte read to flip (its bit 4), if any.
    flip_at: Option<u64>,
}

impl Slow {
    pub fn new(inner: TcpStream, rate: u64) -> Slow {
        Slow {
            inner,
            rate,
            since: None,
            flip_at: None,
        }
    }

    /// A connection at full speed whose byte `at` (counted from its first) arrives changed.
    pub fn flipping(inner: TcpStream, at: u64) -> Slow {
        Slow {
            flip_at: Some(at),
            ..Slow::new(inner, u64::MAX)
        }
    }

    /// Counts `n` bytes read (flipping the chosen one among them) and sleeps until they are
    /// within the rate.
    fn pace(&mut self, bufs: &mut [IoSliceMut<'_>], n: usize) {
        let (start, bytes) = self.since.get_or_insert((Instant::now(), 0));
        if let Some(at) = self.flip_at
            && (*bytes..*bytes + n as u64).contains(&at)
        {
            let mut k = (at - *bytes) as usize;
            for b in bufs.iter_mut() {
                if k < b.len() {
                    b[k] ^= 0x10;
                    break;
                }
                k -= b.len();
            }
        }
        *bytes += n as u64;
        let due = *start + Duration::from_secs_f64(*bytes as f64 / self.rate as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}

impl Read for Slow {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pace(&mut [IoSliceMut::new(buf)], n);
        Ok(n)
    }

    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> std::io::Result<usize> {
        let n = self.inner.read_vectored(bufs)?;
        self.pace(bufs, n);
        Ok(n)
    }
}

impl Write for Slow {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl Stream for Slow {
    /// The clone is not paced: the engine clones to write, shut down, or (the main connection)
    /// to read its few records.
    fn try_clone_stream(&self) -> std::io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.inner.try_clone()?))
    }
    fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        self.inner.shutdown(how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.inner.set_read_timeout(timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.inner.set_write_timeout(timeout)
    }
    fn peer(&self) -> String {
        "tcp:(slow loopback)".into()
    }
    fn set_low_latency(&self) -> std::io::Result<()> {
        self.inner.set_nodelay(true)
    }
    fn set_urgent(&self) -> std::io::Result<()> {
        ferry_migrate::transport::Stream::set_urgent(&self.inner)
    }
}

/// Migrates `src` into `dst` over loopback, with each of the destination's data channels
/// reading at most `rate` bytes per second; returns both sides' results.
pub fn migrate_into_slow(
    src: &mut FakeVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    control: &Control,
    rate: u64,
) -> (
    Result<MigrationStats, MigrateError>,
    Result<ReceiveStats, MigrateError>,
) {
    let wrap = |s: TcpStream, role: Role| match role {
        Role::Main => Slow::new(s, u64::MAX),
        _ => Slow::new(s, rate),
    };
    over_loopback(src, dst, p, control, &TestHooks::default(), wrap)
}

/// Migrates `src` into `dst` over loopback with byte `at` of the destination's connection
/// `role` changed on the way in (data: each data channel's); returns both sides' results.
pub fn migrate_flipping(
    src: &mut FakeVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    role: Role,
    at: u64,
) -> (
    Result<MigrationStats, MigrateError>,
    Result<ReceiveStats, MigrateError>,
) {
    let wrap = |s: TcpStream, r: Role| match r == role {
        true => Slow::flipping(s, at),
        false => Slow::new(s, u64::MAX),
    };
    over_loopback(
        src,
        dst,
        p,
        &Control::default(),
        &TestHooks::default(),
        wrap,
    )
}

/// Migrates `src` into `dst` over loopback; returns both sides' results.
pub fn migrate(
    src: &mut dyn SourceVm,
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
    src: &mut dyn SourceVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    control: &Control,
    hooks: &TestHooks,
) -> (
    Result<MigrationStats, MigrateError>,
    Result<ReceiveStats, MigrateError>,
) {
    over_loopback(src, dst, p, control, hooks, |s, _| s)
}

/// A whole migration over loopback TCP, the destination's connections (main, then data)
/// wrapped by `wrap`.
fn over_loopback<S: Stream + 'static>(
    src: &mut dyn SourceVm,
    dst: &mut FakeVm,
    p: &SourceParams,
    control: &Control,
    hooks: &TestHooks,
    wrap: impl Fn(TcpStream, Role) -> S + Sync,
) -> (
    Result<MigrationStats, MigrateError>,
    Result<ReceiveStats, MigrateError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let main = wrap(listener.accept().unwrap().0, Role::Main);
            let mut accept = acceptor(&listener);
            let mut data = |deadline| accept(deadline).map(|s| wrap(s, Role::Data));
            destination::receive(dst, main, &mut data)
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

/// A crafted migration fed to a destination of 8 MiB in one region landing pages `landing`:
/// the main connection's bytes, then each data connection's (each connection opened in order
/// and written whole). The destination's error, which it must end with.
pub fn feed(main: &[u8], data: &[Vec<u8>], landing: ferry_migrate::PageLanding) -> String {
    feed_vm(main, data, landing).0
}

/// [`feed`], also returning the destination VM.
pub fn feed_vm(
    main: &[u8],
    data: &[Vec<u8>],
    landing: ferry_migrate::PageLanding,
) -> (String, FakeVm) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut dst = FakeVm::new(8 << 20, 1);
    dst.landing = landing;
    let error = std::thread::scope(|s| {
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
            let _ = c.shutdown(Shutdown::Write);
        }
        let r = receiver.join().unwrap();
        r.expect_err("a bad stream must be refused").to_string()
    });
    (error, dst)
}
