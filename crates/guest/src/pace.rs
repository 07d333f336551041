//! Pacing the dirty rate: a token bucket in pages, whose rate holds over the guest's own verify
//! passes as well as between them.

/// Most time a pause may be made up for: after a migration's switchover or a host hiccup the
/// guest resumes at its rate instead of bursting through the backlog (which would turn a pause
/// into a spike of dirty pages exactly when the migration measures them). The guest's own
/// verify passes are made up differently, spread over the writing that follows them
/// ([`Pace::make_up`]).
pub const MAX_BURST_NS: u64 = 10_000_000;

/// Grants writes at a fixed number of pages per second.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    /// The rate asked for.
    pages_per_s: u64,
    /// The rate granted now: the asked one, raised after a verify pass by what makes it up.
    granted_per_s: u64,
    /// Time up to which granted pages have used up the rate.
    spent_ns: u64,
}

impl Pace {
    /// A bucket for `bytes_per_s`, rounded to whole pages per second (at least one).
    pub fn new(bytes_per_s: u64, now_ns: u64) -> Pace {
        let pages_per_s = (bytes_per_s / ferry_guest_abi::PAGE_SIZE).max(1);
        Pace {
            pages_per_s,
            granted_per_s: pages_per_s,
            spent_ns: now_ns,
        }
    }

    /// A verify pass kept the guest from writing for `took_ns`, and the next comes after
    /// `writing_ns` of writing: until then, grant on top of the rate the pages the pass cost,
    /// so that `rate=` is what the guest writes over the whole cycle, verify included, and not
    /// only while it writes (a 1 GiB working set verified every 300 ms wrote 300 of 400 MB/s).
    /// The pages are spread over the writing rather than burst after the pass, so the dirty
    /// rate a migration measures stays steady. At most `writing_ns` of a pass is made up (the
    /// rate at most doubles), so that a pass far longer than usual (the first, over memory the
    /// host has not mapped yet: 2.6 s for 1 GiB on a nested host) is lost as a pause is,
    /// instead of turning the next interval into flat-out writing.
    pub fn make_up(&mut self, took_ns: u64, writing_ns: u64) {
        let owed_ns = took_ns.min(writing_ns);
        // The writing and the burst the bucket allows at its start (the last MAX_BURST_NS of
        // the pass) carry the pages of the writing and of the pass.
        let carried_ns = writing_ns + owed_ns.min(MAX_BURST_NS);
        self.granted_per_s = match carried_ns {
            0 => self.pages_per_s,
            _ => {
                let per_s = u128::from(self.pages_per_s) * u128::from(writing_ns + owed_ns)
                    / u128::from(carried_ns);
                u64::try_from(per_s).unwrap_or(u64::MAX)
            }
        };
    }

    /// The clock reading at which [`Pace::grant`] will give all of `want` pages: how long a
    /// guest with nothing else to do may sleep. `want` must fit in a [`MAX_BURST_NS`] burst
    /// (as [`Pace::pages_in`] of anything shorter does), or it is never granted at once.
    pub fn due_ns(&self, now_ns: u64, want: u64) -> u64 {
        let spent = self.spent_ns.max(now_ns.saturating_sub(MAX_BURST_NS));
        spent + (want * 1_000_000_000).div_ceil(self.granted_per_s)
    }

    /// Pages the rate allows in `ns` nanoseconds (at least one).
    pub fn pages_in(&self, ns: u64) -> u64 {
        (self.granted_per_s * ns / 1_000_000_000).max(1)
    }

    /// How many of `want` page writes may happen now.
    pub fn grant(&mut self, now_ns: u64, want: u64) -> u64 {
        self.spent_ns = self.spent_ns.max(now_ns.saturating_sub(MAX_BURST_NS));
        let available = now_ns.saturating_sub(self.spent_ns) * self.granted_per_s / 1_000_000_000;
        let granted = want.min(available);
        // Round the cost up so that rounding never lets the guest run above its rate.
        self.spent_ns += (granted * 1_000_000_000).div_ceil(self.granted_per_s);
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

    /// Pages granted from `from_ns` to `to_ns`, polled every 100 us.
    fn write(pace: &mut Pace, from_ns: u64, to_ns: u64) -> u64 {
        let mut total = 0;
        let mut now = from_ns;
        while now < to_ns {
            now += 100_000;
            total += pace.grant(now, 1_000);
        }
        total
    }

    /// A guest that writes for `interval_ns` and then verifies for `verify_ns`, `cycles` times
    /// (the first pass is made up by the writing that follows it like the others): the pages
    /// it writes, and the time it took.
    fn cycles(rate: u64, interval_ns: u64, verify_ns: u64, cycles: u64) -> (u64, u64) {
        let mut pace = Pace::new(rate, 0);
        let (mut total, mut now) = (0, 0);
        for _ in 0..cycles {
            total += write(&mut pace, now, now + interval_ns);
            now += interval_ns + verify_ns;
            pace.make_up(verify_ns, interval_ns);
        }
        (total, now)
    }

    #[test]
    fn the_rate_holds_over_verify_passes() {
        // (interval, verify, share of the asked rate written over the cycles): the demo's
        // 1 GiB working set verified every 300 ms took ~200 ms a pass and wrote 75% of its
        // rate; a pass as long as the interval is still made up whole.
        const MS: u64 = 1_000_000;
        for (interval, verify, low, high) in [
            (300 * MS, 200 * MS, 0.99, 1.01),
            (1000 * MS, 30 * MS, 0.99, 1.01),
            (300 * MS, 300 * MS, 0.99, 1.01),
            (300 * MS, 0, 0.99, 1.01),
            // Longer than the interval: made up to the interval's worth (the rate doubles).
            (300 * MS, 900 * MS, 0.49, 0.51),
        ] {
            let rate = 400_000_000;
            let (pages, ns) = cycles(rate, interval, verify, 20);
            // The last pass is made up after the end.
            let ns = ns - verify;
            let share = (pages * 4096) as f64 * 1e9 / ns as f64 / rate as f64;
            assert!(
                (low..=high).contains(&share),
                "{interval} ns writing, {verify} ns verifying: {share:.3} of the rate"
            );
        }
    }

    #[test]
    fn a_pass_is_made_up_once_and_spread_over_the_writing() {
        let mut pace = Pace::new(400_000_000, 0);
        pace.make_up(200_000_000, 300_000_000);
        // 500 ms of the rate carried by 300 ms of writing and the bucket's 10 ms burst after
        // the pass: 50/31 of the asked rate, steady.
        let per_10ms = write(&mut pace, 0, 10_000_000);
        let asked_10ms = 400_000_000 / 4096 / 100;
        assert!(per_10ms.abs_diff(asked_10ms * 50 / 31) <= 2, "{per_10ms}");
        // The next pass took no time: nothing more is made up.
        pace.make_up(0, 300_000_000);
        let per_10ms = write(&mut pace, 10_000_000, 20_000_000);
        assert!(per_10ms.abs_diff(asked_10ms) <= 2, "{per_10ms}");
        // Nor with no writing between passes (verify-ms too short to leave any).
        pace.make_up(100_000_000, 0);
        assert_eq!(pace.granted_per_s, pace.pages_per_s);
    }

    #[test]
    fn nothing_is_granted_twice() {
        let mut pace = Pace::new(4096 * 1000, 0);
        assert_eq!(pace.grant(1_000_000, 10), 1);
        assert_eq!(pace.grant(1_000_000, 10), 0);
    }
}
