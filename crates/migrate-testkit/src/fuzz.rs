//! The harness behind ferry's fuzz targets (`fuzz/`), kept here so that the regression tests
//! replay what the fuzzer found through the very same code under `cargo test`.
//!
//! - [`incoming`]: arbitrary bytes as the main connection and up to four data connections of
//!   a destination over the fake VMM. It must end with an error, or with a resumed guest whose
//!   memory is exactly what the data connections carried (each page in the version of the last
//!   pass that sent it, zero where nothing was sent) and whose state is the sections sent.
//! - [`wire()`]: arbitrary bytes through every decoder of the wire module; each must return an
//!   error or a value that encodes back to the same bytes where the format has one encoding.
//! - [`snapshot()`]: arbitrary bytes as a snapshot file ([`SnapshotInput`]) opened by the
//!   [`Reader`](ferry_migrate::snapshot::Reader), its data runs found and every page they hold
//!   read, and each hot run's ends: refused, or read whole where the input's checksums were
//!   resealed. Under libFuzzer's memory limit an input that makes the reader allocate for what
//!   the file does not hold is a crash.

use std::collections::BTreeMap;
use std::io::{self, Cursor, Read, Write};
use std::net::Shutdown;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_migrate::Section;
use ferry_migrate::destination;
use ferry_migrate::error::ErrorKind;
use ferry_migrate::transport::Stream;
use ferry_migrate::wire::{
    self, HEADER_SIZE, HELLO_SIZE, Header, Hello, Kind, PAGE_SIZE, SectionHeader,
};

use crate::FakeVm;

mod snapshot;
pub use snapshot::{SnapshotInput, SnapshotOutcome, snapshot};

/// The destination's RAM: 128 pages in two regions with a gap between them (the fake VMM's
/// dirty log wants whole 64-page words per region); seeds fill every 8th page or fewer, so
/// that an input carrying them stays near 100 KiB.
pub const MEMORY: u64 = 128 * PAGE_SIZE;
pub const REGIONS: usize = 2;
/// Data connections an input can carry (more would only dilute the search).
pub const MAX_DATA: usize = 4;

/// An input as the bytes of each connection: a count byte (its low 7 bits: data connections,
/// mod 5; its top bit: [`Streams::reseal`]), then each connection's bytes behind a u32
/// length, the last connection taking the rest.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Streams {
    pub main: Vec<u8>,
    pub data: Vec<Vec<u8>>,
    /// Rewrite every checksum to match the bytes before they are fed, so that the fuzzer's
    /// changes reach the checks behind the checksums (without it nearly every change is
    /// refused by a checksum, which the inputs without the bit exercise).
    pub reseal: bool,
}

impl Streams {
    pub fn decode(input: &[u8]) -> Streams {
        let Some((&first, mut rest)) = input.split_first() else {
            return Streams::default();
        };
        let reseal = first & 0x80 != 0;
        let n = usize::from(first & 0x7f) % (MAX_DATA + 1);
        let mut take = |last: bool| -> Vec<u8> {
            if last || rest.len() < 4 {
                return std::mem::take(&mut rest).to_vec();
            }
            let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            let body = &rest[4..];
            let len = len.min(body.len());
            let (got, left) = body.split_at(len);
            rest = left;
            got.to_vec()
        };
        let main = take(n == 0);
        let data = (0..n).map(|i| take(i + 1 == n)).collect();
        Streams { main, data, reseal }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.data.len() as u8 | if self.reseal { 0x80 } else { 0 }];
        let all: Vec<&Vec<u8>> = std::iter::once(&self.main).chain(&self.data).collect();
        for (i, s) in all.iter().enumerate() {
            if i + 1 < all.len() {
                v.extend_from_slice(&(s.len() as u32).to_le_bytes());
            }
            v.extend_from_slice(s);
        }
        v
    }
}

/// Whether the main connection's hello asks for page checksums (which a destination grants).
fn checksum_pages(main: &[u8]) -> bool {
    main.get(50..58).is_some_and(|c| {
        u64::from_le_bytes(c.try_into().unwrap()) & wire::Capabilities::CHECKSUM_PAGES.0 != 0
    })
}

