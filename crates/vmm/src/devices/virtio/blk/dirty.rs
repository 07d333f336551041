//! Which parts of the image the guest wrote, for a migration that copies the disk itself
//! (no shared storage): one bit per [`DIRTY_CHUNK`] of the image, set by every request that
//! changes data (OUT, DISCARD, WRITE_ZEROES), taken and cleared by the copier. The bits live
//! in a [`WriteLog`] the device and the copy share, with a lock of its own, so the copy never
//! waits on the device's transport and a writer can be held outside it (the mirror).
//!
//! Invariant: a chunk is marked after its write reached the file, so a copier that takes the
//! bits and then reads the chunks sees every write either in what it reads or in its next take.
//!
//! The mirror (QEMU's `copy-mode=write-blocking`, bounded): once the copy asks for it
//! ([`WriteLog::mirror`]) with a lag (a few milliseconds of its rate, at most [`MIRROR_LAG`]),
//! a writer that leaves more than the lag marked and untaken waits, after its request
//! completed and outside every device lock ([`WriteLog::hold_writer`]), until the copier takes
//! the marks. So the guest writes no faster than the copy sends, and what is left never
//! exceeds the lag plus the copy's queue: the disk converges by construction however fast the
//! guest writes. Unlike QEMU's, a write that keeps within the lag pays nothing: a guest slower
//! than the link never waits.

#![forbid(unsafe_code)]

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The unit the copier sends again when any byte of it is written: a 4 KiB block, the
/// guest's own unit, so a guest writing random blocks costs the link what it writes (a 256 KiB
/// unit sent 64 times that, and a 10 MB/s writer's copy never settled). The price is the
/// bitmap, kept only while a copy runs: 32 KiB per GiB of disk (32 MiB for 1 TiB).
pub const DIRTY_CHUNK: u64 = 4 << 10;

/// A bitmap of an image's chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirtyChunks {
    words: Vec<u64>,
    chunks: u64,
}

impl DirtyChunks {
    /// A clean bitmap of an image of `bytes` bytes.
    pub fn new(bytes: u64) -> DirtyChunks {
        let chunks = bytes.div_ceil(DIRTY_CHUNK);
        DirtyChunks {
            words: vec![0; chunks.div_ceil(64) as usize],
            chunks,
        }
    }

    /// Marks every chunk `[offset, offset + len)` touches; a range past the image is cut.
    /// Returns how many were not marked before.
    pub fn mark(&mut self, offset: u64, len: u64) -> u64 {
        let end = offset
            .saturating_add(len)
            .min(self.chunks.saturating_mul(DIRTY_CHUNK));
        if offset >= end {
            return 0;
        }
        let mut new = 0;
        for chunk in offset / DIRTY_CHUNK..=(end - 1) / DIRTY_CHUNK {
            let word = &mut self.words[(chunk / 64) as usize];
            let bit = 1 << (chunk % 64);
            new += u64::from(*word & bit == 0);
            *word |= bit;
        }
        new
    }

    /// How many chunks are marked.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The marked chunks' indices, ascending, and clears them.
    pub fn take(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        for (i, word) in self.words.iter_mut().enumerate() {
            let mut w = std::mem::take(word);
            while w != 0 {
                out.push(i as u64 * 64 + u64::from(w.trailing_zeros()));
                w &= w - 1;
            }
        }
        out
    }
}

/// Most of the guest's writes the copy may be behind by once it mirrors, in chunks: 2 MiB, a
/// few milliseconds of the pause on a fast link.
pub const MIRROR_LAG: u64 = (2 << 20) / DIRTY_CHUNK;

/// Longest a writer is held at once: a copier that stopped taking (a migration's thread gone
/// without ending the copy) must not hang a vCPU. The write is marked, so it is sent anyway.
const HOLD_MOST: Duration = Duration::from_secs(1);

/// The marks the device and a copy share, and the mirror's gate.
#[derive(Debug, Default)]
pub struct WriteLog {
    state: Mutex<LogState>,
    taken: Condvar,
}

#[derive(Debug, Default)]
struct LogState {
    /// `None` while no copy runs: then nothing is marked, at no cost.
    bits: Option<DirtyChunks>,
    /// Chunks marked since the last take.
    marked: u64,
    /// Whether a writer past `lag` marked chunks waits for the copier.
    mirror: bool,
    lag: u64,
    /// How long writers were held, in all.
    held: Duration,
}

impl WriteLog {
    /// Starts marking, from a clean bitmap of an image of `bytes` bytes.
    pub fn start(&self, bytes: u64) {
        let mut s = self.state.lock().unwrap();
        *s = LogState {
            bits: Some(DirtyChunks::new(bytes)),
            ..LogState::default()
        };
    }

    /// Stops marking and lets every held writer go.
    pub fn stop(&self) {
        let mut s = self.state.lock().unwrap();
        s.bits = None;
        s.marked = 0;
        s.mirror = false;
        self.taken.notify_all();
    }

    pub fn is_marking(&self) -> bool {
        self.state.lock().unwrap().bits.is_some()
    }

