//! The migration's dirty bitmap: one bit per guest page, per RAM region, with the number of
//! set bits kept as bits change (never by re-walking), and a bounded walk that takes set bits
//! out in address order.
//!
//! Cost follows what is set, not the size of RAM: each region keeps a summary bit per word of
//! bits (one per 64 pages), set whenever the word gains a bit, so walks skip 4,096 pages per
//! empty summary word (a 512 GiB guest's bitmap is 16 MiB, its summary 256 KiB). A summary bit
//! may outlive its word's bits (a walk clears it when it finds the word empty); it never
//! misses one.

#![forbid(unsafe_code)]

use crate::pagebits::set_bits;
use crate::ram::{RamError, RamRegion};
use crate::wire::PAGE_SIZE;
use crate::zeroed::Zeroed;

/// Words a single [`DirtyBitmap::take`] call looks at most, summary words and words of bits
/// together: 64 Ki words, well under a millisecond of scanning (up to 1 TiB of empty guest
/// memory through the summary), so a walk over a sparse bitmap still returns to its caller's
/// clock and cancellation checks often.
pub const MAX_WORDS_PER_TAKE: usize = 64 * 1024;

/// Pages in a chunk: the unit the bitmap tracks how recently pages were dirtied in
/// ([`DirtyBitmap::touched`]), 2 MiB of guest memory, which is also the largest postcopy unit
/// (a 2 MiB host page), so a chunk holds whole units.
pub const CHUNK_PAGES: u64 = 512;
const CHUNK_WORDS: usize = (CHUNK_PAGES / 64) as usize;

/// A chunk: region index and chunk index in the region.
pub type Chunk = (usize, usize);

/// Where a walk through the summary stopped.
enum Next {
    /// At a word the summary names.
    Word(usize),
    /// At the end of the region.
    End,
    /// Out of its scan budget, to go on from this word.
    OutOfBudget(usize),
}

#[derive(Debug)]
struct RegionBits {
    gpa: u64,
    pages: u64,
    /// A zeroed mapping of its own (`zeroed.rs`): a bitmap costs what is set in it.
    words: Zeroed<u64>,
    /// Bit `j` of `summary[s]`: `words[64 * s + j]` may have bits set.
    summary: Zeroed<u64>,
    /// Bit `c` of `touched[c / 64]`: a dirty log merged a page of chunk `c` (of
    /// [`CHUNK_PAGES`]) since the last [`DirtyBitmap::forget_touched`].
    touched: Zeroed<u64>,
}

impl RegionBits {
    fn new(gpa: u64, pages: u64) -> RegionBits {
        let words = pages.div_ceil(64) as usize;
        RegionBits {
            gpa,
            pages,
            words: Zeroed::new(words),
            summary: Zeroed::new(words.div_ceil(64)),
            touched: Zeroed::new(words.div_ceil(CHUNK_WORDS).div_ceil(64)),
        }
    }

    /// Chunks of [`CHUNK_PAGES`] (the last one may be shorter).
    fn chunks(&self) -> usize {
        self.words.len().div_ceil(CHUNK_WORDS)
    }

    /// The words of chunk `c`.
    fn chunk_words(&self, c: usize) -> std::ops::Range<usize> {
        c * CHUNK_WORDS..((c + 1) * CHUNK_WORDS).min(self.words.len())
    }

    /// Takes up to `max` marked pages of word `at`, lowest first, clearing their bits and
    /// pushing their guest addresses to `out`; returns how many (the count is the caller's).
    fn take_word(&mut self, at: usize, max: usize, out: &mut Vec<u64>) -> usize {
        let mut w = self.words[at];
        let mut taken = 0;
        while w != 0 && taken < max {
            let bit = w.trailing_zeros() as u64;
            w &= w - 1;
            out.push(self.gpa + (at as u64 * 64 + bit) * PAGE_SIZE);
            taken += 1;
        }
        self.words[at] = w;
        taken
    }

