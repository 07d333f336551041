//! A migration's figures named as libvirt names a job's (`virDomainGetJobStats`'s typed
//! parameters, `VIR_DOMAIN_JOB_*`), so that a control plane written against libvirt maps each
//! field one to one: `time_elapsed_ms` is `VIR_DOMAIN_JOB_TIME_ELAPSED`, `memory_bps` is
//! `VIR_DOMAIN_JOB_MEMORY_BPS`, and so on (the README's Control API holds the whole table,
//! and the libvirt fields ferry has not, with why).
//!
//! Units are libvirt's: ms, bytes, bytes/s, pages/s, percent. Every figure is one the engine
//! measured or counted; a figure that needs a rate not measured yet (the time remaining, the
//! expected downtime) is `None` (JSON `null`) until it is, never a guess.
//!
//! Invariant: `data_total_bytes = data_processed_bytes + data_remaining_bytes`, and the same
//! for `memory_*`: the total is what the job is known to carry as it stands now, so it grows
//! when the guest dirties memory again (libvirt allows that of an unbounded job; QEMU gives
//! guest RAM's size as memory's total instead, which `GET /vm` shows).
//!
//! Pure: plain figures in, a value out ([`JobStats::running`], [`JobStats::completed`]); the
//! source session fills it when it publishes progress (`source/progress.rs`).

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::stats::MigrationStats;
use crate::wire::PAGE_SIZE;

/// A migration's job statistics, field for field libvirt's (`VIR_DOMAIN_JOB_` + the name in
/// capitals, less the unit: `data_total_bytes` is `VIR_DOMAIN_JOB_DATA_TOTAL`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStats {
    /// `TIME_ELAPSED`: since the migration started.
    pub time_elapsed_ms: u64,
    /// `TIME_REMAINING`: what is known to remain at the rates measured now (precopy's next
    /// dirty sync may find more); `null` until the rates are measured.
    pub time_remaining_ms: Option<u64>,
    /// `DATA_TOTAL`: processed + remaining.
    pub data_total_bytes: u64,
    /// `DATA_PROCESSED`: bytes written on every connection (pages, device state, a copied
    /// disk's chunks, the records' headers).
    pub data_processed_bytes: u64,
    /// `DATA_REMAINING`: guest memory still to send, at a page each, and the iterative device
    /// state still to send.
    pub data_remaining_bytes: u64,
    /// `MEMORY_TOTAL`: processed + remaining.
    pub memory_total_bytes: u64,
    /// `MEMORY_PROCESSED`: guest pages sent (with data or as zero runs), at a page each.
    pub memory_processed_bytes: u64,
    /// `MEMORY_REMAINING`: guest pages still to send, at a page each.
    pub memory_remaining_bytes: u64,
    /// `MEMORY_CONSTANT`: pages sent as zero pages; `null` where the target does not count
    /// them while it runs (a snapshot's file: until it ends).
    pub memory_constant_pages: Option<u64>,
    /// `MEMORY_NORMAL`: pages sent with their data.
    pub memory_normal_pages: Option<u64>,
    /// `MEMORY_NORMAL_BYTES`: the data of those pages (before compression, with
    /// `--compression`).
    pub memory_normal_bytes: Option<u64>,
    /// `MEMORY_BPS`: the send rate, bytes/s: over the rate window while the job runs, the
    /// average over the whole job once it ended; `null` until measured.
    pub memory_bps: Option<u64>,
    /// `MEMORY_DIRTY_RATE`: pages/s the guest dirtied, from the last dirty sync; `null` before
    /// the first.
    pub memory_dirty_rate_pages_per_s: Option<u64>,
    /// `MEMORY_ITERATION`: dirty syncs done (precopy passes ended; at the end, with the final
    /// pass's, made in the pause).
    pub memory_iteration: u32,
    /// `MEMORY_PAGE_SIZE`.
    pub memory_page_size_bytes: u64,
    /// `MEMORY_POSTCOPY_REQS`: page requests the destination sent in postcopy.
    pub memory_postcopy_requests: u64,
    /// `DOWNTIME`: while precopy runs, the pause the last dirty sync predicts (`null` until the
    /// send rate is measured); once the job completed, the downtime measured (pause to the
    /// destination's Resumed).
    pub downtime_ms: Option<u64>,
    /// `DOWNTIME_NET`: the measured downtime less the time the handover spent on the network
    /// (Complete written to Resumed read, less the destination's load and resume); once
    /// completed only.
    pub downtime_net_ms: Option<u64>,
    /// `SETUP_TIME`: from the start to the first pass (the connections, the hello, the dirty
    /// log started); `null` while in setup.
    pub setup_time_ms: Option<u64>,
    /// `AUTO_CONVERGE_THROTTLE`: the guest's throttle in force, percent (at the end, the one
    /// the last pass ran under).
    pub auto_converge_throttle_percent: u8,
    /// `DISK_TOTAL`, `DISK_PROCESSED`, `DISK_REMAINING`, `DISK_BPS`: a disk no host shares,
    /// copied beside memory. The engine does not know which iterative device state is a disk,
    /// so these are the VMM's to fill (the reference VMM does in `GET /migration`); `null`
    /// without a disk copy.
    pub disk_total_bytes: Option<u64>,
    pub disk_processed_bytes: Option<u64>,
    pub disk_remaining_bytes: Option<u64>,
    pub disk_bps: Option<u64>,
}