/// Each whole record of a connection after its hello: where it starts, its header's kind,
/// count and length as the bytes say (unchecked), and whether its payload is all there.
fn frames(stream: &[u8]) -> Vec<(usize, u16, u32, u64)> {
    let mut out = Vec::new();
    let mut at = HELLO_SIZE;
    while let Some(h) = stream.get(at..at + HEADER_SIZE) {
        let kind = u16::from_le_bytes([h[0], h[1]]);
        let count = u32::from_le_bytes(h[4..8].try_into().unwrap());
        let len = u64::from_le_bytes(h[8..16].try_into().unwrap());
        out.push((at, kind, count, len));
        match (at + HEADER_SIZE).checked_add(len as usize) {
            Some(next) if next <= stream.len() && len <= 1 << 24 => at = next,
            _ => break,
        }
    }
    out
}

/// The bytes of a payload its checksum does not cover (the wire module's rule: a Pages
/// record's page data, unless page checksums are on).
fn uncovered(kind: u16, count: u32, len: u64, checksum_pages: bool) -> std::ops::Range<u64> {
    let covered = Header::new(Kind::from_u16(kind), count, len).covered(checksum_pages);
    covered.min(len)..len
}

/// Rewrites the hello's and every record's checksums of `stream` to match its bytes.
pub fn reseal(stream: &mut [u8], checksum_pages: bool) {
    if let Some(h) = stream.get_mut(..HELLO_SIZE) {
        wire::reseal_hello(h.try_into().unwrap());
    }
    for (at, kind, count, len) in frames(stream) {
        let body = at + HEADER_SIZE;
        // (The last header may claim any length: nothing past the stream is summed.)
        if let Some(payload) = body
            .checked_add(len as usize)
            .and_then(|end| stream.get(body..end))
        {
            let skip = uncovered(kind, count, len, checksum_pages);
            let crc = wire::crc(&payload[..skip.start as usize]);
            stream[at + 16..at + 20].copy_from_slice(&crc.to_le_bytes());
        }
        wire::reseal_header((&mut stream[at..at + HEADER_SIZE]).try_into().unwrap());
    }
}

/// Whether byte `at` of connection `conn` (0: main, k: data connection k) is under a checksum:
/// everything is but a Pages record's page data without page checksums.
pub fn covered(streams: &Streams, conn: usize, at: usize) -> bool {
    let stream = if conn == 0 {
        &streams.main
    } else {
        &streams.data[conn - 1]
    };
    let pages = checksum_pages(&streams.main);
    !frames(stream).iter().any(|&(start, kind, count, len)| {
        let skip = uncovered(kind, count, len, pages);
        let body = (start + HEADER_SIZE) as u64;
        let (from, to) = (
            body.saturating_add(skip.start),
            body.saturating_add(skip.end),
        );
        (from..to).contains(&(at as u64))
    })
}

/// A connection replayed from memory: reads give its bytes, then end of file; writes are
/// counted and dropped. Clones share the position, as a socket's handles do.
#[derive(Clone, Debug)]
pub struct Replay {
    bytes: Arc<Mutex<Cursor<Vec<u8>>>>,
    name: String,
}

impl Replay {
    pub fn new(bytes: Vec<u8>, name: &str) -> Replay {
        Replay {
            bytes: Arc::new(Mutex::new(Cursor::new(bytes))),
            name: name.into(),
        }
    }
}

impl Read for Replay {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.bytes.lock().unwrap().read(buf)
    }
}

impl Write for Replay {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Stream for Replay {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.clone()))
    }
    fn shutdown(&self, _: Shutdown) -> io::Result<()> {
        let mut c = self.bytes.lock().unwrap();
        let end = c.get_ref().len() as u64;
        c.set_position(end);
        Ok(())
    }
    fn set_read_timeout(&self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
    fn set_write_timeout(&self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
    fn peer(&self) -> String {
        self.name.clone()
    }
    fn set_low_latency(&self) -> io::Result<()> {
        Ok(())
    }
    fn set_urgent(&self) -> io::Result<()> {
        Ok(())
    }
}

/// The records of a connection after its hello, each a valid header and its whole payload, up
/// to the first that is not.
pub fn records(stream: &[u8]) -> Vec<(Header, &[u8])> {
    let mut out = Vec::new();
    let mut at = HELLO_SIZE;
    while let Some(raw) = stream.get(at..at + HEADER_SIZE) {
        let Ok(h) = Header::decode(raw.try_into().unwrap()) else {
            break;
        };
        let body_at = at + HEADER_SIZE;
        let Some(body) = stream.get(body_at..body_at + h.len as usize) else {
            break;
        };
        out.push((h, body));
        at = body_at + h.len as usize;
    }
    out
}

/// What the data connections carried, read independently of the engine: for each page, its
/// contents in the highest pass that sent it (`None`: a zero run).
fn carried(data: &[Vec<u8>]) -> BTreeMap<u64, (u32, Option<Vec<u8>>)> {
    let mut pages = BTreeMap::new();
    for stream in data {
        let mut pass = 1u32;
        for (h, body) in records(stream) {
            match h.kind {
                Kind::Pages => {
                    let n = h.count as usize;
                    for i in 0..n {
                        let gpa = u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().unwrap());
                        let d = n * 8 + i * PAGE_SIZE as usize;
                        let page = body[d..d + PAGE_SIZE as usize].to_vec();
                        land(&mut pages, gpa, pass, Some(page));
                    }
                }
                Kind::ZeroRuns => {
                    for run in body.chunks_exact(16) {
                        let gpa = u64::from_le_bytes(run[..8].try_into().unwrap());
                        let n = u64::from_le_bytes(run[8..].try_into().unwrap());
                        for p in 0..n.min(MEMORY / PAGE_SIZE * 2) {
                            land(&mut pages, gpa + p * PAGE_SIZE, pass, None);
                        }
                    }
                }
                Kind::EndOfPass => pass = h.count.saturating_add(1),
                _ => break,
            }
        }
    }
    pages
}

