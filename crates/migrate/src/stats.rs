//! What a migration measured: plain data, filled by the sessions, printed by the CLI.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::phase::Phase;
use crate::predict::{Prediction, Way};
use crate::wire::Latencies;

/// One stage of the way a postcopy page request goes (`ferry bench postcopy` prints them):
/// how many passed it, the mean, and the median, 99th percentile and longest in µs (the
/// percentiles are bounds of power-of-two buckets, within a factor of two).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl From<&Latencies> for Stage {
    fn from(l: &Latencies) -> Stage {
        Stage {
            count: l.requests,
            mean_us: l.mean_us(),
            p50_us: l.quantile_us(0.5),
            p99_us: l.quantile_us(0.99),
            max_us: l.max_us,
        }
    }
}
pub use crate::state_part::StatePart;

/// One precopy pass (pass 1 walks populated memory; later passes walk the dirty bitmap; the
/// last row, `final`, is what was sent with the guest paused).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PassStats {
    pub pass: u32,
    pub paused: bool,
    pub pages: u64,
    pub bytes: u64,
    pub duration_ms: f64,
    /// Pages the guest dirtied per second while this pass ran (from the sync that ended it).
    pub dirty_rate_pages_per_s: f64,
    /// The auto-converge throttle in force while this pass ran, percent.
    #[serde(default)]
    pub throttle_percent: u8,
    /// What the end of this pass predicted for each way to finish (`crate::predict`), to set
    /// beside the migration's actual `total_ms` and downtime; `None` before a rate was
    /// measured, for the final pass, and in statistics written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Prediction>,
}

impl MigrationStats {
    /// The way this migration finished: postcopy if it switched, auto-converge if it slowed
    /// the guest, else precopy.
    pub fn way_taken(&self) -> Way {
        if self.postcopy.is_some() {
            Way::Postcopy
        } else if self.throttle_max_percent > 0 || self.dirty_limit_min.is_some() {
            Way::AutoConverge
        } else {
            Way::Precopy
        }
    }

    /// The last prediction made before the way was taken (the last pass's that has one).
    pub fn last_prediction(&self) -> Option<&Prediction> {
        self.passes.iter().rev().find_map(|p| p.predicted.as_ref())
    }
}

/// Where the downtime went, as the source measures it (and the destination reports its part).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Downtime {
    /// Pause to Resumed acknowledgement.
    pub total_ms: f64,
    pub pause_ms: f64,
    pub final_sync_ms: f64,
    pub final_pages_ms: f64,
    pub state_save_ms: f64,
    /// Complete sent to Resumed received, less the destination's load and resume.
    pub transfer_ms: f64,
    pub load_ms: f64,
    pub resume_ms: f64,
    /// Bytes of device state (every section's data).
    #[serde(default)]
    pub state_bytes: u64,
    /// Where the state save went, part by part, as the source's VMM timed it (empty when the
    /// VMM does not say).
    #[serde(default)]
    pub save_parts: Vec<StatePart>,
    /// Where the destination's state load and resume went, part by part, as its VMM timed
    /// them (carried in the Resumed record).
    #[serde(default)]
    pub load_parts: Vec<StatePart>,
}

