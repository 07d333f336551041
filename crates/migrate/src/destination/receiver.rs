//! A data channel's receiver thread on the destination (the barrier that orders passes across
//! channels is `barrier.rs`).
//!
//! Invariant (docs/protocol.md, "Passes and channels"): no page of pass n+1 is written before
//! every page of pass n has been, on every channel. Each channel's stream is in order, and a
//! receiver that reaches EndOfPass(n) waits at the barrier until all channels and the main
//! channel have; so the last copy of a page always lands last. Within a pass a page may be
//! carried once: each receiver claims the pages of a record in a shared bitmap before writing,
//! and a second claim is a protocol error (this is also what makes the copy-free writes into
//! guest memory sound).

#![forbid(unsafe_code)]

use std::io::Read;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::assemble::Assembler;
use super::gate::PostcopyGate;
use super::inflate::Inflater;
use super::order::{self, DataStep};
use super::postcopy::Postcopy;
use super::progress::IncomingControl;
use super::sink::PageSink;
use crate::error::{Connection, MigrateError, ProtocolError, Rule, Twice};
use crate::ram::Ram;
use crate::transport::Stream;
use crate::wire::{self, HEADER_SIZE, Header, PAGE_SIZE};

/// How long a data channel that read its Postcopy marker waits for the main channel's switch
/// (the discard list, the device state and the Postcopy record, which the source wrote before
/// the marker's pages).
const POSTCOPY_GATE_TIMEOUT: Duration = Duration::from_secs(60);

pub use super::barrier::PassBarrier;
pub use crate::pagebits::PageBits;

/// What one receiver did.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReceiverStats {
    pub pages: u64,
    pub zero_pages: u64,
    pub passes: u32,
    pub cpu_ns: u64,
    /// CPU spent decoding CompressedPages frames, and the records decoded.
    pub decompress_cpu_ns: u64,
    pub compressed_records: u64,
}

/// Shared by all receivers of a migration.
#[derive(Clone, Debug)]
pub struct Shared {
    /// The guest's RAM layout, to check addresses.
    pub ram: Ram,
    /// Where page data lands.
    pub sink: Arc<dyn PageSink>,
    pub barrier: Arc<PassBarrier>,
    /// Pages that hold data from this migration (a zero run needs no work elsewhere).
    pub written: Arc<PageBits>,
    pub claimed: Arc<PageBits>,
    /// Progress counters and cancellation.
    pub control: Arc<IncomingControl>,
    /// Opened by the session when the source switches to postcopy.
    pub postcopy: Arc<PostcopyGate>,
    /// [`wire::Capabilities::CHECKSUM_PAGES`] was granted: a Pages record's checksum covers
    /// its page data too.
    pub checksum_pages: bool,
    /// [`wire::Capabilities::COMPRESS`] was granted: CompressedPages records may come.
    pub compress: bool,
}

impl Shared {
    /// Claims a page for this pass; a page carried twice in one pass is refused.
    fn claim(&self, gpa: u64) -> Result<u64, MigrateError> {
        let i = self.ram.page_index(gpa)?;
        if self.claimed.set(i) {
            return Err(ProtocolError::PageTwice {
                gpa,
                twice: Twice::InPass,
            }
            .into());
        }
        Ok(i)
    }

    /// Claims each of `gpas` for this pass ([`Shared::claim`]), in order.
    fn claim_all(&self, gpas: &[u64]) -> Result<Vec<u64>, MigrateError> {
        gpas.iter().map(|&gpa| self.claim(gpa)).collect()
    }
}

/// Starts the receiver of data channel `channel` (0: the preempt connection, which carries
/// only postcopy pages: a Postcopy record first, no passes).
pub fn start(
    channel: u16,
    stream: Box<dyn Stream>,
    shared: Shared,
) -> JoinHandle<Result<ReceiverStats, MigrateError>> {
    std::thread::Builder::new()
        .name(match channel {
            0 => "recv-preempt".into(),
            c => format!("recv-{c}"),
        })
        .spawn(move || {
            // A receiver that panics (a bug) still fails the barrier, so the session and the
            // other channels end instead of waiting for it forever.
            let _guard = PanicGuard {
                barrier: shared.barrier.clone(),
                channel,
            };
            let r = Receiver {
                channel,
                stream,
                shared: shared.clone(),
                stats: ReceiverStats::default(),
                buffer: Vec::new(),
                postcopy: None,
                assembler: None,
                inflater: None,
                at: order::Data::start(channel),
            }
            .run();
            if let Err(e) = &r {
                shared
                    .barrier
                    .fail(&format!("{}: {e}", Connection(channel)));
            }
            r
        })
        .expect("cannot start a receiver thread")
}

