//! Page compression for slow links (`--compression`): a data channel's sender compresses a
//! precopy batch's data pages into one zstd frame and sends it as a
//! [`Kind::CompressedPages`](crate::wire::Kind::CompressedPages) record when that saves at
//! least an eighth of the bytes; otherwise (incompressible data) the batch goes out as a plain
//! Pages record. The zero scan comes first, as without compression: zero pages still go as
//! runs. Postcopy's pages are never compressed: a vCPU waits for them.
//!
//! `auto` compresses only where it pays: a batch is worth compressing when the link is slower
//! than what compression frees, `link < compress_rate × (1 − ratio)`. Each sender measures the
//! three for itself: the link from the time its writes take (a write blocks once the socket's
//! buffer is full, so over many batches this is the rate the link drains; the bandwidth
//! limit's share per channel caps it), and the compression rate and ratio from the batches it
//! compresses. Now and then a batch goes the way not chosen (a probe, ever rarer while the
//! choice stands), so that both estimates stay current; while the link is faster than
//! compression itself, no ratio could make it pay, and compression is not probed at all.

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::stats::CompressionStats;
use crate::wire::PAGE_SIZE;

/// zstd's level when none is given: its fastest positive level (on the project's machine
/// 170-220 MB/s of `fill=mixed` pages a core, 294 MB/s of real text and code).
pub const DEFAULT_LEVEL: i32 = 1;
/// The highest level accepted: zstd's 20-22 need far more memory per context and are slower
/// than any link.
pub const MAX_LEVEL: i32 = 19;
/// `auto` sends one batch the way its estimates do not pick, to keep them current: first
/// after [`FIRST_PROBE`] batches, then at intervals that double while the choice stands, up
/// to [`MAX_PROBE_INTERVAL`], and start again at [`FIRST_PROBE`] when it changes. On a link
/// far faster than compression a probe costs its batch's compression, so they must be rare.
pub const FIRST_PROBE: u64 = 4;
pub const MAX_PROBE_INTERVAL: u64 = 256;

/// How the source compresses page data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Compression {
    /// Pages go as they are.
    #[default]
    Off,
    /// Every precopy batch is compressed at `level` (and sent raw if that saves too little).
    Zstd { level: i32 },
    /// Batches are compressed at `level` only while the link is slower than what
    /// compression frees (the module's doc).
    Auto { level: i32 },
}

impl Compression {
    /// Whether pages may be compressed.
    pub fn is_on(self) -> bool {
        self != Compression::Off
    }

    fn level(self) -> i32 {
        match self {
            Compression::Off => 0,
            Compression::Zstd { level } | Compression::Auto { level } => level,
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::Off => write!(f, "off"),
            Compression::Zstd { level } => write!(f, "zstd:{level}"),
            Compression::Auto { level } => write!(f, "auto:{level}"),
        }
    }
}

impl FromStr for Compression {
    type Err = String;

    /// `off`, `zstd`, `zstd:LEVEL`, `auto` or `auto:LEVEL` (LEVEL 1 to [`MAX_LEVEL`]).
    fn from_str(s: &str) -> Result<Compression, String> {
        let (mode, level) = match s.split_once(':') {
            Some((mode, level)) => {
                let level: i32 = level.parse().map_err(|_| {
                    format!("compression level '{level}' is not a number: write e.g. zstd:3")
                })?;
                if !(1..=MAX_LEVEL).contains(&level) {
                    return Err(format!(
                        "compression level {level} is out of range: use 1 (fastest) to {MAX_LEVEL}"
                    ));
                }
                (mode, level)
            }
            None => (s, DEFAULT_LEVEL),
        };
        match mode {
            "off" if !s.contains(':') => Ok(Compression::Off),
            "zstd" => Ok(Compression::Zstd { level }),
            "auto" => Ok(Compression::Auto { level }),
            _ => Err(format!(
                "unknown compression '{s}': use off, zstd[:LEVEL] or auto[:LEVEL]"
            )),
        }
    }
}

impl TryFrom<String> for Compression {
    type Error = String;
    fn try_from(s: String) -> Result<Compression, String> {
        s.parse()
    }
}

impl From<Compression> for String {
    fn from(c: Compression) -> String {
        c.to_string()
    }
}