    /// ORs `bits` into word `w`; returns how many were new.
    fn or(&mut self, w: usize, bits: u64) -> u64 {
        let new = bits & !self.words[w];
        if new != 0 {
            self.words[w] |= new;
            self.summary[w / 64] |= 1 << (w % 64);
        }
        u64::from(new.count_ones())
    }

    /// The first word at or after `from` that the summary names, looking at summary words
    /// while `scanned` (which counts them) is under [`MAX_WORDS_PER_TAKE`].
    fn next_named(&self, from: usize, scanned: &mut usize) -> Next {
        let mut s = from / 64;
        let mut mask = u64::MAX << (from % 64);
        while s < self.summary.len() {
            if *scanned >= MAX_WORDS_PER_TAKE {
                return Next::OutOfBudget((s * 64).max(from));
            }
            *scanned += 1;
            let named = self.summary[s] & mask;
            if named != 0 {
                return Next::Word(s * 64 + named.trailing_zeros() as usize);
            }
            s += 1;
            mask = u64::MAX;
        }
        Next::End
    }

    /// The words the summary names, in order (empty ones included): a step per summary word
    /// and per named word, none per empty one.
    fn named(&self) -> impl Iterator<Item = usize> + '_ {
        self.summary
            .iter()
            .enumerate()
            .filter(|&(_, &named)| named != 0)
            .flat_map(|(s, &named)| set_bits(named).map(move |j| s * 64 + j as usize))
    }
}

/// A copy costs what is set: fresh zeroed words, and only the named ones copied (postcopy
/// copies the bitmap while the guest is paused).
impl Clone for RegionBits {
    fn clone(&self) -> RegionBits {
        let mut copy = RegionBits::new(self.gpa, self.pages);
        for w in self.named() {
            copy.words[w] = self.words[w];
        }
        copy.summary.copy_from_slice(&self.summary);
        copy.touched.copy_from_slice(&self.touched);
        copy
    }
}

/// Dirty pages of guest RAM. Allocated once per migration.
#[derive(Clone, Debug)]
pub struct DirtyBitmap {
    regions: Vec<RegionBits>,
    count: u64,
}

/// Where a walk stands: region index and word index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    region: usize,
    word: usize,
}

impl Cursor {
    pub fn at_end(&self, bitmap: &DirtyBitmap) -> bool {
        self.region >= bitmap.regions.len()
    }
}

impl DirtyBitmap {
    pub fn new(regions: &[RamRegion]) -> DirtyBitmap {
        DirtyBitmap {
            regions: regions
                .iter()
                .map(|r| RegionBits::new(r.gpa, r.size / PAGE_SIZE))
                .collect(),
            count: 0,
        }
    }

    /// Dirty pages.
    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn regions(&self) -> usize {
        self.regions.len()
    }

    /// Marks the page at `gpa`; false if it was already marked or is not RAM.
    pub fn set(&mut self, gpa: u64) -> bool {
        for r in &mut self.regions {
            if gpa >= r.gpa && gpa < r.gpa + r.pages * PAGE_SIZE {
                let page = (gpa - r.gpa) / PAGE_SIZE;
                let new = r.or((page / 64) as usize, 1 << (page % 64));
                self.count += new;
                return new == 1;
            }
        }
        false
    }

