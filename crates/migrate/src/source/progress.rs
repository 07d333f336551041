//! What the session tells the world while it runs: the phase and figures published through
//! [`Control`](crate::control::Control), the samples of the report's timeline, and the final
//! statistics.
//!
//! Invariant: a phase change or pass end is always sampled ([`SampleKind::Boundary`]); the
//! per-batch samples are ticks the timeline thins out, and the progress between pass ends is
//! published at most every [`PUBLISH_INTERVAL`], so observing costs the loop next to nothing.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::forecast::MEASURED_BYTES;
use super::target::Target;
use super::{Session, ms};
use crate::control::{Phase, Progress};
use crate::job::{JobStats, Running};
use crate::policy::Observation;
use crate::predict::Prediction;
use crate::stats::{self, MigrationStats, PostcopyStats, Sample, SampleKind};
use crate::wire::PAGE_SIZE;

/// Publish progress between pass ends at most this often: a watcher polls every few hundred
/// ms, and on a capped link a batch can take longer than that, so the interval is in time, not
/// batches.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(50);

impl<P: Target> Session<'_, P> {
    /// After a batch went to the channels: samples the send rate, the destination's
    /// acknowledgements and the timeline, and now and then publishes progress.
    pub(super) fn after_batch(&mut self) {
        let now = Instant::now();
        self.link.bandwidth.record(now, self.bytes_written());
        let walked = self.walked_bytes();
        self.link.walk.record(now, walked);
        self.note_acks();
        self.report.samples += 1;
        self.sample(SampleKind::Tick);
        self.publish_running(now, None);
    }

    /// Publishes what was sent, the rate, what is left and when it should be sent, if
    /// [`PUBLISH_INTERVAL`] passed since the last time; in postcopy with its requests so far.
    pub(super) fn publish_running(&mut self, now: Instant, postcopy: Option<&PostcopyStats>) {
        if now.duration_since(self.report.published) >= PUBLISH_INTERVAL {
            self.publish(postcopy);
        }
    }

    /// Publishes what was sent, the rate, what is left and when it should be sent.
    pub(super) fn publish(&mut self, postcopy: Option<&PostcopyStats>) {
        self.report.published = Instant::now();
        let (sent, bandwidth, elapsed) = (
            self.bytes_written(),
            self.link.bandwidth.rate(),
            self.report.start.elapsed(),
        );
        let state = self.pending_state();
        let pages = self.report.first_pass_left + self.bitmap.count() * PAGE_SIZE;
        let eta = self.eta_ms(pages, state);
        let counted = self.counted();
        self.control.update(|p| {
            p.state_remaining_bytes = state;
            p.bytes_sent = sent;
            p.bandwidth_mb_s = bandwidth / 1e6;
            p.elapsed_ms = ms(elapsed);
            p.remaining_bytes = pages + state;
            p.eta_ms = eta;
            if let Some(pc) = postcopy {
                p.postcopy_requests = pc.requests;
                p.postcopy_pages_requested = pc.pages_requested;
            }
            p.job = Some(running_job(p, &counted));
        });
    }

    /// Publishes where precopy stands after pass `pass` and the dirty sync that ended it, with
    /// what it predicts; the prediction is kept with the pass's statistics too.
    pub(super) fn publish_pass(
        &mut self,
        pass: u32,
        now: &Observation,
        dirty_rate: f64,
        prediction: Option<Prediction>,
    ) {
        if let Some(last) = self.report.stats.passes.last_mut() {
            last.predicted = prediction;
        }
        let sent = self.bytes_written();
        let state = self.pending_state();
        let eta = self.eta_ms(self.bitmap.count() * PAGE_SIZE, state);
        // A rate measured over a few KB (runs of zero pages) predicts no pause worth showing.
        let downtime = if self.link.bandwidth.window_bytes() >= MEASURED_BYTES {
            now.expected_downtime().map(ms)
        } else {
            None
        };
        let counted = self.counted();
        self.control.update(|p| {
            p.pass = pass;
            p.state_remaining_bytes = state;
            p.bytes_sent = sent;
            p.remaining_bytes = now.remaining_bytes;
            p.bandwidth_mb_s = now.bandwidth / 1e6;
            p.dirty_rate_pages_per_s = dirty_rate;
            p.expected_downtime_ms = downtime;
            p.prediction = prediction;
            p.eta_ms = eta;
            p.elapsed_ms = ms(now.elapsed);
            p.job = Some(running_job(p, &counted));
        });
    }

    /// What the job statistics take from the session rather than the progress.
    fn counted(&mut self) -> Counted {
        let setup_ms = self.report.stats.setup_ms;
        Counted {
            pages_sent: self.walked_bytes() / PAGE_SIZE,
            data_page_bytes: self.peer.data_totals().0,
            setup_ms: (setup_ms > 0.0).then_some(setup_ms),
        }
    }

    /// When what is left should be sent: its pages at the walk's rate (zero pages go at the
    /// senders' speed, data at the link's), its device state at the send rate. `None` until
    /// the rates it needs are measured.
    fn eta_ms(&self, page_bytes: u64, state_bytes: u64) -> Option<f64> {
        let pages = eta_ms(page_bytes, self.link.walk.rate())?;
        let state = eta_ms(state_bytes, self.link.bandwidth.rate())?;
        Some(pages + state)
    }

    /// Publishes a new phase and marks it on the timeline. Past precopy, the pause a dirty
    /// sync predicted no longer applies, and is cleared.
    pub(super) fn set_phase(&mut self, phase: Phase) {
        // Precopy is shown with what it has left from its first look on, never a stale 0.
        let remaining = self.report.first_pass_left + self.bitmap.count() * PAGE_SIZE;
        let counted = self.counted();
        self.control.update(|p| {
            p.phase = phase;
            if phase == Phase::Precopy {
                p.remaining_bytes = remaining;
            } else {
                p.expected_downtime_ms = None;
            }
            p.job = Some(running_job(p, &counted));
        });
        self.mark(phase);
    }

    /// Marks a phase on the timeline only (the final phase is published with the statistics).
    pub(super) fn mark(&mut self, phase: Phase) {
        self.report.phase = phase;
        self.sample(SampleKind::Boundary);
    }

    /// Records where the migration stands on the report's timeline.
    pub(super) fn sample(&mut self, kind: SampleKind) {
        let sample = Sample {
            t_ms: ms(self.report.start.elapsed()),
            bytes_sent: self.bytes_written(),
            remaining_bytes: self.bitmap.count() * PAGE_SIZE,
            send_rate_mb_s: self.link.bandwidth.rate() / 1e6,
            dirty_rate_pages_per_s: self
                .report
                .stats
                .passes
                .last()
                .map_or(0.0, |p| p.dirty_rate_pages_per_s),
            pass: self.report.pass,
            phase: self.report.phase,
        };
        self.report.timeline.record(sample, kind);
    }

    /// The statistics as they stand, with the totals filled in.
    pub(super) fn finish_stats(&mut self) -> MigrationStats {
        let mut s = self.report.stats.clone();
        s.timeline = self.report.timeline.samples().to_vec();
        s.total_ms = ms(self.report.start.elapsed());
        s.bytes_sent = self.bytes_written();
        s.bandwidth_mb_s = s.bytes_sent as f64 / 1e6 / (s.total_ms / 1000.0).max(1e-3);
        s.cpu_seconds_source += (stats::thread_cpu_ns() - self.report.cpu_start) as f64 / 1e9;
        s.acked_bytes = self.peer.acks().map_or(0, |a| a.acked());
        s
    }
}

