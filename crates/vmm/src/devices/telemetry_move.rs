//! The guest's clocks across a move as the telemetry shows them: the gaps the boot vCPU saw in
//! its clocks (its [`Kind::ClockGap`](ferry_guest_abi::report::Kind::ClockGap) reports,
//! `clockgap.rs` in the guest), and on a destination (a migration's, a local handover's, a
//! restore's) the clock jump across the move and the guest's own gap for it.
//!
//! The clock jump is how far the guest's kvmclock moved against the host's clock across the
//! move: `(guest_after - guest_before) - (host_after - host_before)`, between the last report
//! the source's VMM received before the pause and a report this VMM received after it, each
//! with the guest's clock read just before it was sent and the host's `CLOCK_MONOTONIC` when
//! its port write was handled. A report handled late (its vCPU put aside by the host between
//! reading the clock and writing the port, or waiting for a page a lazy restore had still to
//! read) shows the guest's clock behind the host's by the delay: after the move that lowers the
//! figure, so it is the largest over the reports of [`SETTLE_NS`] after the first; before the
//! move it would raise it, so the report before is the one of the last [`BEFORE_NS`] that
//! showed the guest's clock furthest ahead ([`ClockMark`]), carried in the telemetry section. A
//! guest whose clocks advance by the pause and no more shows about 0; one whose clocks stopped
//! for the pause shows minus the pause.

use std::collections::VecDeque;

use ferry_guest_abi::report;
use serde::Serialize;

/// How long after the first report after a move the clock jump is still refined: dozens of
/// heartbeats, enough for one that was not late.
pub const SETTLE_NS: u64 = 1_000_000_000;

/// How far back before a move the reports are looked at for the least late one: a few
/// heartbeats of every vCPU, short enough that the guest's clock and the host's cannot drift
/// apart measurably over it.
pub const BEFORE_NS: u64 = 300_000_000;

/// The reports of the last [`BEFORE_NS`] that may still be the least late one, as (guest, host)
/// ns: a sliding-window maximum of the guest's clock less the host's, oldest first, each
/// entry further ahead than the ones after it.
#[derive(Clone, Debug, Default)]
pub struct ClockMark {
    window: VecDeque<(u64, u64)>,
}

impl ClockMark {
    /// The guest's clock less the host's at a report (wrapping: only differences matter).
    fn ahead((guest, host): (u64, u64)) -> i64 {
        guest.wrapping_sub(host) as i64
    }

    /// A report read `guest_ns` on the guest's clock and was handled at `host_ns`.
    pub fn report(&mut self, guest_ns: u64, host_ns: u64) {
        if guest_ns == 0 || host_ns == 0 {
            return;
        }
        let mark = (guest_ns, host_ns);
        while self
            .window
            .back()
            .is_some_and(|&m| Self::ahead(m) <= Self::ahead(mark))
        {
            self.window.pop_back();
        }
        self.window.push_back(mark);
        while self
            .window
            .front()
            .is_some_and(|&(_, host)| host_ns.saturating_sub(host) > BEFORE_NS)
        {
            self.window.pop_front();
        }
    }

    /// The least late report of the last [`BEFORE_NS`], (guest, host) ns.
    pub fn best(&self) -> Option<(u64, u64)> {
        self.window.front().copied()
    }
}

/// The boot vCPU's longest gap in its clocks since its report before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuestClockGap {
    /// Its length on kvmclock, and on the TSC at the guest's calibration against the PIT
    /// (`None` before the guest has one), and the TSC ticks it lasted.
    pub kvmclock_ns: u64,
    pub tsc_ns: Option<u64>,
    pub tsc_ticks: u64,
    /// kvmclock when it ended.
    pub ended_ns: u64,
    /// Gaps the guest saw since it booted, and the looks that found a clock gone back.
    pub gaps: u64,
    pub backwards: u64,
    /// What the guest takes for a gap (ns).
    pub threshold_ns: u64,
}

impl GuestClockGap {
    pub(super) fn from_detail(d: &[u64; report::DETAIL_WORDS]) -> GuestClockGap {
        use report::clock_gap::*;
        GuestClockGap {
            kvmclock_ns: d[KVMCLOCK_NS],
            tsc_ns: Some(d[TSC_NS]).filter(|&ns| ns != 0),
            tsc_ticks: d[TSC_TICKS],
            ended_ns: d[ENDED_NS],
            gaps: d[GAPS],
            backwards: d[BACKWARDS],
            threshold_ns: d[THRESHOLD_NS],
        }
    }
}

