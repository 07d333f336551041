//! Writes the fuzzer's seed corpus: real migrations between two fake VMs over loopback TCP,
//! with every byte the source sent recorded per connection, as inputs of the `incoming`
//! target (`fuzz::Streams`) and, record by record, of the `wire` target.
//!
//! `cargo run -p ferry-migrate-testkit --example fuzz-seeds -- fuzz/corpus`

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_migrate::destination;
use ferry_migrate::source::{self, SourceParams};
use ferry_migrate::transport::Stream;
use ferry_migrate::wire::{HEADER_SIZE, HELLO_SIZE, Header};
use ferry_migrate::{Control, Policy, TimeoutAction};
use ferry_migrate_testkit::fuzz::{MEMORY, REGIONS, Streams};
use ferry_migrate_testkit::loopback::acceptor;
use ferry_migrate_testkit::{FakeVm, Writers};

/// A TCP connection that keeps a copy of what is written to it.
#[derive(Debug)]
struct Recorded {
    inner: TcpStream,
    sent: Arc<Mutex<Vec<u8>>>,
}

impl Read for Recorded {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        self.inner.read(b)
    }
}

impl Write for Recorded {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(b)?;
        self.sent.lock().unwrap().extend_from_slice(&b[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Stream for Recorded {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(Recorded {
            inner: self.inner.try_clone()?,
            sent: self.sent.clone(),
        }))
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.inner.shutdown(how)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.inner.set_read_timeout(t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.inner.set_write_timeout(t)
    }
    fn peer(&self) -> String {
        "recorded".into()
    }
    fn set_low_latency(&self) -> io::Result<()> {
        self.inner.set_nodelay(true)
    }
    fn set_urgent(&self) -> io::Result<()> {
        Ok(())
    }
}

/// What one recorded connection sent.
type Sent = Arc<Mutex<Vec<u8>>>;

/// One migration with `channels` data channels; a source whose writers dirty pages while it
/// runs makes several passes.
fn record(channels: u16, writing: bool, stride: u64, checksum_pages: bool) -> Streams {
    let mut src = FakeVm::new(MEMORY, REGIONS);
    src.fill(stride);
    if writing {
        src.start_writers(Writers {
            threads: 1,
            seed: 11,
            zero_percent: 30,
            interval: Duration::from_millis(10),
        });
    }
    let mut dst = FakeVm::new(MEMORY, REGIONS);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let conns: Mutex<Vec<Sent>> = Mutex::default();
    let connect = || -> io::Result<Recorded> {
        let sent = Arc::new(Mutex::new(Vec::new()));
        conns.lock().unwrap().push(sent.clone());
        Ok(Recorded {
            inner: TcpStream::connect(addr)?,
            sent,
        })
    };
    let policy = Policy {
        downtime_limit: Duration::from_millis(if writing { 1 } else { 300 }),
        timeout: Some(Duration::from_millis(15)),
        timeout_action: TimeoutAction::Switchover,
        ..Policy::default()
    };
    let params = SourceParams {
        channels,
        checksum_pages,
        ..SourceParams::new(policy, [3; 16])
    };
    std::thread::scope(|s| {
        let d = s.spawn(|| {
            let (main, _) = listener.accept().unwrap();
            destination::receive(&mut dst, main, &mut acceptor(&listener))
        });
        let main = connect().unwrap();
        source::migrate(&mut src, main, &connect, &params, &Control::default())
            .expect("the recorded migration");
        d.join().unwrap().expect("the destination");
    });
    let conns = conns.lock().unwrap();
    let bytes: Vec<Vec<u8>> = conns.iter().map(|c| c.lock().unwrap().clone()).collect();
    Streams {
        main: bytes[0].clone(),
        data: bytes[1..].to_vec(),
        reseal: false,
    }
}

/// Each hello and each record of `stream`, as inputs of the wire target.
fn records(stream: &[u8]) -> Vec<Vec<u8>> {
    let mut out = vec![stream[..HELLO_SIZE.min(stream.len())].to_vec()];
    let mut at = HELLO_SIZE;
    while let Some(raw) = stream.get(at..at + HEADER_SIZE) {
        let Ok(h) = Header::decode(raw.try_into().unwrap()) else {
            break;
        };
        let end = (at + HEADER_SIZE + h.len as usize).min(stream.len());
        // A page record's data is the same 4 KiB blocks over and over: its first page is
        // enough for the wire target.
        out.push(stream[at..end.min(at + HEADER_SIZE + 4096 + 512 * 8)].to_vec());
        at = end;
    }
    out
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn main() {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/corpus".into());
    let out = Path::new(&out);
    let runs = [
        ("one-channel-idle", record(1, false, 8, false)),
        ("one-channel-idle-page-checksums", record(1, false, 8, true)),
        ("two-channels-idle-sparse", record(2, false, 32, false)),
        ("two-channels-writing", record(2, true, 16, false)),
        (
            "four-channels-writing-page-checksums",
            record(4, true, 8, true),
        ),
    ];
    let mut wire_seeds = 0;
    for (name, streams) in &runs {
        write(&out.join("incoming"), name, &streams.encode());
        for (c, s) in std::iter::once(&streams.main)
            .chain(&streams.data)
            .enumerate()
        {
            for (i, r) in records(s).iter().enumerate() {
                write(&out.join("wire"), &format!("{name}-{c}-{i}"), r);
                wire_seeds += 1;
            }
        }
    }
    eprintln!(
        "wrote {} incoming seeds and {wire_seeds} wire seeds under {}",
        runs.len(),
        out.display()
    );
}
