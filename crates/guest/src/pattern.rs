//! Page pickers for the `random` and `hotcold` access patterns (`seq` is a plain cursor that
//! the workload walks in runs, so it needs no picker).

use ferry_guest_abi::params::{HOT_WRITE_PERCENT, Pattern};

/// xorshift64*: one multiply per number, full period over non-zero states, and good enough
/// for choosing pages (it only has to defeat the hardware prefetcher and the dirty log's
/// locality, not pass statistical suites).
#[derive(Clone, Copy, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(ferry_guest_abi::stamp::mix(seed) | 1)
    }

    #[inline(always)]
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` by multiply-high (no division on the hot path). `n` must be > 0.
    #[inline(always)]
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Chooses working-set page indices for the random patterns.
#[derive(Clone, Copy, Debug)]
pub struct Picker {
    rng: Rng,
    pages: u64,
    hot_pages: u64,
    hot_writes: bool,
}

impl Picker {
    /// A picker over `pages` pages. For `HotCold`, the first `hot_percent`% of pages (at least
    /// one) receive [`HOT_WRITE_PERCENT`]% of writes; `Sequential` is treated as `Random`.
    pub fn new(pattern: Pattern, pages: u64, hot_percent: u8, seed: u64) -> Picker {
        let hot_pages = (pages * u64::from(hot_percent) / 100).max(1);
        Picker {
            rng: Rng::new(seed),
            pages: pages.max(1),
            hot_pages,
            hot_writes: pattern == Pattern::HotCold,
        }
    }

    #[inline(always)]
    pub fn next_index(&mut self) -> u64 {
        if self.hot_writes && self.rng.below(100) < HOT_WRITE_PERCENT {
            self.rng.below(self.hot_pages)
        } else {
            self.rng.below(self.pages)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_covers_the_working_set_uniformly() {
        let mut p = Picker::new(Pattern::Random, 100, 10, 7);
        let mut hits = [0u32; 100];
        for _ in 0..100_000 {
            hits[p.next_index() as usize] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
    }

    #[test]
    fn hotcold_sends_most_writes_to_the_hot_share() {
        let mut p = Picker::new(Pattern::HotCold, 1000, 10, 3);
        let hot = (0..100_000).filter(|_| p.next_index() < 100).count();
        // 90% direct hot writes plus 10% of the 10% uniform ones.
        assert!((90_000..92_000).contains(&hot), "{hot}");
    }

    #[test]
    fn indices_stay_in_range() {
        let mut p = Picker::new(Pattern::HotCold, 3, 1, 1);
        assert!((0..10_000).all(|_| p.next_index() < 3));
    }

    #[test]
    fn seeds_give_different_sequences() {
        let mut a = Rng::new(1);
        let mut b = Rng::new(2);
        assert_ne!(a.next_u64(), b.next_u64());
    }
}
