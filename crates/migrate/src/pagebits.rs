//! A bitmap over guest pages that threads share (atomic words), with a summary bit per word of
//! bits, so that taking or clearing what is set costs what is set, not the size of RAM: at
//! 512 GiB the bits are 16 MiB and the summary 256 KiB. The destination's receivers claim
//! pages in one per pass (cleared at every pass end, the final pass's inside the downtime),
//! and the reference VMM records its own writes to guest memory in one.
//!
//! Ordering: setting a bit sets it, then its word's summary bit; [`PageBits::take`] and
//! [`PageBits::clear_all`] swap a summary word out, then each word it names. A bit set
//! concurrently with a take is either in that take (set before the take swapped its word) or
//! stays named by the summary for the next one (its summary bit is set after the take swapped
//! the summary word). A summary bit may name a word that turned out empty; that costs one swap.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use crate::zeroed::Zeroed;

/// Bits, each word of them named by a summary bit when it may have bits set.
#[derive(Debug)]
pub struct PageBits {
    words: Zeroed<AtomicU64>,
    /// Bit `j` of summary word `s`: word `64 * s + j` may have bits set.
    summary: Zeroed<AtomicU64>,
    len: u64,
}

/// Words taken from a [`PageBits`]: `(w, bits)` is word `w` (bits `64 * w..64 * w + 64`), in
/// increasing order of `w`, never zero.
pub type TakenWords = Vec<(usize, u64)>;

impl PageBits {
    /// `len` bits, all clear. The words are a zeroed mapping of their own (`zeroed.rs`), so a
    /// bitmap nobody sets costs address space, not host memory.
    pub fn new(len: u64) -> PageBits {
        let words = len.div_ceil(64) as usize;
        PageBits {
            words: Zeroed::new(words),
            summary: Zeroed::new(words.div_ceil(64)),
            len,
        }
    }

    /// Bits.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether bit `i` is set.
    pub fn get(&self, i: u64) -> bool {
        self.words[(i / 64) as usize].load(Ordering::Acquire) & (1 << (i % 64)) != 0
    }

    /// Sets bit `i`; returns whether it was already set.
    pub fn set(&self, i: u64) -> bool {
        let bit = 1 << (i % 64);
        let was = self.words[(i / 64) as usize].fetch_or(bit, Ordering::AcqRel) & bit != 0;
        if !was {
            self.name((i / 64) as usize);
        }
        was
    }

    /// Clears bit `i`; returns whether it was set. (Its summary bit stays: the next take or
    /// clear finds the word empty.)
    pub fn clear(&self, i: u64) -> bool {
        let bit = 1 << (i % 64);
        self.words[(i / 64) as usize].fetch_and(!bit, Ordering::AcqRel) & bit != 0
    }

    /// Sets bits `first..first + count`, clipped to the bitmap's length.
    pub fn set_range(&self, first: u64, count: u64) {
        let end = first.saturating_add(count).min(self.len);
        let mut at = first;
        while at < end {
            let bit = at % 64;
            let n = (64 - bit).min(end - at);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            self.words[(at / 64) as usize].fetch_or(mask, Ordering::AcqRel);
            self.name((at / 64) as usize);
            at += n;
        }
    }

    /// Takes every set bit, clearing it: walks the summary and swaps only the words it names.
    pub fn take(&self) -> TakenWords {
        let mut out = Vec::new();
        self.drain(|w, bits| out.push((w, bits)));
        out
    }

    /// Calls `each` with every set bit, in increasing order, leaving them set: walks the
    /// summary and reads only the words it names. Bits set or cleared meanwhile may or may not
    /// be seen.
    pub fn for_each_set(&self, mut each: impl FnMut(u64)) {
        for (s, summary) in self.summary.iter().enumerate() {
            for j in set_bits(summary.load(Ordering::Acquire)) {
                let w = s as u64 * 64 + j;
                let bits = self.words[w as usize].load(Ordering::Acquire);
                set_bits(bits).for_each(|k| each(w * 64 + k));
            }
        }
    }

    /// Clears every bit, at the cost of what was set.
    pub fn clear_all(&self) {
        self.drain(|_, _| {});
    }