/// A sender's compressor: its zstd context, its buffers, and `auto`'s estimates.
pub(crate) struct PageCompressor {
    mode: Compression,
    ctx: zstd::bulk::Compressor<'static>,
    out: Vec<u8>,
    /// Bytes per second the link takes from this channel (`auto`), as its raw writes show.
    link: Rate,
    /// Input bytes per CPU second, and output over input, of the batches compressed.
    speed: Rate,
    ratio: f64,
    /// `auto`: batches until the next probe, the interval after it, and the last choice.
    until_probe: u64,
    interval: u64,
    paid: bool,
    pub(crate) stats: CompressionStats,
}

impl fmt::Debug for PageCompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageCompressor")
            .field("mode", &self.mode)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PageCompressor {
    /// A compressor for `mode` (on).
    pub(crate) fn new(mode: Compression) -> std::io::Result<PageCompressor> {
        let mut ctx = zstd::bulk::Compressor::new(mode.level())?;
        // The frame carries its own checksum: a frame changed in a way that still decodes is
        // caught by the decoder as well as by the record's checksum.
        ctx.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true))?;
        Ok(PageCompressor {
            mode,
            ctx,
            out: Vec::new(),
            link: Rate::default(),
            speed: Rate::default(),
            ratio: 1.0,
            until_probe: FIRST_PROBE,
            interval: FIRST_PROBE,
            paid: false,
            stats: CompressionStats::default(),
        })
    }

    /// Whether to try this batch (`auto`: the estimates say it pays, or it is a probe); `cap`
    /// is this channel's share of the bandwidth limit now in force, bytes per second.
    pub(crate) fn wants(&mut self, cap: Option<f64>) -> bool {
        match self.mode {
            Compression::Off => false,
            Compression::Zstd { .. } => true,
            Compression::Auto { .. } => {
                let link = match (self.link.per_second(), cap) {
                    (Some(l), Some(c)) => Some(l.min(c)),
                    (l, c) => l.or(c),
                };
                let (pays, could_pay) = match (link, self.speed.per_second()) {
                    (Some(link), Some(speed)) => (link < speed * (1.0 - self.ratio), link < speed),
                    _ => (false, true),
                };
                // A probe goes the other way, to keep that way's estimate current: the
                // link's is measured on raw batches only (a small compressed write's time is
                // mostly the call's own cost, not the link's).
                if pays != self.paid {
                    (self.paid, self.interval, self.until_probe) = (pays, FIRST_PROBE, FIRST_PROBE);
                }
                // A link faster than compression itself leaves nothing to probe for: no ratio
                // could make compressing pay. (With 9 probes a channel, a 1 GiB loopback
                // migration took 0.81-1.28 of its time without compression in five runs.)
                self.until_probe -= 1;
                let due = self.until_probe == 0;
                if due {
                    self.interval = (self.interval * 2).min(MAX_PROBE_INTERVAL);
                    self.until_probe = self.interval;
                }
                let probe = due && (pays || could_pay);
                let compress = pays != probe;
                if !compress {
                    self.stats.records_raw += 1;
                }
                compress
            }
        }
    }

    /// Compresses `data` (whole pages); the frame when it is at most 7/8 of `data`, `None`
    /// when the batch should go raw.
    pub(crate) fn compress(&mut self, data: &[u8]) -> std::io::Result<Option<&[u8]>> {
        debug_assert_eq!(data.len() as u64 % PAGE_SIZE, 0);
        let started = crate::stats::thread_cpu_ns();
        self.out.clear();
        self.out
            .reserve(zstd::zstd_safe::compress_bound(data.len()));
        let n = self.ctx.compress_to_buffer(data, &mut self.out)?;
        let cpu = (crate::stats::thread_cpu_ns() - started).max(1);
        self.stats.cpu_seconds += cpu as f64 / 1e9;
        self.speed.add(data.len() as u64, Duration::from_nanos(cpu));
        self.ratio = n as f64 / data.len() as f64;
        if n as u64 * 8 > data.len() as u64 * 7 {
            self.stats.records_raw += 1;
            return Ok(None);
        }
        self.stats.records_compressed += 1;
        self.stats.bytes_in += data.len() as u64;
        self.stats.bytes_out += n as u64;
        Ok(Some(&self.out[..n]))
    }

    /// Counts a raw batch's write of `bytes` to the link that took `took`, for `auto`'s link
    /// estimate: once the socket's buffer is full, a write returns when the link has taken
    /// as many bytes, so a large write's time is the link's.
    pub(crate) fn wrote(&mut self, bytes: u64, took: Duration) {
        self.link.add(bytes, took);
    }
}