    /// ORs a dirty log's bits into the bitmap: bit i of `words` is the page at
    /// `gpa + i * PAGE_SIZE`, for the `pages` pages from `gpa`; bits past `pages` are ignored.
    ///
    /// The log is placed by guest address, never by a region index, so the VMM's memory slots
    /// and the engine's (sorted) regions need not be numbered alike. The pages must lie in one
    /// region: a log that runs past its region's end is an error, not a silent truncation.
    pub fn merge_at(&mut self, gpa: u64, pages: u64, words: &[u64]) -> Result<(), RamError> {
        let bad = RamError::NotInOneRegion { gpa, pages };
        if !gpa.is_multiple_of(PAGE_SIZE) || pages > words.len() as u64 * 64 {
            return Err(bad);
        }
        let r = self
            .regions
            .iter_mut()
            .find(|r| gpa >= r.gpa && (gpa - r.gpa) / PAGE_SIZE < r.pages)
            .ok_or(RamError::OutOfRange { gpa })?;
        let first = (gpa - r.gpa) / PAGE_SIZE;
        if pages > r.pages - first {
            return Err(bad);
        }
        // Bit i of `words` lands on bit `first + i` of the region: word `first / 64 + i / 64`
        // shifted left by `first % 64`, its high bits spilling into the next word.
        let shift = first % 64;
        let mut added = 0;
        for (i, &w) in words.iter().enumerate() {
            let done = i as u64 * 64;
            if done >= pages {
                break;
            }
            let w = if pages - done < 64 {
                w & ((1u64 << (pages - done)) - 1)
            } else {
                w
            };
            let at = (first / 64) as usize + i;
            for (idx, bits) in [(at, w << shift), (at + 1, (w >> 1) >> (63 - shift))] {
                if bits != 0 {
                    let c = idx / CHUNK_WORDS;
                    r.touched[c / 64] |= 1 << (c % 64);
                    added += r.or(idx, bits);
                }
            }
        }
        self.count += added;
        Ok(())
    }

    /// Takes up to `max_pages` marked pages from `cursor` on, clearing their bits and pushing
    /// their guest addresses to `out`. Looks at most at [`MAX_WORDS_PER_TAKE`] words, summary
    /// words included, skipping through the summary what has no bit; the cursor says where to
    /// go on (it stays on a word that still has bits).
    pub fn take(&mut self, cursor: &mut Cursor, max_pages: usize, out: &mut Vec<u64>) {
        let mut scanned = 0;
        let mut taken = 0;
        while cursor.region < self.regions.len()
            && taken < max_pages
            && scanned < MAX_WORDS_PER_TAKE
        {
            let r = &mut self.regions[cursor.region];
            let at = match r.next_named(cursor.word, &mut scanned) {
                Next::Word(at) => at,
                Next::End => {
                    cursor.region += 1;
                    cursor.word = 0;
                    continue;
                }
                Next::OutOfBudget(resume) => {
                    cursor.word = resume;
                    break;
                }
            };
            cursor.word = at;
            taken += r.take_word(at, max_pages - taken, out);
            if r.words[at] == 0 {
                r.summary[at / 64] &= !(1 << (at % 64));
                cursor.word += 1;
            }
            scanned += 1;
        }
        self.count -= taken as u64;
    }

    /// Whether the page at `gpa` is marked (false for an address outside RAM).
    pub fn contains(&self, gpa: u64) -> bool {
        self.regions.iter().any(|r| {
            gpa >= r.gpa && gpa < r.gpa + r.pages * PAGE_SIZE && {
                let page = (gpa - r.gpa) / PAGE_SIZE;
                r.words[(page / 64) as usize] & (1 << (page % 64)) != 0
            }
        })
    }

    /// Clears the page at `gpa`; whether it was marked (false for an address outside RAM).
    pub fn test_and_clear(&mut self, gpa: u64) -> bool {
        for r in &mut self.regions {
            if gpa >= r.gpa && gpa < r.gpa + r.pages * PAGE_SIZE {
                let page = (gpa - r.gpa) / PAGE_SIZE;
                let (w, bit) = ((page / 64) as usize, 1u64 << (page % 64));
                let was = r.words[w] & bit != 0;
                r.words[w] &= !bit;
                self.count -= u64::from(was);
                return was;
            }
        }
        false
    }

    /// Marks every page wholly inside `gpa..gpa + len` that is RAM; returns how many were not
    /// marked before. Word at a time, so a hint of gigabytes costs microseconds.
    pub fn set_range(&mut self, gpa: u64, len: u64) -> u64 {
        self.update_range(gpa, len, true)
    }

