//! The handle another thread holds on a running migration: cancel it, read its progress.

#![forbid(unsafe_code)]

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::stats::MigrationStats;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    Setup,
    Precopy,
    Switchover,
    /// The guest runs on the destination; the source sends the pages it still needs (those it
    /// asks for first). It can no longer be cancelled: the source's copy is out of date.
    Postcopy,
    Completed,
    Failed,
    Cancelled,
}

/// What `GET /migration` and `ferry migrate` show while a migration runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Progress {
    pub phase: Phase,
    pub pass: u32,
    pub remaining_bytes: u64,
    pub bytes_sent: u64,
    pub bandwidth_mb_s: f64,
    pub dirty_rate_pages_per_s: f64,
    pub expected_downtime_ms: Option<f64>,
    pub elapsed_ms: f64,
    /// The auto-converge throttle in force, percent (0: none).
    #[serde(default)]
    pub throttle_percent: u8,
    /// Filled when the migration ends.
    pub stats: Option<MigrationStats>,
    pub error: Option<String>,
}

/// Shared between the migration thread and its controllers.
#[derive(Debug, Default)]
pub struct Control {
    cancel: AtomicBool,
    postcopy: AtomicBool,
    progress: Mutex<Progress>,
}

impl Control {
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    /// Asks a migration that has postcopy enabled to switch to it at the end of the pass it is
    /// sending (`ferry migrate-postcopy`, `PUT /migration/postcopy`).
    pub fn start_postcopy(&self) {
        self.postcopy.store(true, Ordering::Relaxed);
    }

    pub fn postcopy_requested(&self) -> bool {
        self.postcopy.load(Ordering::Relaxed)
    }

    pub fn progress(&self) -> Progress {
        self.progress.lock().unwrap().clone()
    }

    pub fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.progress.lock().unwrap());
    }
}