/// What a data page has recently cost on the wire, as a share of its 4 KiB: what the bandwidth
/// limit and the downtime estimate count a page at while pages are compressed. It follows the
/// senders' running totals of data records (Pages and CompressedPages: their pages' bytes and
/// the bytes written for them; zero pages are not in them and keep counting whole), and moves
/// to each window's share once [`WireShare::WINDOW`] page bytes went, so a compressible first
/// pass does not let incompressible later ones through at its rate.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WireShare {
    seen: (u64, u64),
    share: f64,
}

impl Default for WireShare {
    fn default() -> WireShare {
        WireShare {
            seen: (0, 0),
            share: 1.0,
        }
    }
}

impl WireShare {
    pub(crate) const WINDOW: u64 = 8 << 20;

    /// Takes the totals `(page bytes, wire bytes)` so far; returns the share now in force.
    pub(crate) fn update(&mut self, pages: u64, wire: u64) -> f64 {
        let (dp, dw) = (pages - self.seen.0, wire - self.seen.1);
        if dp >= WireShare::WINDOW {
            self.share = (dw as f64 / dp as f64).clamp(1.0 / 64.0, 1.0);
            self.seen = (pages, wire);
        }
        self.share
    }
}

/// A rate as an exponentially weighted average of samples, each weighted by its duration.
#[derive(Clone, Copy, Debug, Default)]
struct Rate {
    bytes: f64,
    seconds: f64,
}

impl Rate {
    /// The weight the past keeps at each sample: a few dozen batches make the estimate.
    const KEEP: f64 = 0.9;

    fn add(&mut self, bytes: u64, took: Duration) {
        self.bytes = self.bytes * Rate::KEEP + bytes as f64;
        self.seconds = self.seconds * Rate::KEEP + took.as_secs_f64();
    }

    fn per_second(&self) -> Option<f64> {
        (self.seconds > 0.0).then(|| self.bytes / self.seconds)
    }
}