    fn drain(&self, mut each: impl FnMut(usize, u64)) {
        for (s, summary) in self.summary.iter().enumerate() {
            // Cheap test first: most summary words of a large sparse bitmap are zero.
            if summary.load(Ordering::Acquire) == 0 {
                continue;
            }
            for j in set_bits(summary.swap(0, Ordering::AcqRel)) {
                let w = s * 64 + j as usize;
                let bits = self.words[w].swap(0, Ordering::AcqRel);
                if bits != 0 {
                    each(w, bits);
                }
            }
        }
    }

    /// Marks word `w` in the summary (after its bits were set). Always a read-modify-write,
    /// never a load first: a take's swap of the summary word then either comes after it (and
    /// sees the word's bits, released by it) or before it (and the bit stays for the next
    /// take); a plain load could see a bit a take was clearing and skip the write, leaving
    /// a set bit no summary names.
    fn name(&self, w: usize) {
        self.summary[w / 64].fetch_or(1 << (w % 64), Ordering::AcqRel);
    }
}

/// The indices of the bits set in `word`, lowest first: one step per set bit.
pub fn set_bits(word: u64) -> impl Iterator<Item = u64> {
    let mut rest = word;
    std::iter::from_fn(move || {
        (rest != 0).then(|| {
            let j = rest.trailing_zeros();
            rest &= rest - 1;
            u64::from(j)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(taken: &TakenWords) -> Vec<u64> {
        taken
            .iter()
            .flat_map(|&(w, b)| {
                (0..64)
                    .filter(move |k| b & (1 << k) != 0)
                    .map(move |k| w as u64 * 64 + k)
            })
            .collect()
    }

    #[test]
    fn a_take_returns_each_set_bit_once_and_clears_it() {
        let b = PageBits::new(10_000);
        assert!(!b.set(5));
        assert!(b.set(5), "already set");
        b.set_range(63, 2); // bits 63 and 64: two words
        b.set_range(9_000, 3); // another summary word
        assert!(b.get(64) && !b.get(65));
        assert_eq!(bits(&b.take()), vec![5, 63, 64, 9_000, 9_001, 9_002]);
        assert_eq!(b.take(), Vec::new(), "a second take finds nothing");
        assert!(!b.get(5));
    }

    #[test]
    fn clearing_one_bit_or_all_leaves_nothing_to_take() {
        let b = PageBits::new(300);
        b.set(1);
        b.set(200);
        assert!(b.clear(1));
        assert!(!b.clear(1));
        assert_eq!(bits(&b.take()), vec![200], "a cleared bit is not taken");
        b.set_range(0, 300);
        b.clear_all();
        assert_eq!(b.take(), Vec::new());
        assert!((0..300).all(|i| !b.get(i)));
    }

    #[test]
    fn a_walk_sees_every_set_bit_in_order_and_leaves_them() {
        let b = PageBits::new(100_000);
        for i in [3, 64, 65, 4_095, 4_096, 99_999] {
            b.set(i);
        }
        b.clear(65);
        let mut seen = Vec::new();
        b.for_each_set(|i| seen.push(i));
        assert_eq!(seen, vec![3, 64, 4_095, 4_096, 99_999]);
        assert_eq!(bits(&b.take()), seen, "the walk took nothing");
    }

    #[test]
    fn ranges_are_clipped_to_the_length() {
        let b = PageBits::new(100);
        b.set_range(98, 10);
        b.set_range(u64::MAX - 1, 5);
        assert_eq!(bits(&b.take()), vec![98, 99]);
        assert_eq!(b.len(), 100);
    }

    #[test]
    fn a_large_sparse_bitmap_takes_only_what_is_set() {
        // 512 GiB of 4 KiB pages: 16 MiB of words, 256 KiB of summary.
        let b = PageBits::new(512 << 18);
        b.set_range((12 << 18) + 7, 2);
        let taken = b.take();
        assert_eq!(taken.len(), 1);
        assert_eq!(bits(&taken), vec![(12 << 18) + 7, (12 << 18) + 8]);
    }
}