    /// Clears every page wholly inside `gpa..gpa + len` that is RAM; returns how many were
    /// marked.
    pub fn clear_range(&mut self, gpa: u64, len: u64) -> u64 {
        self.update_range(gpa, len, false)
    }

    fn update_range(&mut self, gpa: u64, len: u64, set: bool) -> u64 {
        let Some(start) = gpa.checked_next_multiple_of(PAGE_SIZE) else {
            return 0;
        };
        let end = gpa.saturating_add(len) / PAGE_SIZE * PAGE_SIZE;
        let mut changed = 0;
        for r in &mut self.regions {
            let (s, e) = (start.max(r.gpa), end.min(r.gpa + r.pages * PAGE_SIZE));
            if s >= e {
                continue;
            }
            let (mut first, last) = ((s - r.gpa) / PAGE_SIZE, (e - r.gpa) / PAGE_SIZE);
            while first < last {
                let bit = first % 64;
                let n = (64 - bit).min(last - first);
                let mask = match n {
                    64 => u64::MAX,
                    n => ((1u64 << n) - 1) << bit,
                };
                let w = (first / 64) as usize;
                changed += match set {
                    true => r.or(w, mask),
                    false => {
                        let flip = mask & r.words[w];
                        r.words[w] ^= flip;
                        u64::from(flip.count_ones())
                    }
                };
                first += n;
            }
        }
        match set {
            true => self.count += changed,
            false => self.count -= changed,
        }
        changed
    }

    /// A cursor at the page after `gpa` (at its word), for a walk that goes on from there;
    /// the start if `gpa` is not RAM.
    pub fn cursor_after(&self, gpa: u64) -> Cursor {
        for (region, r) in self.regions.iter().enumerate() {
            if gpa >= r.gpa && gpa < r.gpa + r.pages * PAGE_SIZE {
                let page = (gpa - r.gpa) / PAGE_SIZE + 1;
                return Cursor {
                    region,
                    word: (page / 64) as usize,
                };
            }
        }
        Cursor::default()
    }

    /// The pages marked here and not in `except` (a bitmap of the same regions), as runs
    /// `(gpa, pages)` in address order, each inside one region and at most `max_pages` long.
    /// Walks the words the summary names, so it is for the one-off uses (postcopy's discard
    /// lists), not for a loop.
    pub fn runs_except(&self, except: Option<&DirtyBitmap>, max_pages: u64) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (k, r) in self.regions.iter().enumerate() {
            let mut open: Option<(u64, u64)> = None;
            let mut last = None;
            for i in r.named() {
                if last.is_some_and(|l| l + 1 != i)
                    && let Some(run) = open.take()
                {
                    out.push(run);
                }
                last = Some(i);
                let w = r.words[i] & !except.map_or(0, |e| e.regions[k].words[i]);
                if w == 0 {
                    if let Some(run) = open.take() {
                        out.push(run);
                    }
                    continue;
                }
                for bit in 0..64 {
                    let gpa = r.gpa + (i as u64 * 64 + bit) * PAGE_SIZE;
                    if w & (1 << bit) == 0 {
                        if let Some(run) = open.take() {
                            out.push(run);
                        }
                        continue;
                    }
                    open = match open {
                        Some((start, n)) if n < max_pages => Some((start, n + 1)),
                        Some(run) => {
                            out.push(run);
                            Some((gpa, 1))
                        }
                        None => Some((gpa, 1)),
                    };
                }
            }
            if let Some(run) = open {
                out.push(run);
            }
        }
        out
    }

    /// Marks every page of each unit of `unit_pages` pages (a multiple of 64, counted from
    /// each region's start) that has a page marked: postcopy over huge pages moves whole host
    /// pages. Walks the words the summary names.
    pub fn round_out(&mut self, unit_pages: u64) {
        if unit_pages <= 1 {
            return;
        }
        assert!(
            unit_pages.is_multiple_of(64),
            "units of {unit_pages} pages are not whole words"
        );
        let per = (unit_pages / 64) as usize;
        for r in &mut self.regions {
            let units: Vec<usize> = r
                .named()
                .filter(|&i| r.words[i] != 0)
                .map(|i| i / per)
                .collect();
            let (pages, mut last) = (r.pages, None);
            for u in units {
                if last == Some(u) {
                    continue;
                }
                last = Some(u);
                for w in u * per..((u + 1) * per).min(r.words.len()) {
                    let first = w as u64 * 64;
                    let full = match pages.saturating_sub(first) {
                        n if n >= 64 => u64::MAX,
                        n => (1u64 << n) - 1,
                    };
                    self.count += r.or(w, full);
                }
            }
        }
    }
}