/// Decompresses a CompressedPages frame into `out`, which must come out exactly `pages` pages
/// long; the error says what was wrong with the frame.
pub(crate) fn decompress(
    ctx: &mut zstd::bulk::Decompressor<'static>,
    frame: &[u8],
    pages: usize,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let want = pages * PAGE_SIZE as usize;
    match zstd::zstd_safe::find_frame_compressed_size(frame) {
        Ok(n) if n == frame.len() => {}
        Ok(n) => {
            return Err(format!(
                "{} bytes follow its frame of {n}: a record holds one frame",
                frame.len() - n
            ));
        }
        Err(e) => {
            return Err(format!(
                "it does not start with a frame: {}",
                zstd::zstd_safe::get_error_name(e)
            ));
        }
    }
    out.clear();
    out.reserve(want);
    // Decoding stops at the buffer's capacity (at least `want`, at most the largest record's),
    // and any length but `want` is refused below.
    let n = ctx
        .decompress_to_buffer(frame, out)
        .map_err(|e| format!("the frame does not decode: {e}"))?;
    if n != want {
        return Err(format!(
            "the frame decodes to {n} bytes, not the {want} of its {pages} pages"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_pages(pages: usize) -> Vec<u8> {
        let words = ["the ", "page ", "moves ", "while ", "guest ", "runs "];
        let mut v = Vec::new();
        let mut i = 0usize;
        while v.len() < pages * PAGE_SIZE as usize {
            v.extend_from_slice(words[(i * 7 + i / 3) % words.len()].as_bytes());
            i += 1;
        }
        v.truncate(pages * PAGE_SIZE as usize);
        v
    }

    fn random_pages(pages: usize) -> Vec<u8> {
        let mut x = 0x1234_5678_9abc_def0u64;
        (0..pages * PAGE_SIZE as usize / 8)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn modes_parse_with_and_without_a_level_and_refuse_the_rest() {
        assert_eq!("off".parse(), Ok(Compression::Off));
        assert_eq!("zstd".parse(), Ok(Compression::Zstd { level: 1 }));
        assert_eq!("zstd:5".parse(), Ok(Compression::Zstd { level: 5 }));
        assert_eq!("auto:3".parse(), Ok(Compression::Auto { level: 3 }));
        for bad in ["zstd:0", "zstd:20", "zstd:x", "lz4", "off:1", ""] {
            let e = bad.parse::<Compression>().unwrap_err();
            assert!(e.contains("compression"), "{bad}: {e}");
        }
        let c = Compression::Auto { level: 2 };
        assert_eq!(c.to_string().parse(), Ok(c));
    }

    #[test]
    fn compressible_pages_round_trip_and_random_ones_go_raw() {
        let mut c = PageCompressor::new(Compression::Zstd { level: 1 }).unwrap();
        let text = text_pages(64);
        let frame = c
            .compress(&text)
            .unwrap()
            .expect("text compresses")
            .to_vec();
        assert!(frame.len() * 4 < text.len(), "{} bytes", frame.len());
        let mut d = zstd::bulk::Decompressor::new().unwrap();
        let mut out = Vec::new();
        decompress(&mut d, &frame, 64, &mut out).unwrap();
        assert_eq!(out, text);
        // The same frame named as more or fewer pages is refused.
        assert!(decompress(&mut d, &frame, 63, &mut out).is_err());
        assert!(decompress(&mut d, &frame, 65, &mut out).is_err());
        assert!(c.compress(&random_pages(64)).unwrap().is_none());
        assert_eq!(c.stats.records_compressed, 1);
        assert_eq!(c.stats.records_raw, 1);
        assert!(c.stats.cpu_seconds > 0.0);
    }

    #[test]
    fn the_wire_share_follows_the_last_window_not_the_whole_past() {
        let mut w = WireShare::default();
        const W: u64 = WireShare::WINDOW;
        assert_eq!(
            w.update(W / 2, W / 20),
            1.0,
            "before a window, pages count whole"
        );
        assert!((w.update(W, W / 10) - 0.1).abs() < 1e-6);
        // An incompressible window after a compressible one counts whole again at once.
        assert_eq!(w.update(2 * W, W / 10 + W), 1.0);
        assert_eq!(w.update(3 * W, W / 10 + W + 1), 1.0 / 64.0);
    }

    #[test]
    fn a_second_frame_or_none_is_refused() {
        let mut c = PageCompressor::new(Compression::Zstd { level: 1 }).unwrap();
        let frame = c.compress(&text_pages(1)).unwrap().unwrap().to_vec();
        let mut d = zstd::bulk::Decompressor::new().unwrap();
        let e = decompress(&mut d, &[frame.clone(), frame].concat(), 1, &mut Vec::new());
        assert!(e.unwrap_err().contains("a record holds one frame"));
        let e = decompress(&mut d, b"not a frame at all", 1, &mut Vec::new());
        assert!(e.unwrap_err().contains("does not start with a frame"));
    }

    #[test]
    fn a_corrupted_frame_is_refused() {
        let mut c = PageCompressor::new(Compression::Zstd { level: 1 }).unwrap();
        let mut frame = c.compress(&text_pages(8)).unwrap().unwrap().to_vec();
        let mid = frame.len() / 2;
        frame[mid] ^= 0x40;
        let mut d = zstd::bulk::Decompressor::new().unwrap();
        assert!(decompress(&mut d, &frame, 8, &mut Vec::new()).is_err());
    }

    #[test]
    fn auto_compresses_on_a_slow_link_and_not_on_a_fast_one() {
        let text = text_pages(128);
        // (the link as raw writes show it, the bandwidth limit's share, whether auto compresses)
        for (link, cap, expect) in [
            (10e6, None, true),
            (100e9, None, false),
            (100e9, Some(10e6), true),
        ] {
            let mut c = PageCompressor::new(Compression::Auto { level: 1 }).unwrap();
            let mut compressed = 0;
            for _ in 0..64 {
                if c.wants(cap) && c.compress(&text).unwrap().is_some() {
                    compressed += 1;
                } else {
                    let bytes = text.len() as u64;
                    c.wrote(bytes, Duration::from_secs_f64(bytes as f64 / link));
                }
            }
            // Probes are at batches 4, 12, 28 and 60 at most, either way; on the fast link
            // only the first, which measures compression's rate.
            assert_eq!(
                compressed > 32,
                expect,
                "link {link}, cap {cap:?}: {compressed} compressed"
            );
        }
    }
}
