//! The send rate as a pure value: a window of (time, total bytes) samples, one per batch handed
//! to the channels (or per acknowledgement from the destination), and the rate between its
//! oldest and newest sample. The convergence policy divides the remaining bytes by this rate,
//! so it should follow the link as it is now rather than the average since the start.
//!
//! The rate is the link's, not the guest's: time with nothing to carry does not count. An idle
//! guest sends a few pages a pass and then nothing until the next; over wall-clock time its
//! "rate" would be a few KB/s, its few dirty pages would never fit the downtime limit, and
//! precopy would iterate until the window happened to hold a burst (QEMU has the same blind
//! spot, and asks the user for `avail-switchover-bandwidth` instead). So the window runs on a
//! clock that stops while the pipeline is empty ([`BandwidthWindow::idle`]) and starts again
//! when something is handed to it ([`BandwidthWindow::busy`]).
//!
//! Invariant: after a sample is recorded the window spans at most [`WINDOW`] of busy time plus
//! one sample interval, and holds at least two samples once two were recorded (so a slow link
//! whose samples are further apart than the window still has a rate).

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Window over which the send rate is measured for the convergence decision: long enough to
/// span several records, short enough to follow a changing link.
pub const WINDOW: Duration = Duration::from_secs(1);

/// Recent (busy time, total bytes) samples.
#[derive(Clone, Debug, Default)]
pub struct BandwidthWindow {
    samples: VecDeque<(Duration, u64)>,
    /// Busy time up to `since`.
    busy: Duration,
    /// When the clock last advanced; `None` while it is stopped (or before the first sample).
    since: Option<Instant>,
}

impl BandwidthWindow {
    /// The clock at `now`: busy time so far, counting from `since` only while it runs.
    fn tick(&mut self, now: Instant) -> Duration {
        if let Some(since) = self.since {
            self.busy += now.saturating_duration_since(since);
            self.since = Some(now);
        }
        self.busy
    }

    /// Records that `total_bytes` had been carried by `now`, and forgets the samples the
    /// window no longer needs: the oldest goes while the one after it is at least [`WINDOW`]
    /// old. The first sample starts the clock.
    pub fn record(&mut self, now: Instant, total_bytes: u64) {
        if self.samples.is_empty() && self.since.is_none() {
            self.since = Some(now);
        }
        let t = self.tick(now);
        self.samples.push_back((t, total_bytes));
        while self.samples.len() > 2 && t - self.samples[1].0 >= WINDOW {
            self.samples.pop_front();
        }
    }

    /// The pipeline had carried everything handed to it, `total_bytes` in all, by `now`: a last
    /// sample, and the clock stops. Until [`BandwidthWindow::busy`] further calls do nothing,
    /// so a session that looks often while idle adds no samples (the window's bound is in busy
    /// time, which does not pass then).
    pub fn idle(&mut self, now: Instant, total_bytes: u64) {
        if self.since.is_none() {
            return;
        }
        self.record(now, total_bytes);
        self.since = None;
    }

    /// Something was handed to the pipeline at `now`: the clock runs again from here. The
    /// first call also records where the count stood (`total_bytes`), so that the first
    /// sample after it already measures a rate.
    pub fn busy(&mut self, now: Instant, total_bytes: u64) {
        if self.since.is_some() {
            return;
        }
        self.since = Some(now);
        if self.samples.is_empty() {
            self.samples.push_back((self.busy, total_bytes));
        }
    }

    /// Bytes carried between the window's oldest and newest sample.
    pub fn window_bytes(&self) -> u64 {
        match (self.samples.front(), self.samples.back()) {
            (Some(&(_, b0)), Some(&(_, b1))) => b1 - b0,
            _ => 0,
        }
    }