/// The statistics of one migration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationStats {
    pub total_ms: f64,
    pub setup_ms: f64,
    pub downtime: Downtime,
    pub bytes_sent: u64,
    pub pages_normal: u64,
    pub pages_zero: u64,
    /// Pages never sent because they were holes in the backing file when pass 1 reached them.
    pub pages_skipped_holes: u64,
    /// Pages never sent in a pass because the guest hinted them free (virtio-balloon free
    /// page hinting) before the pass reached them.
    #[serde(default)]
    pub pages_skipped_hinted: u64,
    /// Rounds of free page hints asked of the guest (0: no hints, the VMM or guest has none
    /// or they were off).
    #[serde(default)]
    pub hint_rounds: u32,
    pub passes: Vec<PassStats>,
    /// Payload bytes per second over the whole migration.
    pub bandwidth_mb_s: f64,
    pub cpu_seconds_source: f64,
    pub cpu_seconds_destination: f64,
    /// Longest dirty sync (the bounded-step promise, measured).
    pub max_sync_ms: f64,
    /// Longest step of precopy's control loop: the longest time between two looks at
    /// cancellation and the destination's messages while the guest ran (a batch queued, a
    /// paced sleep, a dirty sync, a hint round), so how long a cancel can wait.
    #[serde(default)]
    pub max_step_ms: f64,
    /// Whether the switchover came because the rest fit the downtime limit (rather than the
    /// timeout forcing it).
    pub converged: bool,
    /// Batches an offload zero-scan engine failed and the sender scanned itself.
    pub zero_scan_fallbacks: u64,
    /// What the senders' compression did and cost (`--compression`); `None` when off or not
    /// granted. Its CPU is part of `cpu_seconds_source` too.
    pub compression: Option<CompressionStats>,
    /// Time the VMM took to start dirty tracking (`SourceVm::start_dirty_log`, part of
    /// setup): with the reference VMM it follows populated memory, not configured RAM.
    #[serde(default)]
    pub dirty_start_ms: f64,
    /// Time spent before the switchover waiting, with nothing to send, for the destination to
    /// take in what was in flight (0 without progress acknowledgements).
    #[serde(default)]
    pub drain_ms: f64,
    /// Drains that waited out their bound ([`crate::policy::drain_bound`]) with bytes still in
    /// flight: the destination took them in slower than measured, or did not acknowledge them.
    #[serde(default)]
    pub drain_timeouts: u32,
    /// Bytes sent or queued but not acknowledged by the destination when the guest paused: the
    /// final pass queued behind them (0 without progress acknowledgements).
    #[serde(default)]
    pub in_flight_at_pause_bytes: u64,
    /// Bytes the destination had acknowledged when the migration ended.
    #[serde(default)]
    pub acked_bytes: u64,
    /// Chunks of iterative device state sent ([`crate::SourceVm::start_state_iteration`]),
    /// and their data bytes; 0 without such state.
    #[serde(default)]
    pub state_chunks: u64,
    #[serde(default)]
    pub state_chunk_bytes: u64,
    /// The migration sampled over time (see [`Timeline`]); empty in statistics written before
    /// it existed.
    #[serde(default)]
    pub timeline: Vec<Sample>,
    /// What postcopy did, if the migration switched to it.
    #[serde(default)]
    pub postcopy: Option<PostcopyStats>,
    /// The highest auto-converge throttle the guest ran under, percent (0: never throttled).
    #[serde(default)]
    pub throttle_max_percent: u8,
    /// The policy wanted to throttle but the VMM cannot: auto-converge was off.
    #[serde(default)]
    pub throttle_unsupported: bool,
    /// The lowest per-vCPU dirty limit in force, bytes per second (`None`: never limited).
    #[serde(default)]
    pub dirty_limit_min: Option<u64>,
    /// Auto-converge was asked to limit each vCPU's dirty rate but the VMM cannot: it throttled
    /// the whole guest instead.
    #[serde(default)]
    pub dirty_limit_unsupported: bool,
    /// What each vCPU dirtied and how long the dirty limit made it sleep, where the VMM can
    /// tell (the reference VMM with its dirty ring); empty elsewhere.
    #[serde(default)]
    pub vcpus: Vec<VcpuDirty>,
    /// A snapshot's memory for its final pass: buffers made before the pause (at most its
    /// staging limit), 0 for a migration.
    #[serde(default)]
    pub staged_bytes: u64,
    /// Pages of a snapshot's final pass written to the file during the pause because the
    /// staging buffers were full.
    #[serde(default)]
    pub final_pages_written_in_pause: u64,
}

/// One vCPU's dirtying over a migration's precopy, as its VMM counted it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VcpuDirty {
    pub vcpu: u32,
    /// Pages it dirtied while dirty tracking was on.
    pub dirtied_pages: u64,
    /// Time it slept for the dirty limit.
    pub limited_ms: f64,
}

/// Why a migration switched to postcopy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PostcopyTrigger {
    /// `ferry migrate-postcopy` / `PUT /migration/postcopy`.
    #[default]
    Asked,
    /// The pass count given with the migration.
    AfterPasses,
    /// The policy: precopy stalled, or the timeout's action.
    Policy,
    /// The prediction chose it (`--postcopy-auto`): the least downtime within 1.1x of the
    /// fastest way.
    Prediction,
}

