//! The harness behind ferry's fuzz targets (`fuzz/`), kept here so that the regression tests
//! replay what the fuzzer found through the very same code under `cargo test`.
//!
//! - [`incoming`]: arbitrary bytes as the main connection and up to four data connections of
//!   a destination over the fake VMM. It must end with an error, or with a resumed guest whose
//!   memory is exactly what the data connections carried (each page in the version of the last
//!   pass that sent it, zero where nothing was sent) and whose state is the sections sent.
//! - [`wire`]: arbitrary bytes through every decoder of the wire module; each must return an
//!   error or a value that encodes back to the same bytes where the format has one encoding.

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

/// The destination's RAM: 128 pages in two regions with a gap between them (the fake VMM's
/// dirty log wants whole 64-page words per region); seeds fill every 8th page or fewer, so
/// that an input carrying them stays near 100 KiB.
pub const MEMORY: u64 = 128 * PAGE_SIZE;
pub const REGIONS: usize = 2;
/// Data connections an input can carry (more would only dilute the search).
pub const MAX_DATA: usize = 4;

/// An input as the bytes of each connection: a count byte (data connections, mod 5), then
/// each connection's bytes behind a u32 length, the last connection taking the rest.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Streams {
    pub main: Vec<u8>,
    pub data: Vec<Vec<u8>>,
}

impl Streams {
    pub fn decode(input: &[u8]) -> Streams {
        let Some((&n, mut rest)) = input.split_first() else {
            return Streams::default();
        };
        let n = usize::from(n) % (MAX_DATA + 1);
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
        Streams { main, data }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.data.len() as u8];
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

/// What the data connections carried, read independently of the engine: for each page, its
/// contents in the highest pass that sent it (`None`: a zero run).
fn carried(data: &[Vec<u8>]) -> BTreeMap<u64, (u32, Option<Vec<u8>>)> {
    let mut pages = BTreeMap::new();
    for stream in data {
        let mut at = HELLO_SIZE.min(stream.len());
        let mut pass = 1u32;
        while let Some(raw) = stream.get(at..at + HEADER_SIZE) {
            let Ok(h) = Header::decode(raw.try_into().unwrap()) else {
                break;
            };
            let body_at = at + HEADER_SIZE;
            let Some(body) = stream.get(body_at..body_at + h.len as usize) else {
                break;
            };
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
            at = body_at + h.len as usize;
        }
    }
    pages
}

/// The device-state sections the main connection carried, in order.
fn sections(main: &[u8]) -> Vec<Section> {
    let mut out = Vec::new();
    let mut at = HELLO_SIZE;
    while let Some(raw) = main.get(at..at + HEADER_SIZE) {
        let Ok(h) = Header::decode(raw.try_into().unwrap()) else {
            break;
        };
        let body_at = at + HEADER_SIZE;
        let Some(body) = main.get(body_at..body_at + h.len as usize) else {
            break;
        };
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
        at = body_at + h.len as usize;
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
    let streams = Streams::decode(input);
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

/// The fuzz target over the wire module: see the module's docs.
pub fn wire(input: &[u8]) {
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