/// Reads a Pages record's addresses (checked against the header when the checksum covers
/// them alone) and checks their order; returns them and the checksum over them, which the
/// page data's check goes on from.
fn read_addresses(
    stream: &mut dyn Read,
    h: &Header,
    checksum_pages: bool,
) -> Result<(Vec<u64>, u32), MigrateError> {
    let mut words = vec![0u8; h.count as usize * 8];
    stream
        .read_exact(&mut words)
        .map_err(|e| MigrateError::io("receiving page addresses", e))?;
    let crc = wire::crc(&words);
    if !checksum_pages {
        h.check(crc, "the page addresses")?;
    }
    let gpas: Vec<u64> = wire::decode_addresses(&words).collect();
    if gpas.windows(2).any(|w| w[0] >= w[1]) {
        return Err(ProtocolError::AddressesNotIncreasing.into());
    }
    Ok((gpas, crc))
}

/// Reads the rest of a postcopy Pages record of 4 KiB pages whose header is `h` and installs
/// its pages, as a receiver does (the main connection's requested pages,
/// [`wire::Capabilities::MAIN_PAGES`]); returns the pages.
pub(crate) fn install_postcopy_record(
    stream: &mut dyn Read,
    h: &Header,
    pc: &Postcopy,
    checksum_pages: bool,
    buffer: &mut Vec<u8>,
) -> Result<u64, MigrateError> {
    let (gpas, crc) = read_addresses(stream, h, checksum_pages)?;
    let mut data = Checked::new(stream, h, crc, checksum_pages);
    let installed = pc.install_pages(&mut data, &gpas, buffer);
    data.verdict(installed)?;
    Ok(gpas.len() as u64)
}

/// A Pages record's page data as the sink reads it: with page checksums, each read is folded
/// into the record's checksum (begun over its addresses), and the read that completes the data
/// fails if the checksum does not match, so that no sink places a page of a record that did
/// not check (they place only after reading the whole record). Without, reads pass through.
struct Checked<'a> {
    inner: &'a mut dyn Read,
    header: Header,
    crc: u32,
    /// Data bytes still to come under the checksum; `None` when it does not cover them.
    left: Option<u64>,
    mismatch: Option<wire::WireError>,
}

impl<'a> Checked<'a> {
    fn new(inner: &'a mut dyn Read, header: &Header, crc: u32, checking: bool) -> Checked<'a> {
        let data = header.covered(checking) - u64::from(header.count) * 8;
        Checked {
            inner,
            header: *header,
            crc,
            left: (data > 0).then_some(data),
            mismatch: None,
        }
    }

    fn fold(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let Some(left) = &mut self.left else {
            return Ok(());
        };
        let n = (bytes.len() as u64).min(*left);
        self.crc = wire::crc_append(self.crc, &bytes[..n as usize]);
        *left -= n;
        if *left == 0
            && n > 0
            && let Err(e) = self.header.check(self.crc, "its addresses and page data")
        {
            self.mismatch = Some(e);
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "page data checksum mismatch",
            ));
        }
        Ok(())
    }

    /// The sink's result, or the checksum mismatch that failed it.
    fn verdict(self, r: Result<(), MigrateError>) -> Result<(), MigrateError> {
        match self.mismatch {
            Some(e) => Err(e.into()),
            None => r,
        }
    }
}

impl Read for Checked<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.fold(&buf[..n])?;
        Ok(n)
    }

    fn read_vectored(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> std::io::Result<usize> {
        let n = self.inner.read_vectored(bufs)?;
        let mut rest = n;
        for b in bufs.iter() {
            if rest == 0 {
                break;
            }
            let k = rest.min(b.len());
            self.fold(&b[..k])?;
            rest -= k;
        }
        Ok(n)
    }
}

/// Fails the barrier when a receiver thread unwinds.
struct PanicGuard {
    barrier: Arc<PassBarrier>,
    channel: u16,
}

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        self.barrier.fail_with_bug(Connection(self.channel));
    }
}

struct Receiver {
    channel: u16,
    stream: Box<dyn Stream>,
    shared: Shared,
    stats: ReceiverStats,
    /// The sink's staging buffer for this channel (see `PageSink::receive_pages`).
    buffer: Vec<u8>,
    /// Set once this channel carries postcopy pages.
    postcopy: Option<Arc<Postcopy>>,
    /// Postcopy's huge pages in progress, when the host pages are huge.
    assembler: Option<Assembler>,
    /// Its decompression, from the first CompressedPages record on.
    inflater: Option<Inflater>,
    /// Where its record stream is (`order.rs`).
    at: order::Data,
}

