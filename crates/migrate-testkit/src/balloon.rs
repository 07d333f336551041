//! The fake guest's free memory and its balloon: pages the guest holds free, hinted to the
//! engine on request (free page hinting), and reused by the writers whenever they land on
//! one, hinted or not. A real driver keeps hinted pages until the migration is done; this fake
//! does not, on purpose: a guest that writes a page after hinting it is exactly the case the
//! engine's ordering must get right (the write is in the dirty log, and a later pass sends it).
//!
//! A round's hints are produced when it starts, from the free bitmap at that moment, and
//! arrive a few at a time with the takes that follow, until the round stops: the writes in
//! between are the race the engine's ordering must survive (a hint applied after the dirty
//! sync that fetched such a write would lose it).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ferry_migrate::ram::RamRegion;
use ferry_migrate::wire::PAGE_SIZE;

/// What the balloon did, for a test's assertions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HintReport {
    /// Rounds the engine started.
    pub rounds: u32,
    /// Pages handed out as hints, over all rounds.
    pub pages_hinted: u64,
    /// Writes to a page after it was hinted: the engine must have sent those pages again.
    pub reused_after_hint: u64,
    /// Whether the engine said it was done with hints (`finish_hints`).
    pub finished: bool,
}

#[derive(Debug, Default)]
struct Round {
    /// The VMM has a balloon (otherwise every call is unsupported).
    present: bool,
    /// Pages of hints that arrive per millisecond of a round: a real guest's hints trickle in.
    pages_per_ms: u64,
    started: Option<Instant>,
    /// Pages of this round that arrived so far.
    arrived_pages: u64,
    /// Arrived and not taken yet.
    arrived: Vec<(u64, u64)>,
    running: bool,
    /// Produced at the round's start and not arrived yet.
    pending: Vec<(u64, u64)>,
    report: HintReport,
}

/// Free pages (the guest's view) and the hinting state.
#[derive(Debug)]
pub(crate) struct FakeBalloon {
    free: Vec<AtomicU64>,
    hinted: Vec<AtomicU64>,
    reused: AtomicU64,
    round: Mutex<Round>,
}

fn bit(index: u64) -> (usize, u64) {
    ((index / 64) as usize, 1 << (index % 64))
}

impl FakeBalloon {
    pub(crate) fn new(pages: u64) -> FakeBalloon {
        let words = pages.div_ceil(64) as usize;
        FakeBalloon {
            free: (0..words).map(|_| AtomicU64::new(0)).collect(),
            hinted: (0..words).map(|_| AtomicU64::new(0)).collect(),
            reused: AtomicU64::new(0),
            round: Mutex::new(Round::default()),
        }
    }

    pub(crate) fn attach(&self, pages_per_ms: u64) {
        let mut r = self.round.lock().unwrap();
        r.present = true;
        r.pages_per_ms = pages_per_ms.max(1);
    }

    /// The guest frees page `index`.
    pub(crate) fn free(&self, index: u64) {
        let (w, b) = bit(index);
        self.free[w].fetch_or(b, Ordering::AcqRel);
    }

    /// The guest allocates page `index` to write it: it is in use again.
    pub(crate) fn written(&self, index: u64) {
        let (w, b) = bit(index);
        let was_free = self.free[w].fetch_and(!b, Ordering::AcqRel) & b != 0;
        if was_free && self.hinted[w].load(Ordering::Acquire) & b != 0 {
            self.reused.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn is_free(&self, index: u64) -> bool {
        let (w, b) = bit(index);
        self.free[w].load(Ordering::Acquire) & b != 0
    }

    pub(crate) fn start(&self, regions: &[RamRegion]) -> bool {
        let mut r = self.round.lock().unwrap();
        if r.present {
            r.running = true;
            r.report.rounds += 1;
            r.pending.clear();
            r.arrived.clear();
            r.started = Some(Instant::now());
            r.arrived_pages = 0;
            self.produce(&mut r, regions);
        }
        r.present
    }

    /// Ends the round: hints that have not arrived yet (not taken) are dropped, as a VMM
    /// drops the buffers a driver posts after the stop.
    pub(crate) fn stop(&self) -> bool {
        let mut r = self.round.lock().unwrap();
        Self::arrive(&mut r);
        r.running = false;
        r.pending.clear();
        r.present
    }

    pub(crate) fn finish(&self) -> bool {
        let mut r = self.round.lock().unwrap();
        r.running = false;
        r.report.finished = true;
        r.pending.clear();
        r.arrived.clear();
        r.present
    }

    /// Moves the hints that arrived and were not taken yet into `into`.
    pub(crate) fn take(&self, into: &mut Vec<(u64, u64)>) -> bool {
        let mut r = self.round.lock().unwrap();
        Self::arrive(&mut r);
        into.append(&mut r.arrived);
        r.present
    }

    /// Moves what the round's time so far lets arrive from `pending` to `arrived`.
    fn arrive(r: &mut Round) {
        let (Some(started), true) = (r.started, r.running) else {
            return;
        };
        let due = (started.elapsed().as_micros() as u64)
            .saturating_mul(r.pages_per_ms)
            .div_ceil(1000);
        let mut budget = due
            .saturating_sub(r.arrived_pages)
            .saturating_mul(PAGE_SIZE);
        while budget > 0 {
            let Some((gpa, len)) = r.pending.first_mut() else {
                break;
            };
            let n = (*len).min(budget);
            let piece = (*gpa, n);
            budget -= n;
            (*gpa, *len) = (*gpa + n, *len - n);
            if *len == 0 {
                r.pending.remove(0);
            }
            r.arrived.push(piece);
            r.arrived_pages += n / PAGE_SIZE;
        }
    }

    /// This round's hints: every run of free pages now, as `(gpa, bytes)` per region.
    fn produce(&self, r: &mut Round, regions: &[RamRegion]) {
        let mut first_index = 0;
        for region in regions {
            let pages = region.size / PAGE_SIZE;
            let mut run: Option<u64> = None;
            for i in 0..=pages {
                let index = first_index + i;
                let free = i < pages && self.is_free(index);
                if free {
                    let (w, b) = bit(index);
                    self.hinted[w].fetch_or(b, Ordering::AcqRel);
                    r.report.pages_hinted += 1;
                }
                match (free, run) {
                    (true, None) => run = Some(i),
                    (false, Some(start)) => {
                        r.pending
                            .push((region.gpa + start * PAGE_SIZE, (i - start) * PAGE_SIZE));
                        run = None;
                    }
                    _ => {}
                }
            }
            first_index += pages;
        }
    }

    pub(crate) fn report(&self) -> HintReport {
        HintReport {
            reused_after_hint: self.reused.load(Ordering::Relaxed),
            ..self.round.lock().unwrap().report
        }
    }
}