/// What a destination saw of the guest's clocks across the move that brought the guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MoveClocks {
    /// The clock jump (see the module doc), once the guest reported after the move.
    pub clock_jump_ns: Option<i64>,
    /// The guest's gap across the move, the pause as its clocks saw it: of the gaps it reported
    /// within [`SETTLE_NS`] of its first report after the move that span the move (they ended
    /// after the latest clock reading the source received and began before the first this VMM
    /// received), the one that ended last. A gap it saw after that reading and before the
    /// pause, and reported only after the move (the pause came between its look and its
    /// report), spans too by those readings, but the move's ends after it (the guest's gaps
    /// follow one another), in the report after. None while the guest has reported none, and for a pause shorter than the
    /// gap it takes note of (15 ms for the built-in guest).
    pub guest_gap: Option<GuestClockGap>,
    /// The last report before the move and the first after it: (guest, host) ns.
    #[serde(skip)]
    before: (u64, u64),
    #[serde(skip)]
    first_host_ns: u64,
    /// The latest guest clock reading before the move, and the first after it.
    #[serde(skip)]
    around: (u64, u64),
}

impl MoveClocks {
    /// A guest arrived, no report from it yet.
    pub(super) fn arrived() -> MoveClocks {
        MoveClocks::default()
    }

    /// The first report after the move, read `guest_ns` on the guest's clock and received at
    /// `host_ns`; `before` is the least late one before the move, (guest, host) ns (a guest
    /// time of 0: none), and `latest_guest_ns` the latest guest time read before it.
    pub(super) fn first_report(
        &mut self,
        before: (u64, u64),
        latest_guest_ns: u64,
        guest_ns: u64,
        host_ns: u64,
    ) {
        (self.before, self.first_host_ns) = (before, host_ns);
        self.around = (latest_guest_ns, guest_ns);
        self.report(guest_ns, host_ns);
    }

    /// A report after the first, within [`SETTLE_NS`] of it, refines the jump.
    pub(super) fn report(&mut self, guest_ns: u64, host_ns: u64) {
        let (guest_before, host_before) = self.before;
        if guest_before == 0 || host_ns.saturating_sub(self.first_host_ns) > SETTLE_NS {
            return;
        }
        let jump =
            guest_ns.wrapping_sub(guest_before) as i64 - host_ns.wrapping_sub(host_before) as i64;
        self.clock_jump_ns = Some(self.clock_jump_ns.map_or(jump, |j| j.max(jump)));
    }

