//! The bandwidth limit as a pure value: it counts the bytes handed to the link since the
//! migration started and, given the time elapsed since then, says how long to wait so that
//! the average stays at or under the limit. It never sleeps and never reads a clock; the
//! session does both (in slices of [`MAX_SLEEP`], looking at cancellation in between).
//!
//! The limit is an average since the limit was set (the migration's start, or when a running
//! migration was given a new limit), not a window: time the link was idle (a dirty sync, a
//! pause) is credit that later batches may spend at full speed.

#![forbid(unsafe_code)]

use std::time::Duration;

/// Longest the rate limiter sleeps before looking at cancellation again: a cancel takes effect
/// within 50 ms, and at the smallest useful limit (a few MB/s) a 512 KiB batch is over in
/// ~100 ms, so a batch takes at most a few slices.
pub const MAX_SLEEP: Duration = Duration::from_millis(50);

/// Whether a batch counts against the bandwidth limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pacing {
    /// Precopy while the guest runs: wait as the limiter says.
    Limited,
    /// The final pass with the guest paused: downtime, so as fast as the link goes.
    Unlimited,
}

/// Bytes handed over at a limit of `rate` bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limiter {
    rate: u64,
    bytes: u64,
    /// When the limit was set, after the migration's start.
    origin: Duration,
}

impl Limiter {
    /// A limiter at `rate` bytes per second that has handed over nothing yet.
    pub fn new(rate: u64) -> Limiter {
        Limiter::from(rate, Duration::ZERO)
    }

    /// A limiter at `rate` set `origin` after the migration's start: the average counts from
    /// there, so a new limit neither bursts on the old one's idle credit nor pays its debt.
    pub fn from(rate: u64, origin: Duration) -> Limiter {
        Limiter {
            rate,
            bytes: 0,
            origin,
        }
    }

    /// Counts `bytes` about to be handed over.
    pub fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
    }

    /// Counts `bytes` handed over since the limit was set, as measured: unlike [`Limiter::add`]
    /// it may lower the count, when what was counted ahead cost less than counted.
    pub fn set(&mut self, bytes: u64) {
        self.bytes = bytes;
    }

    /// How long to wait, `elapsed` after the start, before what was counted may go out: the
    /// time the counted bytes take at the limit, less the time already spent. Zero when the
    /// average is already at or under the limit.
    pub fn wait(&self, elapsed: Duration) -> Duration {
        Duration::from_secs_f64(self.bytes as f64 / self.rate as f64)
            .saturating_sub(elapsed.saturating_sub(self.origin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_limit_set_later_counts_from_when_it_was_set() {
        let mut l = Limiter::from(1_000, MS(10_000));
        l.add(500);
        assert_eq!(
            l.wait(MS(10_000)),
            MS(500),
            "no credit from before it was set"
        );
        assert_eq!(l.wait(MS(10_200)), MS(300));
        assert_eq!(l.wait(MS(11_000)), MS(0));
    }

    #[test]
    fn wait_is_the_time_the_bytes_take_at_the_limit_less_the_time_spent() {
        // (rate B/s, bytes counted, elapsed, wait)
        let table = [
            // Nothing counted: never wait.
            (1_000, 0, MS(0), MS(0)),
            // 500 B at 1000 B/s take 500 ms.
            (1_000, 500, MS(0), MS(500)),
            (1_000, 500, MS(200), MS(300)),
            // Exactly on time: go.
            (1_000, 500, MS(500), MS(0)),
            // Behind the limit (the link idled): go at once, no negative wait.
            (1_000, 500, MS(900), MS(0)),
            // 100 MB/s: a 2 MiB record is ~21 ms of budget.
            (
                100_000_000,
                2 << 20,
                MS(0),
                Duration::from_nanos(20_971_520),
            ),
            // 10 GiB at 1 GB/s, 10 s in: the remaining ~737 ms.
            (
                1_000_000_000,
                10 << 30,
                MS(10_000),
                Duration::from_nanos(737_418_240),
            ),
        ];
        for (rate, bytes, elapsed, want) in table {
            let mut l = Limiter::new(rate);
            l.add(bytes);
            assert_eq!(
                l.wait(elapsed),
                want,
                "{bytes} B at {rate} B/s after {elapsed:?}"
            );
        }
    }

    #[test]
    fn counts_accumulate_over_batches() {
        let mut l = Limiter::new(1_000);
        for _ in 0..4 {
            l.add(250);
        }
        assert_eq!(l.wait(MS(0)), MS(1_000));
        assert_eq!(l.wait(MS(400)), MS(600));
    }

    #[test]
    fn a_slow_link_limit_never_overflows() {
        // 1 B/s and a 64 GiB guest: a wait of 2^36 s is still a Duration.
        let mut l = Limiter::new(1);
        l.add(64 << 30);
        assert_eq!(l.wait(MS(0)), Duration::from_secs(64 << 30));
    }
}
