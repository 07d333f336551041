//! Pacing the dirty rate: a token bucket in pages.

/// Most time a pause may be made up for: after a verify pass, a migration's switchover or a
/// host hiccup the guest resumes at its rate instead of bursting through the backlog (which
/// would turn a pause into a spike of dirty pages exactly when the migration measures them).
pub const MAX_BURST_NS: u64 = 10_000_000;

/// Grants writes at a fixed number of pages per second.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    pages_per_s: u64,
    /// Time up to which granted pages have used up the rate.
    spent_ns: u64,
}

impl Pace {
    /// A bucket for `bytes_per_s`, rounded to whole pages per second (at least one).
    pub fn new(bytes_per_s: u64, now_ns: u64) -> Pace {
        Pace {
            pages_per_s: (bytes_per_s / ferry_guest_abi::PAGE_SIZE).max(1),
            spent_ns: now_ns,
        }
    }

    /// The clock reading at which [`Pace::grant`] will give all of `want` pages: how long a
    /// guest with nothing else to do may sleep. `want` must fit in a [`MAX_BURST_NS`] burst
    /// (as [`Pace::pages_in`] of anything shorter does), or it is never granted at once.
    pub fn due_ns(&self, now_ns: u64, want: u64) -> u64 {
        let spent = self.spent_ns.max(now_ns.saturating_sub(MAX_BURST_NS));
        spent + (want * 1_000_000_000).div_ceil(self.pages_per_s)
    }

    /// Pages the rate allows in `ns` nanoseconds (at least one).
    pub fn pages_in(&self, ns: u64) -> u64 {
        (self.pages_per_s * ns / 1_000_000_000).max(1)
    }

    /// How many of `want` page writes may happen now.
    pub fn grant(&mut self, now_ns: u64, want: u64) -> u64 {
        self.spent_ns = self.spent_ns.max(now_ns.saturating_sub(MAX_BURST_NS));
        let available = now_ns.saturating_sub(self.spent_ns) * self.pages_per_s / 1_000_000_000;
        let granted = want.min(available);
        // Round the cost up so that rounding never lets the guest run above its rate.
        self.spent_ns += (granted * 1_000_000_000).div_ceil(self.pages_per_s);
        granted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_rate_is_honoured() {
        // 40 MB/s = 9765 pages/s; polled every 100 us for 2 s.
        let mut pace = Pace::new(40_000_000, 0);
        let mut total = 0;
        let mut now = 0;
        while now < 2_000_000_000 {
            now += 100_000;
            total += pace.grant(now, 1_000);
        }
        let want = 2 * 40_000_000 / 4096;
        assert!(total.abs_diff(want) <= 2, "{total} pages, want {want}");
    }

    #[test]
    fn due_is_when_the_whole_batch_is_granted() {
        for (rate, want) in [(1_000_000u64, 1u64), (100_000_000, 24), (4096 * 300, 2)] {
            let mut pace = Pace::new(rate, 0);
            pace.grant(1_000, u64::MAX);
            let due = pace.due_ns(1_000, want);
            let mut early = pace;
            assert!(early.grant(due - 1, want) < want, "{rate}: early at {due}");
            assert_eq!(pace.grant(due, want), want, "{rate}: not granted at {due}");
        }
        let pace = Pace::new(1_000_000, 0);
        assert_eq!(
            pace.pages_in(1_000_000),
            1,
            "1 MB/s: one page a ms at least"
        );
        assert_eq!(Pace::new(100_000_000, 0).pages_in(1_000_000), 24);
    }

    #[test]
    fn a_long_pause_is_not_made_up() {
        let mut pace = Pace::new(400_000_000, 0);
        let burst = pace.grant(5_000_000_000, u64::MAX);
        assert!(
            burst <= MAX_BURST_NS * 400_000_000 / 4096 / 1_000_000_000 + 1,
            "{burst}"
        );
    }

    #[test]
    fn nothing_is_granted_twice() {
        let mut pace = Pace::new(4096 * 1000, 0);
        assert_eq!(pace.grant(1_000_000, 10), 1);
        assert_eq!(pace.grant(1_000_000, 10), 0);
    }
}