/// What a running source measured, as [`JobStats::running`] takes it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Running {
    pub elapsed_ms: f64,
    /// When what is known to remain should be sent; `None` until the rates are measured.
    pub eta_ms: Option<f64>,
    /// Bytes written on every connection.
    pub bytes_sent: u64,
    /// Guest memory's remaining bytes.
    pub memory_remaining_bytes: u64,
    /// The iterative device state's remaining bytes.
    pub state_remaining_bytes: u64,
    /// Pages the senders wrote, with data or as zero runs.
    pub pages_sent: u64,
    /// Of them, the bytes sent with their data; `None` where the target does not count them.
    pub data_page_bytes: Option<u64>,
    /// The send rate, bytes/s (0: not measured yet).
    pub send_rate: f64,
    /// Pass ends (dirty syncs) so far, and the dirty rate the last one measured.
    pub passes: u32,
    pub dirty_rate_pages_per_s: f64,
    pub expected_downtime_ms: Option<f64>,
    /// `None` while in setup.
    pub setup_ms: Option<f64>,
    pub throttle_percent: u8,
    pub postcopy_requests: u64,
}

impl JobStats {
    /// The job as a running source measured it.
    pub fn running(now: &Running) -> JobStats {
        let memory_processed = now.pages_sent * PAGE_SIZE;
        let normal_pages = now.data_page_bytes.map(|b| b / PAGE_SIZE);
        let data_remaining = now.memory_remaining_bytes + now.state_remaining_bytes;
        JobStats {
            time_elapsed_ms: whole(now.elapsed_ms),
            time_remaining_ms: now.eta_ms.map(whole),
            data_total_bytes: now.bytes_sent + data_remaining,
            data_processed_bytes: now.bytes_sent,
            data_remaining_bytes: data_remaining,
            memory_total_bytes: memory_processed + now.memory_remaining_bytes,
            memory_processed_bytes: memory_processed,
            memory_remaining_bytes: now.memory_remaining_bytes,
            memory_constant_pages: normal_pages.map(|n| now.pages_sent.saturating_sub(n)),
            memory_normal_pages: normal_pages,
            memory_normal_bytes: now.data_page_bytes,
            memory_bps: (now.send_rate > 0.0).then(|| now.send_rate.round() as u64),
            memory_dirty_rate_pages_per_s: (now.passes > 0)
                .then(|| now.dirty_rate_pages_per_s.round() as u64),
            memory_iteration: now.passes,
            memory_page_size_bytes: PAGE_SIZE,
            memory_postcopy_requests: now.postcopy_requests,
            downtime_ms: now.expected_downtime_ms.map(whole),
            downtime_net_ms: None,
            setup_time_ms: now.setup_ms.map(whole),
            auto_converge_throttle_percent: now.throttle_percent,
            ..JobStats::default()
        }
    }

    /// The job of a migration that completed, from its statistics: nothing remains.
    pub fn completed(s: &MigrationStats) -> JobStats {
        let pages = s.pages_normal + s.pages_zero;
        let last_running = s.passes.iter().rev().find(|p| !p.paused);
        let d = &s.downtime;
        JobStats {
            time_elapsed_ms: whole(s.total_ms),
            time_remaining_ms: Some(0),
            data_total_bytes: s.bytes_sent,
            data_processed_bytes: s.bytes_sent,
            data_remaining_bytes: 0,
            memory_total_bytes: pages * PAGE_SIZE,
            memory_processed_bytes: pages * PAGE_SIZE,
            memory_remaining_bytes: 0,
            memory_constant_pages: Some(s.pages_zero),
            memory_normal_pages: Some(s.pages_normal),
            memory_normal_bytes: Some(s.pages_normal * PAGE_SIZE),
            memory_bps: (s.bandwidth_mb_s > 0.0).then(|| (s.bandwidth_mb_s * 1e6).round() as u64),
            memory_dirty_rate_pages_per_s: last_running
                .map(|p| p.dirty_rate_pages_per_s.round() as u64),
            memory_iteration: s.passes.len() as u32,
            memory_page_size_bytes: PAGE_SIZE,
            memory_postcopy_requests: s.postcopy.as_ref().map_or(0, |p| p.requests),
            downtime_ms: Some(whole(d.total_ms)),
            downtime_net_ms: Some(whole((d.total_ms - d.transfer_ms).max(0.0))),
            setup_time_ms: Some(whole(s.setup_ms)),
            auto_converge_throttle_percent: s.passes.last().map_or(0, |p| p.throttle_percent),
            ..JobStats::default()
        }
    }
}

