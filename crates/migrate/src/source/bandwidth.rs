//! The send rate as a pure value: a window of (time, total bytes written) samples, one per
//! batch handed to the channels, and the rate between its oldest and newest sample. The
//! convergence policy divides the remaining bytes by this rate, so it should follow the link
//! as it is now rather than the average since the start.
//!
//! Invariant: after a sample is recorded the window spans at most [`WINDOW`] plus one sample
//! interval, and holds at least two samples once two were recorded (so a slow link whose
//! samples are further apart than the window still has a rate).

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Window over which the send rate is measured for the convergence decision: long enough to
/// span several records, short enough to follow a changing link.
pub const WINDOW: Duration = Duration::from_secs(1);

/// Recent (time, total bytes written) samples.
#[derive(Clone, Debug, Default)]
pub struct BandwidthWindow {
    samples: VecDeque<(Instant, u64)>,
}

impl BandwidthWindow {
    /// Records that `total_bytes` had been written by `now`, and forgets the samples the window
    /// no longer needs: the oldest goes while the one after it is at least [`WINDOW`] old.
    pub fn record(&mut self, now: Instant, total_bytes: u64) {
        self.samples.push_back((now, total_bytes));
        while self.samples.len() > 2 && now - self.samples[1].0 >= WINDOW {
            self.samples.pop_front();
        }
    }

    /// Bytes per second over the window; 0 until two samples lie apart in time.
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
}