/// The device-state sections the main connection carried, in order.
fn sections(main: &[u8]) -> Vec<Section> {
    let mut out = Vec::new();
    for (h, body) in records(main) {
        if h.kind == Kind::DeviceState
            && let Ok((sh, data)) = SectionHeader::decode(body)
        {
            out.push(Section {
                id: sh.id,
                instance: sh.instance,
                version: sh.version,
                data: data.to_vec(),
            });
        }
        if h.kind == Kind::Complete {
            break;
        }
    }
    out
}

fn land(
    pages: &mut BTreeMap<u64, (u32, Option<Vec<u8>>)>,
    gpa: u64,
    pass: u32,
    contents: Option<Vec<u8>>,
) {
    match pages.get(&gpa) {
        Some((p, _)) if *p > pass => {}
        _ => {
            pages.insert(gpa, (pass, contents));
        }
    }
}

/// How a destination fed an input ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It refused the stream, with this error.
    Refused(String),
    /// It resumed the guest, whose memory and state were checked.
    Resumed,
}

/// The fuzz target over a destination: see the module's docs. Panics where the destination
/// broke a promise.
pub fn incoming(input: &[u8]) -> Outcome {
    let mut streams = Streams::decode(input);
    if streams.reseal {
        let pages = checksum_pages(&streams.main);
        reseal(&mut streams.main, pages);
        for d in &mut streams.data {
            reseal(d, pages);
        }
    }
    let mut dst = FakeVm::new(MEMORY, REGIONS);
    dst.state.clear();
    let mut data = streams
        .data
        .iter()
        .enumerate()
        .map(|(i, d)| Replay::new(d.clone(), &format!("data {}", i + 1)))
        .collect::<Vec<_>>()
        .into_iter();
    // Connections run out at once rather than at a deadline: a missing one is an error now,
    // not ten seconds from now.
    let mut accept = |_: Instant| {
        data.next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::ConnectionAborted, "no more connections"))
    };
    let main = Replay::new(streams.main.clone(), "main");
    let received = match destination::receive(&mut dst, main, &mut accept) {
        Ok(r) => r,
        Err(e) => {
            assert!(!dst.resumed, "a destination that failed resumed its guest");
            // A thread that panicked is a bug however the engine reports it (under libFuzzer
            // the panic itself already aborts).
            assert_ne!(e.kind(), ErrorKind::Internal, "{e}");
            return Outcome::Refused(e.to_string());
        }
    };
    assert!(dst.resumed, "a completed migration resumes the guest");
    assert_eq!(
        dst.state,
        sections(&streams.main),
        "the state loaded is the state sent"
    );
    if received.postcopy.is_some() {
        return Outcome::Resumed; // pages then also arrive on request; the model is precopy's
    }
    let pages = carried(&streams.data);
    let contents = dst.contents();
    let regions = ferry_migrate::DestinationVm::ram(&dst);
    for r in &regions {
        for p in 0..r.size / PAGE_SIZE {
            let gpa = r.gpa + p * PAGE_SIZE;
            let at = (r.file_offset + p * PAGE_SIZE) as usize;
            let here = &contents[at..at + PAGE_SIZE as usize];
            match pages.get(&gpa) {
                Some((_, Some(sent))) => {
                    assert!(
                        here == sent.as_slice(),
                        "page {gpa:#x} is not what was sent"
                    )
                }
                _ => assert!(
                    here.iter().all(|b| *b == 0),
                    "page {gpa:#x} holds data that was never sent"
                ),
            }
        }
    }
    Outcome::Resumed
}