/// The figures a running source counts beside its progress, for [`running_job`].
struct Counted {
    pages_sent: u64,
    data_page_bytes: u64,
    setup_ms: Option<f64>,
}

/// The job statistics of a running source: its published progress `p` and what it counted.
fn running_job(p: &Progress, c: &Counted) -> JobStats {
    JobStats::running(&Running {
        elapsed_ms: p.elapsed_ms,
        eta_ms: p.eta_ms,
        bytes_sent: p.bytes_sent,
        memory_remaining_bytes: p.remaining_bytes.saturating_sub(p.state_remaining_bytes),
        state_remaining_bytes: p.state_remaining_bytes,
        pages_sent: c.pages_sent,
        // A snapshot's file counts no data records while it runs (its statistics do at the end).
        data_page_bytes: (!p.snapshot).then_some(c.data_page_bytes),
        send_rate: p.bandwidth_mb_s * 1e6,
        passes: p.pass,
        dirty_rate_pages_per_s: p.dirty_rate_pages_per_s,
        expected_downtime_ms: p.expected_downtime_ms,
        setup_ms: c.setup_ms,
        throttle_percent: p.throttle_percent,
        postcopy_requests: p.postcopy_requests,
    })
}

/// How long `remaining` bytes take at `rate` bytes per second; `None` before a rate is known.
fn eta_ms(remaining: u64, rate: f64) -> Option<f64> {
    if remaining == 0 {
        return Some(0.0);
    }
    (rate > 0.0).then(|| remaining as f64 / rate * 1e3)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_eta_is_what_remains_at_the_rate_and_unknown_without_one() {
        assert_eq!(super::eta_ms(100_000_000, 50e6), Some(2000.0));
        assert_eq!(super::eta_ms(0, 50e6), Some(0.0));
        assert_eq!(super::eta_ms(100, 0.0), None);
        assert_eq!(
            super::eta_ms(0, 0.0),
            Some(0.0),
            "nothing left needs no rate"
        );
    }
}