    /// Marks `[offset, offset + len)` as written, if marking.
    pub fn mark(&self, offset: u64, len: u64) {
        let mut s = self.state.lock().unwrap();
        if let Some(bits) = &mut s.bits {
            let new = bits.mark(offset, len);
            s.marked += new;
        }
    }

    /// The marked chunks' indices, ascending, cleared; held writers go on.
    pub fn take(&self) -> Vec<u64> {
        let mut s = self.state.lock().unwrap();
        let taken = s.bits.as_mut().map(DirtyChunks::take).unwrap_or_default();
        s.marked = 0;
        self.taken.notify_all();
        taken
    }

    /// How many chunks are marked and not taken.
    pub fn count(&self) -> u64 {
        self.state.lock().unwrap().marked
    }

    /// Turns the mirror on with a lag of `lag` chunks (at most [`MIRROR_LAG`]), or off
    /// (`None`, which lets every held writer go): on from when the copy asks until it ends,
    /// or until the guest is to be paused, which must not wait on a held vCPU.
    pub fn mirror(&self, lag: Option<u64>) {
        let mut s = self.state.lock().unwrap();
        s.mirror = lag.is_some() && s.bits.is_some();
        s.lag = lag.unwrap_or(MIRROR_LAG).min(MIRROR_LAG);
        self.taken.notify_all();
    }

    pub fn mirroring(&self) -> bool {
        self.state.lock().unwrap().mirror
    }

    /// Holds the calling writer while the mirror is on and more than its lag of chunks are
    /// marked and untaken, at most [`HOLD_MOST`]. Call with no device lock held.
    pub fn hold_writer(&self) {
        let s = self.state.lock().unwrap();
        if !(s.mirror && s.marked > s.lag) {
            return;
        }
        let started = Instant::now();
        let (mut s, _) = self
            .taken
            .wait_timeout_while(s, HOLD_MOST, |s| s.mirror && s.marked > s.lag)
            .unwrap();
        s.held += started.elapsed();
    }

    /// How long writers were held since marking started.
    pub fn held(&self) -> Duration {
        self.state.lock().unwrap().held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_cover_every_touched_chunk_and_take_clears() {
        let mut d = DirtyChunks::new(64 * DIRTY_CHUNK + 1);
        d.mark(0, 1);
        d.mark(DIRTY_CHUNK - 1, 2);
        d.mark(63 * DIRTY_CHUNK, DIRTY_CHUNK + 1);
        d.mark(5 * DIRTY_CHUNK, 0);
        assert_eq!(d.take(), [0, 1, 63, 64]);
        assert_eq!(d.take(), Vec::<u64>::new());
    }

    #[test]
    fn ranges_past_the_image_are_cut() {
        let mut d = DirtyChunks::new(2 * DIRTY_CHUNK);
        d.mark(DIRTY_CHUNK, u64::MAX);
        d.mark(10 * DIRTY_CHUNK, 5);
        assert_eq!(d.take(), [1]);
        let mut empty = DirtyChunks::new(0);
        empty.mark(0, 512);
        assert!(empty.take().is_empty());
    }

    #[test]
    fn a_writer_past_the_lag_waits_for_the_copy_only_while_mirroring() {
        use std::sync::Arc;
        let log = Arc::new(WriteLog::default());
        log.start(64 << 20);
        let past_lag = (MIRROR_LAG + 1) * DIRTY_CHUNK;
        log.mark(0, past_lag);
        log.mark(0, DIRTY_CHUNK);
        assert_eq!(
            log.count(),
            MIRROR_LAG + 1,
            "a chunk marked twice counts once"
        );
        log.hold_writer();
        assert_eq!(log.held(), Duration::ZERO, "no mirror: never held");

        let held_writer = |log: &Arc<WriteLog>| {
            let log = log.clone();
            let writer = std::thread::spawn(move || log.hold_writer());
            std::thread::sleep(Duration::from_millis(20));
            assert!(!writer.is_finished(), "held while the copy is behind");
            writer
        };
        log.mirror(Some(MIRROR_LAG));
        let writer = held_writer(&log);
        assert_eq!(log.take().len() as u64, MIRROR_LAG + 1);
        writer.join().unwrap();
        assert!(
            log.held() > Duration::ZERO,
            "the time it was held is counted"
        );

        log.mark(0, MIRROR_LAG * DIRTY_CHUNK);
        let before = log.held();
        log.hold_writer();
        assert_eq!(log.held(), before, "within the lag: not held");

        // A pause turns the mirror off, and a stop ends it: both let a held writer go.
        log.mark(0, past_lag);
        let writer = held_writer(&log);
        log.mirror(None);
        writer.join().unwrap();
        log.mirror(Some(MIRROR_LAG));
        let writer = held_writer(&log);
        log.stop();
        writer.join().unwrap();
        assert!(!log.mirroring() && log.count() == 0);
        log.mirror(Some(MIRROR_LAG));
        assert!(!log.mirroring(), "no mirror without marks");
    }
}