/// What replaying a recorded migration with one byte changed showed, over many cases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flips {
    /// Cases whose byte was under a checksum (all refused, or [`flip`] panics).
    pub covered: u64,
    /// Cases whose byte was page data without page checksums...
    pub uncovered: u64,
    /// ...of which the destination resumed the guest (with that byte landed, as sent).
    pub uncovered_resumed: u64,
}

/// Replays `streams` (a whole migration) with bit `bit` of byte `at` of connection `conn`
/// (0: main, k: data connection k) flipped, through [`incoming`], and demands that a byte
/// under a checksum is refused; counts the case in `flips`.
pub fn flip(streams: &Streams, conn: usize, at: usize, bit: u8, flips: &mut Flips) -> Outcome {
    let mut changed = streams.clone();
    changed.reseal = false;
    let stream = if conn == 0 {
        &mut changed.main
    } else {
        &mut changed.data[conn - 1]
    };
    stream[at] ^= 1 << (bit % 8);
    let outcome = incoming(&changed.encode());
    if covered(streams, conn, at) {
        flips.covered += 1;
        assert!(
            matches!(outcome, Outcome::Refused(_)),
            "connection {conn} byte {at} bit {bit} is under a checksum, yet the guest resumed"
        );
    } else {
        flips.uncovered += 1;
        flips.uncovered_resumed += u64::from(outcome == Outcome::Resumed);
    }
    outcome
}

/// `n` flip cases over `streams`, at places drawn from `seed` with every connection weighted
/// by its length: what the black-box replay test and the example behind the benchmark run.
pub fn flips(streams: &Streams, n: u64, seed: u64) -> Flips {
    let lens: Vec<usize> = std::iter::once(&streams.main)
        .chain(&streams.data)
        .map(Vec::len)
        .collect();
    let total: usize = lens.iter().sum();
    let mut x = seed | 1;
    let mut next = || {
        // xorshift64*: deterministic, no dependency.
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut flips = Flips::default();
    for _ in 0..n {
        let mut at = (next() % total as u64) as usize;
        let conn = lens
            .iter()
            .position(|&l| {
                let here = at < l;
                if !here {
                    at -= l;
                }
                here
            })
            .unwrap();
        flip(streams, conn, at, (next() % 8) as u8, &mut flips);
    }
    flips
}

/// The fuzz target over the wire module: see the module's docs. Each input is decoded as it
/// is (which exercises the checksums) and with its hello's and header's checksums rewritten to
/// match (which reaches the checks behind them).
pub fn wire(input: &[u8]) {
    decode_all(input);
    let mut sealed = input.to_vec();
    if let Some(h) = sealed.get_mut(..HELLO_SIZE) {
        wire::reseal_hello(h.try_into().unwrap());
    }
    decode_all(&sealed);
    let mut sealed = input.to_vec();
    if let Some(h) = sealed.get_mut(..HEADER_SIZE) {
        wire::reseal_header(h.try_into().unwrap());
    }
    decode_all(&sealed);
}

fn decode_all(input: &[u8]) {
    if let Ok(b) = <&[u8; HELLO_SIZE]>::try_from(input.get(..HELLO_SIZE).unwrap_or_default())
        && let Ok(h) = Hello::decode(b)
    {
        assert_eq!(Hello::decode(&h.encode()).ok(), Some(h));
    }
    if let Some(b) = input.get(..HEADER_SIZE)
        && let Ok(h) = Header::decode(b.try_into().unwrap())
    {
        assert_eq!(h.encode().as_slice(), b, "a header has one encoding");
        let payload = &input[HEADER_SIZE..];
        match h.kind {
            Kind::Received => {
                let _ = wire::Received::decode(payload);
            }
            Kind::Done => {
                let _ = wire::Latencies::decode(payload);
            }
            Kind::Resumed => {
                let _ = wire::ResumedRecord::decode(h.count, payload);
            }
            Kind::DeviceState => {
                if let Ok((sh, data)) = SectionHeader::decode(payload) {
                    assert!(data.len() <= payload.len());
                    assert_eq!(
                        sh.encode().as_slice(),
                        &payload[..payload.len() - data.len()]
                    );
                }
            }
            _ => {
                let _ = wire::decode_addresses(payload).count();
            }
        }
    }
}