    /// Bytes per second over the window; 0 until two samples lie apart in busy time.
    pub fn rate(&self) -> f64 {
        match (self.samples.front(), self.samples.back()) {
            (Some(&(t0, b0)), Some(&(t1, b1))) if t1 > t0 => {
                (b1 - b0) as f64 / (t1 - t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a window from (ms since a base instant, total bytes) samples.
    fn window(samples: &[(u64, u64)]) -> BandwidthWindow {
        let base = Instant::now();
        let mut w = BandwidthWindow::default();
        for &(t_ms, bytes) in samples {
            w.record(base + Duration::from_millis(t_ms), bytes);
        }
        w
    }

    /// A row: name, samples as (ms, total bytes), the rate in bytes per second.
    type Row = (&'static str, &'static [(u64, u64)], f64);

    #[test]
    fn rate_over_the_window() {
        let table: &[Row] = &[
            ("no samples", &[], 0.0),
            ("one sample", &[(0, 1_000)], 0.0),
            ("two samples at one instant", &[(5, 0), (5, 1_000)], 0.0),
            ("1 MB in 1 s", &[(0, 0), (1_000, 1_000_000)], 1e6),
            (
                "1 MB in 500 ms",
                &[(0, 0), (250, 100), (500, 1_000_000)],
                2e6,
            ),
            (
                // The first sample is forgotten once the second is a window old: the rate is
                // the recent 1 MB/s, not the average with the idle start.
                "the idle start falls out",
                &[(0, 0), (5_000, 0), (6_000, 1_000_000), (7_000, 2_000_000)],
                1e6,
            ),
            (
                // Samples a window apart: two are always kept, so a rate remains.
                "a slow link keeps two samples",
                &[(0, 0), (3_000, 3_000), (6_000, 9_000)],
                2_000.0,
            ),
            (
                // Nothing is forgotten within the window.
                "a burst inside the window",
                &[(0, 0), (100, 500_000), (900, 500_000)],
                500_000.0 / 0.9,
            ),
        ];
        for &(name, samples, want) in table {
            let got = window(samples).rate();
            assert!(
                (got - want).abs() < 1e-6 * want.max(1.0),
                "{name}: {got} != {want}"
            );
        }
    }

    #[test]
    fn the_window_stays_bounded() {
        // A batch every 10 ms for a minute: the window holds about a second of them.
        let samples: Vec<(u64, u64)> = (0..6_000).map(|i| (i * 10, i * 1_000)).collect();
        let w = window(&samples);
        assert!(w.samples.len() <= 102, "{}", w.samples.len());
        assert!((w.rate() - 100_000.0).abs() < 1e-6);
    }

    /// The events of a window over a run, in ms since a base instant.
    enum At {
        Record(u64, u64),
        Idle(u64, u64),
        Busy(u64, u64),
    }

    #[test]
    fn time_with_nothing_to_carry_does_not_count() {
        use At::*;
        // (name, events, rate in bytes per second)
        let table: &[(&str, &[At], f64)] = &[
            (
                // An idle guest: 24 KB carried in 10 ms, then a second with nothing to send,
                // then 24 KB again in 10 ms: the link's rate, not 48 KB over a second.
                "bursts apart",
                &[
                    Busy(0, 0),
                    Record(10, 24_000),
                    Idle(10, 24_000),
                    Busy(1_000, 24_000),
                    Record(1_010, 48_000),
                ],
                2.4e6,
            ),
            (
                // The first busy call is the baseline: one sample after it measures a rate.
                "one sample after the start",
                &[Busy(500, 1_000), Record(510, 25_000)],
                2.4e6,
            ),
            (
                // Idle twice, busy twice: the clock stops and starts once.
                "idempotent",
                &[
                    Busy(0, 0),
                    Record(10, 10_000),
                    Idle(10, 10_000),
                    Idle(500, 10_000),
                    Busy(900, 10_000),
                    Busy(905, 10_000),
                    Record(910, 20_000),
                ],
                1e6,
            ),
            (
                // Without idle calls the clock is the wall clock, as before.
                "always busy",
                &[Record(0, 0), Record(1_000, 1_000_000)],
                1e6,
            ),
        ];
        for &(name, events, want) in table {
            let base = Instant::now();
            let at = |t: u64| base + Duration::from_millis(t);
            let mut w = BandwidthWindow::default();
            for e in events {
                match *e {
                    Record(t, bytes) => w.record(at(t), bytes),
                    Idle(t, bytes) => w.idle(at(t), bytes),
                    Busy(t, bytes) => w.busy(at(t), bytes),
                }
            }
            let got = w.rate();
            assert!((got - want).abs() < 1e-6 * want, "{name}: {got} != {want}");
        }
    }

    #[test]
    fn looking_while_idle_adds_no_samples() {
        let base = Instant::now();
        let mut w = BandwidthWindow::default();
        w.busy(base, 0);
        w.record(base + Duration::from_millis(10), 24_000);
        for ms in 10..5_000 {
            w.idle(base + Duration::from_millis(ms), 24_000);
        }
        assert!(w.samples.len() <= 3, "{}", w.samples.len());
        assert!((w.rate() - 2.4e6).abs() < 1.0, "{}", w.rate());
    }
}
