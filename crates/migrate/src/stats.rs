//! What a migration measured: plain data, filled by the sessions, printed by the CLI.

use serde::{Deserialize, Serialize};

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
    pub passes: Vec<PassStats>,
    /// Payload bytes per second over the whole migration.
    pub bandwidth_mb_s: f64,
    pub cpu_seconds_source: f64,
    pub cpu_seconds_destination: f64,
    /// Longest dirty sync (the bounded-step promise, measured).
    pub max_sync_ms: f64,
    /// Whether the switchover came because the rest fit the downtime limit (rather than the
    /// timeout forcing it).
    pub converged: bool,
    /// Batches an offload zero-scan engine failed and the sender scanned itself.
    pub zero_scan_fallbacks: u64,
    /// Time pass 1 spent re-arming dirty tracking (`clear_dirty`), which write-protects
    /// every page of RAM once.
    pub dirty_clear_ms: f64,
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