/// A migration's postcopy phase, from the pause to the destination's Done.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PostcopyStats {
    /// Precopy passes before the switch.
    pub after_passes: u32,
    /// Why it switched.
    #[serde(default)]
    pub trigger: PostcopyTrigger,
    /// Pause to Done: how long the guest's memory was split between the hosts.
    pub duration_ms: f64,
    /// Pages the destination had to drop and fetch again (dirty at the switch).
    pub discarded_pages: u64,
    /// Discard lists sent before the pause, each after the destination applied the last.
    #[serde(default)]
    pub early_discard_rounds: u32,
    /// Pages sent because the destination asked for them.
    pub pages_requested: u64,
    /// Pages sent by the background walk.
    pub pages_background: u64,
    /// Requested pages the walk had sent already, sent again on the preempt connection so
    /// that the vCPU waiting for them does not wait behind the background stream.
    #[serde(default)]
    pub pages_resent: u64,
    /// Pages sent after a request because the vCPU faulted in order (postcopy readahead):
    /// counted in the run they were sent with, as requested or resent pages.
    #[serde(default)]
    pub pages_readahead: u64,
    /// Requested pages the source's reader sent itself, without handing the request to the
    /// migration thread (on the preempt connection, or on the main connection without one).
    #[serde(default)]
    pub pages_forwarded: u64,
    /// Requested pages sent on the main connection ([`crate::wire::Capabilities::MAIN_PAGES`],
    /// without a preempt connection, once the guest resumed there).
    #[serde(default)]
    pub pages_on_main: u64,
    /// Page request runs the destination sent (a run asked for a page the walk had sent
    /// already counts too).
    pub requests: u64,
    /// Requests for a page the background push had not sent yet when the request was served
    /// (the rest asked for a page already on its way): the faults a better push order would
    /// have saved.
    #[serde(default)]
    pub faults_unreached: u64,
    /// Bytes written after the switch, on all connections.
    pub bytes: u64,
    /// Fault to page in place, as the destination measured it (µs).
    pub latency_mean_us: f64,
    pub latency_p50_us: u64,
    pub latency_p99_us: u64,
    pub latency_max_us: u64,
    /// Bucket k counts requests that took [2^k, 2^(k+1)) µs.
    pub latency_buckets: Vec<u64>,
    /// The source's part of a request's way: from the request read on the main connection to
    /// its pages written on their connection (the oldest request of those served together).
    #[serde(default)]
    pub source_turnaround: Stage,
    /// The first part of it: from the request read to the migration thread taking it (the
    /// reader's hand-off, and however long the migration thread was busy elsewhere).
    #[serde(default)]
    pub source_handoff: Stage,
    /// Times a broken connection paused postcopy and a recovery resumed it.
    #[serde(default)]
    pub recoveries: u32,
    /// Time spent in postcopy-paused, over all recoveries (ms).
    #[serde(default)]
    pub paused_ms: f64,
    /// Time the destination's threads waited for pages they asked for: the sum of the
    /// fault-to-page times (QEMU's postcopy blocktime; exact for one vCPU, and with several
    /// a wait on a page another vCPU asked for first is not counted).
    #[serde(default)]
    pub vcpu_blocktime_ms: f64,
    /// Where the background push's time went on this side (`stage_clock.rs`).
    #[serde(default)]
    pub push: crate::stage_clock::PushStages,
}

/// The migration at one moment, for `ferry report`'s timeline.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Since the migration started.
    pub t_ms: f64,
    /// Bytes written on all connections so far.
    pub bytes_sent: u64,
    /// Dirty bytes known to remain: what the last dirty sync found, less what has been sent
    /// since (0 during pass 1, before the first sync).
    pub remaining_bytes: u64,
    /// Send rate over the bandwidth window.
    pub send_rate_mb_s: f64,
    /// The guest's dirty rate as the last sync measured it.
    pub dirty_rate_pages_per_s: f64,
    pub pass: u32,
    pub phase: Phase,
}

/// Whether a sample may be skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleKind {
    /// A progress tick: kept only if [`Timeline::interval`] has passed since the last sample.
    Tick,
    /// A pass end or phase change: always kept.
    Boundary,
}

/// A time series of bounded length. Ticks are kept every [`SAMPLE_INTERVAL`] at most; when
/// [`MAX_SAMPLES`] are held, every other tick is dropped and the interval doubles, so a long
/// migration keeps its whole span at a coarser grain and boundaries are never lost.
#[derive(Clone, Debug)]
pub struct Timeline {
    samples: Vec<Sample>,
    interval_ms: f64,
}

/// 25 ms between ticks: a chart 1,000 pixels wide over a 25 s migration gets one sample per
/// pixel, and the shortest passes seen on loopback (tens of ms) still get a few.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(25);
/// 2,048 samples of ~150 bytes of JSON each keep the statistics under 300 KiB, however long
/// the migration: 51 s at the full 25 ms grain, then halved resolution per doubling.
pub const MAX_SAMPLES: usize = 2048;