impl Receiver {
    fn run(mut self) -> Result<ReceiverStats, MigrateError> {
        let cpu_start = crate::stats::thread_cpu_ns();
        loop {
            let waiting = std::time::Instant::now();
            let header = self.read_header()?;
            // The background stream's receivers: the preempt connection's waits for requests.
            if let Some(pc) = &self.postcopy
                && self.channel != wire::PREEMPT_CHANNEL
            {
                pc.intake.idle.since(waiting);
            }
            let Some(h) = header else {
                // A clean end of stream is the source's way to close a channel after its last
                // pass; whether that pass was the last is for the barrier and the main channel
                // to judge, so say how far this channel got. The preempt connection is no party
                // to the passes.
                if let Some(a) = &self.assembler
                    && a.open_units() > 0
                {
                    return Err(ProtocolError::IncompleteHugePages {
                        connection: Connection(self.channel),
                        open: a.open_units(),
                    }
                    .into());
                }
                if self.channel != 0 {
                    self.shared.barrier.leave(self.channel, self.stats.passes);
                }
                self.stats.cpu_ns = crate::stats::thread_cpu_ns() - cpu_start;
                if let Some(i) = &self.inflater {
                    self.stats.decompress_cpu_ns = i.cpu_ns;
                    self.stats.compressed_records = i.records;
                }
                return Ok(self.stats);
            };
            let c = &self.shared.control;
            c.add(&c.bytes, HEADER_SIZE as u64 + h.len);
            let (then, step) = order::next_data(self.at, h.kind, h.count)?;
            self.at = then;
            match step {
                DataStep::Pages => self.pages(&h)?,
                DataStep::CompressedPages => self.compressed_pages(&h)?,
                DataStep::ZeroRuns => self.zero_runs(&h)?,
                DataStep::Postcopy => {
                    // Every page of the last pass is in (the barrier); wait for the session to
                    // register guest RAM and apply the discard list.
                    let gate = self.shared.postcopy.wait(POSTCOPY_GATE_TIMEOUT);
                    let pc = gate.ok_or(ProtocolError::PostcopyGate {
                        connection: Connection(self.channel),
                        timeout: POSTCOPY_GATE_TIMEOUT,
                    })?;
                    if pc.unit_pages() > 1 {
                        self.assembler = Some(Assembler::new(pc.unit_pages()));
                    }
                    self.postcopy = Some(pc);
                }
                DataStep::EndPass(pass) => {
                    self.stats.passes = pass;
                    self.shared.barrier.wait(pass)?;
                }
                DataStep::PeerError => {
                    let p = self.read(h.len as usize, "reading the source's error")?;
                    h.check(wire::crc(&p), "the whole payload")?;
                    return Err(MigrateError::from_peer(crate::error::Side::Source, &h, &p));
                }
            }
        }
    }

