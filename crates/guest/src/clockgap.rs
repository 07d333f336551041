//! What the guest makes of the gaps in its clocks: a vCPU looks at kvmclock and at the TSC
//! together at every turn of its workload loop; two looks further apart than the loop ever
//! leaves them (its longest sleep, a heartbeat, and a margin) are a gap: the vCPU did not run
//! (a migration's pause, a restore, a host that put it aside). Across a move the guest's
//! clocks must advance by the pause and no more, and never go back: each gap's length is kept
//! on both clocks (the TSC's in ticks, made ns with the guest's own calibration against the
//! PIT) so the host sees that they agree, and a look that finds either clock behind the one
//! before is counted.

use ferry_guest_abi::report::{self, DETAIL_WORDS};

/// The longest gap between two looks at the clocks, since the last report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gap {
    pub kvmclock_ns: u64,
    pub tsc_ticks: u64,
    /// kvmclock at the look that ended it.
    pub ended_ns: u64,
}

/// One vCPU's watch over its clocks.
#[derive(Clone, Copy, Debug)]
pub struct Gaps {
    threshold_ns: u64,
    last: Option<(u64, u64)>,
    longest: Option<Gap>,
    seen: u64,
    backwards: u64,
}

impl Gaps {
    /// A watch that counts a gap past `threshold_ns`.
    pub const fn new(threshold_ns: u64) -> Gaps {
        Gaps {
            threshold_ns,
            last: None,
            longest: None,
            seen: 0,
            backwards: 0,
        }
    }

    /// A look that read `ns` on kvmclock and `tsc` on the TSC; the look before's readings when
    /// either clock is behind them (counted, and never taken as a gap).
    pub fn look(&mut self, ns: u64, tsc: u64) -> Option<(u64, u64)> {
        let before = self.last.replace((ns, tsc));
        let (ns0, tsc0) = before?;
        if ns < ns0 || tsc < tsc0 {
            self.backwards += 1;
            return before;
        }
        let gap = ns - ns0;
        if gap > self.threshold_ns {
            self.seen += 1;
            if self.longest.is_none_or(|l| gap > l.kvmclock_ns) {
                self.longest = Some(Gap {
                    kvmclock_ns: gap,
                    tsc_ticks: tsc - tsc0,
                    ended_ns: ns,
                });
            }
        }
        None
    }

    /// The report's detail words (`report::clock_gap`) when a gap was seen since the last
    /// report, the TSC's gap made ns at `tsc_hz` (0: the guest has no calibration).
    pub fn take(&mut self, tsc_hz: u64) -> Option<[u64; DETAIL_WORDS]> {
        let g = self.longest.take()?;
        let mut d = [0; DETAIL_WORDS];
        d[report::clock_gap::KVMCLOCK_NS] = g.kvmclock_ns;
        d[report::clock_gap::TSC_NS] = match tsc_hz {
            0 => 0,
            hz => (u128::from(g.tsc_ticks) * 1_000_000_000 / u128::from(hz)) as u64,
        };
        d[report::clock_gap::TSC_TICKS] = g.tsc_ticks;
        d[report::clock_gap::ENDED_NS] = g.ended_ns;
        d[report::clock_gap::GAPS] = self.seen;
        d[report::clock_gap::BACKWARDS] = self.backwards;
        d[report::clock_gap::THRESHOLD_NS] = self.threshold_ns;
        Some(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_guest_abi::report::clock_gap::*;

    #[test]
    fn the_longest_gap_past_the_threshold_is_reported_once_on_both_clocks() {
        let mut g = Gaps::new(10);
        // 2 TSC ticks per ns.
        for (ns, tsc) in [(0, 0), (5, 10), (30, 60), (40, 80), (140, 280), (150, 300)] {
            assert_eq!(g.look(ns, tsc), None);
        }
        let d = g.take(2_000_000_000).expect("two gaps past 10 ns");
        assert_eq!(d[KVMCLOCK_NS], 100, "the longest");
        assert_eq!((d[TSC_TICKS], d[TSC_NS]), (200, 100), "the TSC agrees");
        assert_eq!((d[ENDED_NS], d[GAPS], d[BACKWARDS]), (140, 2, 0));
        assert_eq!(g.take(2_000_000_000), None, "reported once");
        assert_eq!(g.look(155, 310), None);
        assert_eq!(g.take(2_000_000_000), None, "no gap since");
    }

    #[test]
    fn a_clock_that_goes_back_is_counted_and_named() {
        let mut g = Gaps::new(10);
        g.look(100, 200);
        assert_eq!(g.look(90, 220), Some((100, 200)), "kvmclock back");
        assert_eq!(g.look(200, 100), Some((90, 220)), "the TSC back");
        assert_eq!(g.look(500, 800), None);
        let d = g.take(0).unwrap();
        assert_eq!((d[BACKWARDS], d[TSC_NS], d[KVMCLOCK_NS]), (2, 0, 300));
    }
}