/// Chunks: which ones a dirty log touched, which ones hold pages, and a walk by chunk (the
/// postcopy push's order, `source/heat.rs`).
impl DirtyBitmap {
    /// Forgets which chunks dirty logs touched.
    pub fn forget_touched(&mut self) {
        for r in &mut self.regions {
            r.touched.fill(0);
        }
    }

    /// The chunks a dirty log touched ([`DirtyBitmap::merge_at`], with any page, marked before
    /// or not) since [`DirtyBitmap::forget_touched`], in order. The engine's own marks do not
    /// count: they say what to send, not what the guest wrote.
    pub fn touched(&self) -> Vec<Chunk> {
        let mut out = Vec::new();
        for (k, r) in self.regions.iter().enumerate() {
            for (t, &bits) in r.touched.iter().enumerate() {
                out.extend(set_bits(bits).map(|j| (k, t * 64 + j as usize)));
            }
        }
        out
    }

    /// Chunks per region.
    pub fn chunk_counts(&self) -> Vec<usize> {
        self.regions.iter().map(RegionBits::chunks).collect()
    }

    /// The chunks with a page marked, in order. Walks the words the summary names.
    pub fn marked_chunks(&self) -> Vec<Chunk> {
        let mut out: Vec<Chunk> = Vec::new();
        for (k, r) in self.regions.iter().enumerate() {
            for w in r.named().filter(|&w| r.words[w] != 0) {
                let c = (k, w / CHUNK_WORDS);
                if out.last() != Some(&c) {
                    out.push(c);
                }
            }
        }
        out
    }

    /// Whether chunk `c` (which may be past its region's end) has a page marked.
    pub fn chunk_marked(&self, (k, c): Chunk) -> bool {
        self.regions
            .get(k)
            .is_some_and(|r| c < r.chunks() && r.chunk_words(c).any(|w| r.words[w] != 0))
    }

    /// The chunk that holds `gpa`, if it is RAM.
    pub fn chunk_of(&self, gpa: u64) -> Option<Chunk> {
        self.regions.iter().enumerate().find_map(|(k, r)| {
            (gpa >= r.gpa && gpa < r.gpa + r.pages * PAGE_SIZE)
                .then(|| (k, ((gpa - r.gpa) / PAGE_SIZE / CHUNK_PAGES) as usize))
        })
    }

    /// Takes up to `max_pages` marked pages of chunk `c`, in address order, clearing their bits
    /// and pushing their guest addresses to `out`; whether the chunk has pages left.
    pub fn take_chunk(&mut self, (k, c): Chunk, max_pages: usize, out: &mut Vec<u64>) -> bool {
        let Some(r) = self.regions.get_mut(k).filter(|r| c < r.chunks()) else {
            return false;
        };
        let mut taken = 0;
        let mut left = false;
        for at in r.chunk_words(c) {
            taken += r.take_word(at, max_pages - taken, out);
            left |= r.words[at] != 0;
        }
        self.count -= taken as u64;
        left
    }
}

#[cfg(test)]
mod tests;
