//! The record of the VMM's own writes to guest memory: a vm-memory [`Bitmap`] with one bit
//! per 4 KiB page and a summary with one bit per 64 pages (a word of the first), so that
//! taking what was written costs what was written, not what RAM is configured with: a
//! 512 GiB guest has 16 MiB of page bits but 256 KiB of summary, and a take walks the
//! summary and swaps only the page words it names.
//!
//! Ordering: a write sets its page bits, then their summary bits; a take swaps a summary word
//! out, then each page word it names. A write whose summary bit a take already cleared set its
//! page bit either before that take's swap of the page word (taken now) or after it (its
//! summary bit is set after the take's swap of the summary word, so the next take sees it).
//! A summary bit whose page word turned out empty costs one swap, nothing else.

use std::sync::atomic::{AtomicU64, Ordering};

use vm_memory::bitmap::{Bitmap, NewBitmap, RefSlice, WithBitmapSlice};

const PAGE: usize = ferry_guest_abi::PAGE_SIZE as usize;

/// Written pages of one guest memory region, with a summary word per 64 page words.
#[derive(Debug, Default)]
pub struct WriteBitmap {
    /// Bit `i` of word `w`: page `64 * w + i` was written.
    pages: Vec<AtomicU64>,
    /// Bit `i` of word `s`: page word `64 * s + i` may have bits set.
    summary: Vec<AtomicU64>,
    len_pages: usize,
}

/// Words of the VMM's writes taken from a [`WriteBitmap`]: `(w, bits)` is page word `w`, in
/// increasing order of `w`, never zero.
pub type TakenWords = Vec<(usize, u64)>;

impl WriteBitmap {
    /// A bitmap for `bytes` of guest memory (rounded up to whole pages).
    pub fn new(bytes: usize) -> WriteBitmap {
        let len_pages = bytes.div_ceil(PAGE);
        let words = len_pages.div_ceil(64);
        WriteBitmap {
            pages: (0..words).map(|_| AtomicU64::new(0)).collect(),
            summary: (0..words.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            len_pages,
        }
    }

    /// Pages the bitmap covers.
    pub fn len_pages(&self) -> usize {
        self.len_pages
    }

    /// Takes every page written since the last take, clearing it. Walks the summary (one word
    /// per 4,096 pages) and swaps only the page words it names.
    pub fn take(&self) -> TakenWords {
        let mut out = Vec::new();
        for (s, summary) in self.summary.iter().enumerate() {
            let mut named = summary.swap(0, Ordering::SeqCst);
            while named != 0 {
                let w = s * 64 + named.trailing_zeros() as usize;
                named &= named - 1;
                let bits = self.pages[w].swap(0, Ordering::SeqCst);
                if bits != 0 {
                    out.push((w, bits));
                }
            }
        }
        out
    }

    /// Sets the bits of pages `first..first + count` in `words` (page words, or summary words
    /// counting page words), clipped to `limit` bits.
    fn set_bits(words: &[AtomicU64], first: usize, count: usize, limit: usize) {
        let end = (first + count).min(limit);
        let mut at = first;
        while at < end {
            let bit = at % 64;
            let n = (64 - bit).min(end - at);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            words[at / 64].fetch_or(mask, Ordering::SeqCst);
            at += n;
        }
    }
}

impl<'a> WithBitmapSlice<'a> for WriteBitmap {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for WriteBitmap {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let first = offset / PAGE;
        let last = (offset + len - 1) / PAGE;
        let words = self.pages.len();
        Self::set_bits(&self.pages, first, last + 1 - first, self.len_pages);
        Self::set_bits(&self.summary, first / 64, last / 64 + 1 - first / 64, words);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        let page = offset / PAGE;
        page < self.len_pages
            && self.pages[page / 64].load(Ordering::Acquire) & (1 << (page % 64)) != 0
    }

    fn slice_at(&self, offset: usize) -> <Self as WithBitmapSlice<'_>>::S {
        RefSlice::new(self, offset)
    }
}

impl NewBitmap for WriteBitmap {
    fn with_len(len: usize) -> Self {
        WriteBitmap::new(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(taken: &TakenWords) -> Vec<usize> {
        taken
            .iter()
            .flat_map(|&(w, bits)| {
                (0..64)
                    .filter(move |b| bits & (1 << b) != 0)
                    .map(move |b| w * 64 + b)
            })
            .collect()
    }

    #[test]
    fn a_take_returns_each_written_page_once_and_clears_it() {
        let b = WriteBitmap::new(10_000 * PAGE);
        b.mark_dirty(5 * PAGE + 100, 1);
        b.mark_dirty(63 * PAGE + 1, PAGE); // pages 63 and 64: two words, one summary bit
        b.mark_dirty(9_000 * PAGE, 3 * PAGE); // another summary word
        assert!(b.dirty_at(64 * PAGE) && !b.dirty_at(65 * PAGE));
        assert_eq!(pages(&b.take()), vec![5, 63, 64, 9_000, 9_001, 9_002]);
        assert_eq!(b.take(), Vec::new(), "a second take finds nothing");
    }

    #[test]
    fn writes_past_the_end_are_clipped_and_empty_writes_ignored() {
        let b = WriteBitmap::new(100 * PAGE);
        b.mark_dirty(98 * PAGE, 10 * PAGE);
        b.mark_dirty(3 * PAGE, 0);
        assert_eq!(pages(&b.take()), vec![98, 99]);
        assert_eq!(b.len_pages(), 100);
    }

    #[test]
    fn a_take_of_a_large_sparse_bitmap_visits_only_summary_words() {
        // 64 GiB of pages: 2 MiB of page words, 32 KiB of summary.
        let b = WriteBitmap::new(64 << 30);
        b.mark_dirty((12 << 30) + 7 * PAGE, 2 * PAGE);
        let taken = b.take();
        assert_eq!(taken.len(), 1);
        assert_eq!(
            pages(&taken),
            vec![(12 << 30) / PAGE + 7, (12 << 30) / PAGE + 8]
        );
    }
}