impl Default for Timeline {
    fn default() -> Timeline {
        Timeline {
            samples: Vec::new(),
            interval_ms: SAMPLE_INTERVAL.as_secs_f64() * 1000.0,
        }
    }
}

impl Timeline {
    pub fn record(&mut self, sample: Sample, kind: SampleKind) {
        let due = self
            .samples
            .last()
            .is_none_or(|last| sample.t_ms - last.t_ms >= self.interval_ms);
        if kind == SampleKind::Tick && !due {
            return;
        }
        self.samples.push(sample);
        if self.samples.len() >= MAX_SAMPLES {
            self.decimate();
        }
    }

    /// Current gap between ticks, in ms.
    pub fn interval(&self) -> f64 {
        self.interval_ms
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Drops every other sample but the first, the last and those that start a new pass or
    /// phase; if boundaries alone fill the series (thousands of passes), drops every other one
    /// regardless.
    fn decimate(&mut self) {
        self.interval_ms *= 2.0;
        let keep = |i: usize, s: &[Sample]| {
            i == 0
                || i + 1 == s.len()
                || i.is_multiple_of(2)
                || s[i].pass != s[i - 1].pass
                || s[i].phase != s[i - 1].phase
        };
        let old = std::mem::take(&mut self.samples);
        self.samples = (0..old.len())
            .filter(|&i| keep(i, &old))
            .map(|i| old[i].clone())
            .collect();
        if self.samples.len() > MAX_SAMPLES * 3 / 4 {
            let old = std::mem::take(&mut self.samples);
            let last = old.len() - 1;
            self.samples = old
                .into_iter()
                .enumerate()
                .filter(|&(i, _)| i.is_multiple_of(2) || i == last)
                .map(|(_, s)| s)
                .collect();
        }
    }
}

/// CPU time this thread has used, in ns.
pub fn thread_cpu_ns() -> u64 {
    cpu_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn cpu_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    #[allow(unsafe_code)]
    unsafe {
        libc::clock_gettime(clock, &mut ts)
    };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What compression did and cost on one side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompressionStats {
    /// Batches sent compressed.
    pub records_compressed: u64,
    /// Batches compressed but sent raw (too little saved), or not compressed by `auto`.
    pub records_raw: u64,
    /// Page bytes that went into the sent compressed records.
    pub bytes_in: u64,
    /// The compressed records' frame bytes.
    pub bytes_out: u64,
    /// CPU seconds spent compressing (source) or decompressing (destination).
    pub cpu_seconds: f64,
}

impl CompressionStats {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &CompressionStats) {
        self.records_compressed += other.records_compressed;
        self.records_raw += other.records_raw;
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.cpu_seconds += other.cpu_seconds;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t_ms: f64, pass: u32) -> Sample {
        Sample {
            t_ms,
            pass,
            phase: Phase::Precopy,
            ..Sample::default()
        }
    }

    #[test]
    fn ticks_closer_than_the_interval_are_dropped_but_boundaries_are_kept() {
        let mut t = Timeline::default();
        t.record(at(0.0, 1), SampleKind::Tick);
        t.record(at(10.0, 1), SampleKind::Tick);
        t.record(at(11.0, 1), SampleKind::Boundary);
        t.record(at(40.0, 2), SampleKind::Tick);
        let times: Vec<f64> = t.samples().iter().map(|s| s.t_ms).collect();
        assert_eq!(times, [0.0, 11.0, 40.0]);
    }

    #[test]
    fn a_long_migration_stays_bounded_and_keeps_its_span_and_pass_starts() {
        let mut t = Timeline::default();
        // An hour at one tick per ms, a new pass every 10 s.
        for ms in 0..3_600_000u32 {
            t.record(at(f64::from(ms), 1 + ms / 10_000), SampleKind::Tick);
        }
        let s = t.samples();
        assert!(s.len() < MAX_SAMPLES, "{}", s.len());
        assert!(s.len() > MAX_SAMPLES / 4, "{}", s.len());
        assert_eq!(s[0].t_ms, 0.0);
        assert!(s.last().unwrap().t_ms > 3_500_000.0);
        let passes: std::collections::BTreeSet<u32> = s.iter().map(|s| s.pass).collect();
        assert_eq!(passes.len(), 360, "every pass has a sample");
        assert!(s.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
    }
}
