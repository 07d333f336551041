//! What the session reports: the statistics it fills, the timeline's samples and the pass and
//! phase they are tagged with, and the clocks behind the figures (`progress.rs` publishes
//! them). One value, so that every phase counts into the same place.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::control::Phase;
use crate::stats::{self, MigrationStats, Timeline};

/// The reporting state of a session.
#[derive(Debug)]
pub(super) struct Report {
    pub(super) stats: MigrationStats,
    /// When the session started.
    pub(super) start: Instant,
    /// This thread's CPU time at the start, for the source's CPU cost.
    pub(super) cpu_start: u64,
    /// When precopy's loop last looked at cancellation (`check_control`), for `max_step_ms`.
    pub(super) last_check: Option<Instant>,
    /// Batches sent so far.
    pub(super) samples: u64,
    /// When progress was last published between pass ends (`progress.rs`).
    pub(super) published: Instant,
    /// Pass 1's populated memory not walked yet (0 after pass 1), for its progress.
    pub(super) first_pass_left: u64,
    /// Populated memory when pass 1 began: the most a guest can dirty in a pass, as the
    /// prediction takes it.
    pub(super) populated: u64,
    /// What the last dirty sync took, paid again by every pass and in the pause.
    pub(super) last_sync: Duration,
    /// The report's time series, and the pass and phase its samples are tagged with.
    pub(super) timeline: Timeline,
    pub(super) pass: u32,
    pub(super) phase: Phase,
}

impl Report {
    /// A report that starts now.
    pub(super) fn new() -> Report {
        Report {
            stats: MigrationStats::default(),
            start: Instant::now(),
            cpu_start: stats::thread_cpu_ns(),
            last_check: None,
            samples: 0,
            published: Instant::now(),
            first_pass_left: 0,
            populated: 0,
            last_sync: Duration::ZERO,
            timeline: Timeline::default(),
            pass: 0,
            phase: Phase::Setup,
        }
    }
}
