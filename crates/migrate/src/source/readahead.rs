//! Readahead for postcopy page requests, as a pure value: a vCPU that faults its way through
//! memory in order (a copy, a scan, a guest writing a buffer) would otherwise pay one round
//! trip per page, each behind whatever the background stream has queued. When a request
//! lands where the last one's window ended, the source sends that many pages after it as
//! well, and the window doubles; a request anywhere else starts over with no window. A random
//! access pattern so costs nothing extra, and a sequential one a round trip per window
//! (4 round trips for the first 64 pages, then one per MiB).
//!
//! The model is Linux's file readahead (sequential detection, a window that grows); the
//! numbers are argued at the constants. [`pick`] then says which pages of the requested runs
//! (windows included) go out, and how.

#![forbid(unsafe_code)]

use crate::bitmap::DirtyBitmap;
use crate::wire::PAGE_SIZE;

/// The first window, in pages: 64 KiB, ~50 us on this project's loopback, well under the
/// ~200 us round trip it saves per page.
pub const FIRST_WINDOW: u64 = 16;
/// The largest window by default ([`SourceParams::postcopy_prefetch_pages`]): 1 MiB, so that
/// a window never holds a random fault on the preempt connection for more than ~1 ms behind
/// it.
///
/// [`SourceParams::postcopy_prefetch_pages`]: super::SourceParams::postcopy_prefetch_pages
pub const MAX_WINDOW: u64 = 256;
/// A request this many pages past where the last window ended still counts as sequential:
/// the pages of a window arrive in order, so a vCPU faults just after it, or within it when
/// it ran ahead of its arrival.
const SLACK: u64 = 16;

/// Where the last request and its window ended, and that window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Readahead {
    /// The first byte of the last request.
    start: u64,
    /// The first byte after the last request's window.
    end: u64,
    /// Pages in the last window (0: none yet, or the last request was not sequential).
    window: u64,
    /// Whether the last request followed the one before it.
    sequential: bool,
    /// The largest window (0: no readahead, sequential requests are still told apart).
    max: u64,
}

impl Default for Readahead {
    fn default() -> Readahead {
        Readahead::new(MAX_WINDOW)
    }
}

impl Readahead {
    /// Readahead whose window grows to `max` pages at most.
    pub fn new(max: u64) -> Readahead {
        Readahead {
            start: 0,
            end: 0,
            window: 0,
            sequential: false,
            max,
        }
    }

    /// A request for `pages` pages at `gpa`: returns how many pages after it to send too.
    pub fn request(&mut self, gpa: u64, pages: u64) -> u64 {
        let sequential = self.end != 0 && gpa >= self.start && gpa <= self.end + SLACK * PAGE_SIZE;
        self.sequential = sequential;
        self.window = match (sequential, self.window) {
            (false, _) => 0,
            (true, 0) => FIRST_WINDOW.min(self.max),
            (true, w) => (w * 2).min(self.max),
        };
        self.start = gpa;
        self.end = gpa + (pages + self.window) * PAGE_SIZE;
        self.window
    }

    /// Whether the last request followed the one before it (a vCPU going through memory in
    /// order), whatever its window.
    pub fn sequential(&self) -> bool {
        self.sequential
    }
}

/// The pages of `runs` (`(gpa, bytes)`, windows included) to send now, each once and in
/// address order: `urgent`, those still to send (taken out of `pending`, or out of `held`, the
/// background batch not queued yet); and with the preempt connection (`resend` = the pages
/// the destination lacked at the switch), `again`, those listed and already queued behind the
/// background stream, sent once more ahead of it (their bytes cannot change any more).
pub fn pick(
    runs: impl IntoIterator<Item = (u64, u64)>,
    pending: &mut DirtyBitmap,
    held: &mut Vec<u64>,
    resend: Option<&DirtyBitmap>,
) -> (Vec<u64>, Vec<u64>) {
    // Runs may overlap (a window over the next request's page): a page is looked at once.
    let mut pages: Vec<u64> = runs
        .into_iter()
        .flat_map(|(gpa, bytes)| (gpa..gpa + bytes).step_by(PAGE_SIZE as usize))
        .collect();
    pages.sort_unstable();
    pages.dedup();
    let (mut urgent, mut again) = (Vec::new(), Vec::new());
    for page in pages {
        if pending.test_and_clear(page) {
            urgent.push(page);
        } else if let Ok(k) = held.binary_search(&page) {
            held.remove(k);
            urgent.push(page);
        } else if resend.is_some_and(|r| r.contains(page)) {
            again.push(page);
        }
    }
    (urgent, again)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ram::RamRegion;

    #[test]
    fn overlapping_runs_send_each_page_once_in_order() {
        let regions = [RamRegion::for_test(0, 64 * P)];
        // Pages 0..32 were listed at the switch; 8..16 are still pending, 16..20 held in the
        // background batch, the rest already queued.
        let mut listed = DirtyBitmap::new(&regions);
        listed.set_range(0, 32 * P);
        for preempt in [false, true] {
            let mut pending = DirtyBitmap::new(&regions);
            pending.set_range(8 * P, 8 * P);
            let mut held: Vec<u64> = (16..20).map(|p| p * P).collect();
            // A request for page 6 with a window to 18, and one for page 12 with a window
            // to 24: they overlap over 12..18.
            let runs = [(6 * P, 12 * P), (12 * P, 12 * P)];
            let (urgent, again) = pick(runs, &mut pending, &mut held, preempt.then_some(&listed));
            let pages = |v: &[u64]| v.iter().map(|g| g / P).collect::<Vec<_>>();
            assert_eq!(
                pages(&urgent),
                (8..20).collect::<Vec<_>>(),
                "preempt {preempt}"
            );
            let want_again: Vec<u64> = match preempt {
                true => (6..8).chain(20..24).collect(),
                false => Vec::new(),
            };
            assert_eq!(pages(&again), want_again, "preempt {preempt}");
            assert_eq!(pending.count(), 0);
            assert!(held.is_empty());
        }
    }

    const P: u64 = PAGE_SIZE;

    /// A row: name, and requests as (gpa in pages, pages asked, window sent after it).
    type Row = (&'static str, &'static [(u64, u64, u64)]);

    #[test]
    fn windows_grow_on_sequential_faults_and_stop_on_random_ones() {
        let table: &[Row] = &[
            (
                "a vCPU writing pages in order",
                &[
                    (100, 1, 0),
                    (101, 1, 16),
                    (118, 1, 32),
                    (151, 1, 64),
                    (216, 1, 128),
                    (345, 1, 256),
                    (602, 1, 256),
                ],
            ),
            (
                // It ran ahead of a window's arrival and faulted inside it.
                "a fault inside the last window",
                &[(100, 1, 0), (101, 1, 16), (105, 1, 32)],
            ),
            (
                "random faults",
                &[(100, 1, 0), (5000, 1, 0), (17, 1, 0), (9000, 1, 0)],
            ),
            (
                "a sequential run broken by a random fault starts over",
                &[(100, 1, 0), (101, 1, 16), (7000, 1, 0), (7001, 1, 16)],
            ),
            ("backwards is not sequential", &[(100, 1, 0), (99, 1, 0)]),
            (
                // A run of 512 pages (a 2 MiB host page) ends where its window starts.
                "huge pages",
                &[(0, 512, 0), (512, 512, 16)],
            ),
        ];
        for &(name, requests) in table {
            let mut r = Readahead::default();
            for &(page, pages, want) in requests {
                assert_eq!(r.request(page * P, pages), want, "{name}: page {page}");
            }
        }
    }
}