    /// The next header, or `None` at a clean end of stream (between records).
    fn read_header(&mut self) -> Result<Option<Header>, MigrateError> {
        let mut b = [0u8; HEADER_SIZE];
        let mut got = 0;
        while got < HEADER_SIZE {
            match std::io::Read::read(&mut self.stream, &mut b[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => {
                    return Err(MigrateError::Truncated {
                        during: "receiving pages",
                    });
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(MigrateError::io("receiving pages", e)),
            }
        }
        Ok(Some(Header::decode(&b)?))
    }

    fn read(&mut self, len: usize, during: &'static str) -> Result<Vec<u8>, MigrateError> {
        let mut v = vec![0u8; len];
        std::io::Read::read_exact(&mut self.stream, &mut v)
            .map_err(|e| MigrateError::io(during, e))?;
        Ok(v)
    }

    fn pages(&mut self, h: &Header) -> Result<(), MigrateError> {
        let count = h.count;
        let checking = self.shared.checksum_pages;
        let (gpas, addresses_crc) = read_addresses(&mut self.stream, h, checking)?;
        if let Some(pc) = &self.postcopy {
            // No claim: a postcopy page may come twice (a requested page again on the preempt
            // connection), and installing is atomic; the first copy wins. Both install paths
            // check every address before they read the data.
            let mut data = Checked::new(&mut self.stream, h, addresses_crc, checking);
            let installed = match &mut self.assembler {
                Some(a) => a.pages(pc.as_ref(), &mut data, &gpas),
                None => pc.install_pages(&mut data, &gpas, &mut self.buffer),
            };
            data.verdict(installed)?;
            self.stats.pages += u64::from(count);
            let c = &self.shared.control;
            c.add(&c.pages, u64::from(count));
            return Ok(());
        }
        let indices = self.shared.claim_all(&gpas)?;
        let mut data = Checked::new(
            &mut self.stream,
            h,
            addresses_crc,
            self.shared.checksum_pages,
        );
        let received = self
            .shared
            .sink
            .receive_pages(&mut data, &gpas, &mut self.buffer)
            .map_err(|e| MigrateError::io("receiving pages", e));
        data.verdict(received)?;
        self.landed(indices);
        Ok(())
    }

    /// A CompressedPages record: checked and decoded whole (`inflate.rs`), then placed by the
    /// sink like a Pages record's data.
    fn compressed_pages(&mut self, h: &Header) -> Result<(), MigrateError> {
        if !self.shared.compress {
            return Err(MigrateError::misplaced(h.kind, Rule::CompressedInPasses));
        }
        if self.inflater.is_none() {
            self.inflater = Some(Inflater::new()?);
        }
        let inflater = self.inflater.as_mut().expect("made above");
        let (gpas, mut data) = inflater.read(&mut self.stream, h)?;
        let indices = self.shared.claim_all(&gpas)?;
        self.shared
            .sink
            .receive_pages(&mut data, &gpas, &mut self.buffer)
            .map_err(|e| MigrateError::io("receiving pages", e))?;
        self.landed(indices);
        Ok(())
    }

    /// Counts the pages at page indices `indices` as written, once their data checked and
    /// landed (the claim is released only then).
    fn landed(&mut self, indices: Vec<u64>) {
        let count = indices.len() as u64;
        for i in indices {
            self.shared.written.set(i);
        }
        self.stats.pages += count;
        let c = &self.shared.control;
        c.add(&c.pages, count);
    }

    /// Zero runs: only pages that hold data from an earlier pass need zeroing; the rest are
    /// still holes, and stay untouched.
    fn zero_runs(&mut self, h: &Header) -> Result<(), MigrateError> {
        let words = self.read(h.count as usize * 16, "receiving zero runs")?;
        h.check(wire::crc(&words), "the whole payload")?;
        let w: Vec<u64> = wire::decode_addresses(&words).collect();
        for run in w.chunks_exact(2) {
            let (gpa, pages) = (run[0], run[1]);
            self.shared.ram.check_run(gpa, pages)?;
            if let Some(pc) = &self.postcopy {
                match &mut self.assembler {
                    Some(a) => a.zero(pc.as_ref(), gpa, pages)?,
                    None => pc.install_zero(gpa, pages)?,
                }
                self.stats.zero_pages += pages;
                let c = &self.shared.control;
                c.add(&c.zero_pages, pages);
                continue;
            }
            let mut stale: Option<(u64, u64)> = None;
            for k in 0..pages {
                let page = gpa + k * PAGE_SIZE;
                let i = self.shared.claim(page)?;
                if self.shared.written.clear(i) {
                    stale = match stale {
                        Some((s, n)) if s + n * PAGE_SIZE == page => Some((s, n + 1)),
                        Some((s, n)) => {
                            self.zero(s, n)?;
                            Some((page, 1))
                        }
                        None => Some((page, 1)),
                    };
                }
            }
            if let Some((s, n)) = stale {
                self.zero(s, n)?;
            }
            self.stats.zero_pages += pages;
            let c = &self.shared.control;
            c.add(&c.zero_pages, pages);
        }
        Ok(())
    }

    fn zero(&self, gpa: u64, pages: u64) -> Result<(), MigrateError> {
        self.shared
            .sink
            .zero(gpa, pages)
            .map_err(|e| MigrateError::io("zeroing pages", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receiver_that_panics_releases_the_barrier_with_an_internal_error() {
        let b = Arc::new(PassBarrier::new(
            2,
            Arc::new(PageBits::new(64)),
            Duration::from_secs(60),
        ));
        let guard = PanicGuard {
            barrier: b.clone(),
            channel: 2,
        };
        let t = std::thread::spawn(move || {
            let _guard = guard;
            panic!("a receiver's bug");
        });
        assert!(t.join().is_err());
        let e = b.wait(1).unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Internal, "{e}");
        assert!(
            e.to_string()
                .contains("data channel 2: the receiver thread panicked")
        );
        // A guard dropped without a panic records nothing.
        let quiet = Arc::new(PassBarrier::new(
            1,
            Arc::new(PageBits::new(64)),
            Duration::from_secs(1),
        ));
        drop(PanicGuard {
            barrier: quiet.clone(),
            channel: 1,
        });
        assert!(quiet.failure().is_none());
    }

    #[test]
    fn page_bits_report_previous_state() {
        let bits = PageBits::new(128);
        assert!(!bits.set(70));
        assert!(bits.set(70));
        assert!(bits.clear(70));
        assert!(!bits.clear(70));
    }
}