    /// A gap report received at `host_ns`: of those within [`SETTLE_NS`] of the first report
    /// after the move that span it, the one that ended last is the move's.
    pub(super) fn gap(&mut self, gap: GuestClockGap, host_ns: u64) {
        let (latest, first) = self.around;
        let start = gap.ended_ns.saturating_sub(gap.kvmclock_ns);
        let spans = gap.ended_ns >= latest && start <= first;
        let settling = host_ns.saturating_sub(self.first_host_ns) <= SETTLE_NS;
        let later = self.guest_gap.is_none_or(|g| gap.ended_ns > g.ended_ns);
        if spans && settling && later {
            self.guest_gap = Some(gap);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock jump across a move: 0 for a guest whose clock advanced by the pause, minus
    /// the pause for one whose clock stopped for it; the first gap report is the move's.
    #[test]
    fn the_report_before_a_move_is_the_least_late_of_the_last_window() {
        let mut m = ClockMark::default();
        assert_eq!(m.best(), None);
        // On time (guest 100 ms ahead of the host's clock), then one 8 ms late, then on time
        // again: the late one is never the best.
        m.report(1_100_000_000, 1_000_000_000);
        m.report(1_120_000_000, 1_028_000_000);
        assert_eq!(m.best(), Some((1_100_000_000, 1_000_000_000)));
        m.report(1_140_000_000, 1_040_000_000);
        assert_eq!(
            m.best(),
            Some((1_140_000_000, 1_040_000_000)),
            "the newer of equals"
        );
        // A report 1 ms early is impossible, but a clock that drifts ahead wins while it is
        // within the window, and is forgotten after it.
        m.report(1_201_000_000, 1_100_000_000);
        m.report(1_300_000_000, 1_205_000_000);
        assert_eq!(m.best(), Some((1_201_000_000, 1_100_000_000)));
        m.report(1_480_000_000, 1_380_000_000);
        assert_eq!(m.best(), Some((1_201_000_000, 1_100_000_000)));
        m.report(1_700_000_000, 1_600_000_000 + BEFORE_NS / 2);
        assert_eq!(
            m.best(),
            Some((1_700_000_000, 1_600_000_000 + BEFORE_NS / 2)),
            "older than the window"
        );
        m.report(0, 2_000_000_000);
        assert_eq!(
            m.best(),
            Some((1_700_000_000, 1_600_000_000 + BEFORE_NS / 2))
        );
    }

    #[test]
    fn the_clock_jump_is_the_guests_gap_less_the_hosts_and_the_first_gap_is_the_moves() {
        let before = (105_000_000, 1_000_000_000);
        for (guest_after, jump) in [(405_000_000, 0), (105_500_000, -299_500_000)] {
            let mut m = MoveClocks::arrived();
            m.first_report(before, before.0, guest_after, 1_300_000_000);
            assert_eq!(m.clock_jump_ns, Some(jump));
        }
        // A first report 8 ms late, then one on time: the jump is the on-time one's; a report
        // past the settling time is not looked at.
        let mut m = MoveClocks::arrived();
        m.first_report(before, before.0, 405_000_000, 1_308_000_000);
        assert_eq!(m.clock_jump_ns, Some(-8_000_000));
        m.report(415_000_000, 1_310_000_000);
        assert_eq!(m.clock_jump_ns, Some(0));
        m.report(2_415_000_000, 3_000_000_000);
        assert_eq!(m.clock_jump_ns, Some(0));
        let mut m = MoveClocks::arrived();
        m.first_report((0, 0), 0, 5, 300);
        assert_eq!(m.clock_jump_ns, None, "no report before the move");
        let mut d = [0; report::DETAIL_WORDS];
        (
            d[report::clock_gap::KVMCLOCK_NS],
            d[report::clock_gap::TSC_NS],
            d[report::clock_gap::ENDED_NS],
        ) = (310, 0, 300);
        m.gap(GuestClockGap::from_detail(&d), 400);
        d[report::clock_gap::KVMCLOCK_NS] = 20;
        m.gap(GuestClockGap::from_detail(&d), 400);
        let g = m.guest_gap.unwrap();
        assert_eq!(
            (g.kvmclock_ns, g.tsc_ns),
            (310, None),
            "the one that spans, uncalibrated"
        );
    }

    /// A gap spans the move when it ends after the last clock reading before the move and
    /// begins before the first after it; one the guest saw earlier and reported after the move
    /// (the move came between its look and its report), or later, is not the move's. A gap the
    /// guest saw after the last reading before the move and reported after it spans by those
    /// readings, but the move's ends after it.
    #[test]
    fn regression_the_moves_gap_is_the_one_that_holds_the_pause() {
        let gap = |start: u64, end: u64| {
            let mut d = [0; report::DETAIL_WORDS];
            d[report::clock_gap::KVMCLOCK_NS] = end - start;
            d[report::clock_gap::ENDED_NS] = end;
            GuestClockGap::from_detail(&d)
        };
        // The latest reading before the move at 100 ms, the first after it at 160 ms.
        for (start, end, spans) in [(102, 155, true), (300, 500, false), (40, 90, false)] {
            let mut m = MoveClocks::arrived();
            m.first_report((100_000_000, 1), 100_000_000, 160_000_000, 61);
            m.gap(gap(start * 1_000_000, end * 1_000_000), 70);
            assert_eq!(m.guest_gap.is_some(), spans, "{start}..{end} ms");
        }
        // A gap seen before the move and reported after it, then the move's: the move's.
        let mut m = MoveClocks::arrived();
        m.first_report((100_000_000, 1), 100_000_000, 160_000_000, 61);
        m.gap(gap(40_000_000, 70_000_000), 70);
        m.gap(gap(101_000_000, 158_000_000), 80);
        m.gap(gap(300_000_000, 500_000_000), 90);
        assert_eq!(m.guest_gap.map(|g| g.ended_ns), Some(158_000_000));
        // Seen in the bench: the guest put aside for 32 ms after its last report before the
        // move, the pause falling after the look that ended that gap and before its report;
        // the move's gap (133 to 158 ms, shorter) came in the next report. One past the
        // settling time is not looked at.
        let mut m = MoveClocks::arrived();
        m.first_report((100_000_000, 1), 100_000_000, 160_000_000, 61);
        m.gap(gap(101_000_000, 133_000_000), 70);
        assert_eq!(m.guest_gap.map(|g| g.ended_ns), Some(133_000_000));
        m.gap(gap(133_000_000, 158_000_000), 80);
        m.gap(gap(90_000_000, 159_000_000), 61 + SETTLE_NS + 1);
        assert_eq!(m.guest_gap.map(|g| g.ended_ns), Some(158_000_000));
    }
}