/// Milliseconds as libvirt counts them: whole.
fn whole(ms: f64) -> u64 {
    ms.max(0.0).round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{Downtime, PassStats, PostcopyStats};

    fn running() -> Running {
        Running {
            elapsed_ms: 1234.4,
            eta_ms: Some(99.6),
            bytes_sent: 10 << 20,
            memory_remaining_bytes: 4 << 20,
            state_remaining_bytes: 1 << 20,
            pages_sent: 3000,
            data_page_bytes: Some(2000 * PAGE_SIZE),
            send_rate: 50e6,
            passes: 2,
            dirty_rate_pages_per_s: 1500.4,
            expected_downtime_ms: Some(80.2),
            setup_ms: Some(12.0),
            throttle_percent: 20,
            postcopy_requests: 0,
        }
    }

    #[test]
    fn a_running_job_maps_each_figure_and_its_totals_add_up() {
        let j = JobStats::running(&running());
        assert_eq!(j.time_elapsed_ms, 1234);
        assert_eq!(j.time_remaining_ms, Some(100));
        assert_eq!(j.data_processed_bytes, 10 << 20);
        assert_eq!(j.data_remaining_bytes, 5 << 20, "memory and device state");
        assert_eq!(j.data_total_bytes, 15 << 20);
        assert_eq!(j.memory_processed_bytes, 3000 * PAGE_SIZE);
        assert_eq!(j.memory_remaining_bytes, 4 << 20);
        assert_eq!(
            j.memory_total_bytes,
            j.memory_processed_bytes + j.memory_remaining_bytes
        );
        assert_eq!(j.memory_normal_pages, Some(2000));
        assert_eq!(j.memory_normal_bytes, Some(2000 * PAGE_SIZE));
        assert_eq!(j.memory_constant_pages, Some(1000));
        assert_eq!(j.memory_bps, Some(50_000_000));
        assert_eq!(j.memory_dirty_rate_pages_per_s, Some(1500));
        assert_eq!(j.memory_iteration, 2);
        assert_eq!(j.memory_page_size_bytes, 4096);
        assert_eq!(j.downtime_ms, Some(80));
        assert_eq!(j.downtime_net_ms, None, "measured only once completed");
        assert_eq!(j.setup_time_ms, Some(12));
        assert_eq!(j.auto_converge_throttle_percent, 20);
        assert_eq!(j.disk_total_bytes, None, "the VMM's to fill");
    }

    #[test]
    fn a_figure_not_measured_yet_is_null_not_a_guess() {
        let j = JobStats::running(&Running {
            eta_ms: None,
            data_page_bytes: None,
            send_rate: 0.0,
            passes: 0,
            dirty_rate_pages_per_s: 0.0,
            expected_downtime_ms: None,
            setup_ms: None,
            ..running()
        });
        assert_eq!(j.time_remaining_ms, None);
        assert_eq!(j.memory_bps, None);
        assert_eq!(j.memory_dirty_rate_pages_per_s, None, "no dirty sync yet");
        assert_eq!(j.downtime_ms, None);
        assert_eq!(j.setup_time_ms, None);
        assert_eq!(
            (j.memory_normal_pages, j.memory_constant_pages),
            (None, None)
        );
    }

    #[test]
    fn a_completed_job_has_nothing_left_and_its_measured_downtime() {
        let pass = |pass, paused, rate, throttle| PassStats {
            pass,
            paused,
            dirty_rate_pages_per_s: rate,
            throttle_percent: throttle,
            ..PassStats::default()
        };
        let s = MigrationStats {
            total_ms: 2500.6,
            setup_ms: 30.2,
            bytes_sent: 300 << 20,
            pages_normal: 70_000,
            pages_zero: 5_000,
            bandwidth_mb_s: 120.5,
            passes: vec![
                pass(1, false, 100.0, 0),
                pass(2, false, 2400.0, 10),
                pass(3, true, 0.0, 10),
            ],
            downtime: Downtime {
                total_ms: 45.4,
                transfer_ms: 5.0,
                ..Downtime::default()
            },
            postcopy: Some(PostcopyStats {
                requests: 7,
                ..PostcopyStats::default()
            }),
            ..MigrationStats::default()
        };
        let j = JobStats::completed(&s);
        assert_eq!(j.time_elapsed_ms, 2501);
        assert_eq!(j.time_remaining_ms, Some(0));
        assert_eq!(
            (
                j.data_total_bytes,
                j.data_processed_bytes,
                j.data_remaining_bytes
            ),
            (300 << 20, 300 << 20, 0)
        );
        assert_eq!(j.memory_processed_bytes, 75_000 * PAGE_SIZE);
        assert_eq!(j.memory_remaining_bytes, 0);
        assert_eq!(j.memory_constant_pages, Some(5_000));
        assert_eq!(j.memory_normal_pages, Some(70_000));
        assert_eq!(j.memory_bps, Some(120_500_000));
        assert_eq!(
            j.memory_dirty_rate_pages_per_s,
            Some(2400),
            "the last sync while the guest ran"
        );
        assert_eq!(j.memory_iteration, 3, "the final pass's sync counts");
        assert_eq!(j.downtime_ms, Some(45));
        assert_eq!(j.downtime_net_ms, Some(40));
        assert_eq!(j.setup_time_ms, Some(30));
        assert_eq!(j.auto_converge_throttle_percent, 10);
        assert_eq!(j.memory_postcopy_requests, 7);
    }
}
