//! The balloon as a user of the VMM sees it, through [`VmHandle`]: a target size the guest is
//! asked to give back, what it gave, what its free page hinting did, and its statistics.
//! `GET`/`PUT /balloon` and `ferry balloon` come here; the device itself is
//! `devices/virtio/balloon/`, and migrations use it directly (`migration.rs`).

#![forbid(unsafe_code)]

use serde::Serialize;

use super::VmHandle;
use crate::devices::virtio::balloon::PAGE;

/// The balloon's state, as `GET /balloon` serves it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BalloonStatus {
    /// Whether the guest's driver is running (status DRIVER_OK).
    pub driver_ok: bool,
    /// What the guest is asked to give back, and what its driver says it gave.
    pub target_bytes: u64,
    pub actual_bytes: u64,
    /// Pages inflated and deflated by the driver, and given back to the host (inflated or
    /// reported free, punched out of guest RAM's memfd).
    pub inflated_pages: u64,
    pub deflated_pages: u64,
    pub discarded_pages: u64,
    pub reported_pages: u64,
    /// Free page hinting: rounds asked for and started by the driver, pages hinted, hint
    /// buffers that came after a round stopped (not used).
    pub hint_rounds_requested: u64,
    pub hint_rounds_started: u64,
    pub hinted_pages: u64,
    pub late_hint_buffers: u64,
    /// The driver's latest statistics, `(tag, value)` as the virtio specification numbers
    /// them (0 swap in, ..., 5 total memory, ...).
    pub stats: Vec<(u16, u64)>,
}

/// Why the balloon could not be set.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BalloonTargetError {
    #[error("this VM has no balloon; start it without --balloon off")]
    NoBalloon,
    #[error(
        "a balloon of {} is more than the VM's {} of memory; ask for less",
        crate::memory::Size(*bytes),
        crate::memory::Size(*memory)
    )]
    TooBig { bytes: u64, memory: u64 },
}

impl VmHandle {
    /// The balloon's state; `None` for a VM without one.
    pub fn balloon(&self) -> Option<BalloonStatus> {
        let b = self.0.balloon.as_ref()?.lock().unwrap();
        let (c, h) = (b.counters(), b.hint_status().counters);
        Some(BalloonStatus {
            driver_ok: b.driver_ok(),
            target_bytes: u64::from(b.target()) * PAGE,
            actual_bytes: u64::from(b.actual()) * PAGE,
            inflated_pages: c.inflated_pages,
            deflated_pages: c.deflated_pages,
            discarded_pages: c.discarded_pages,
            reported_pages: c.reported_pages,
            hint_rounds_requested: h.rounds_requested,
            hint_rounds_started: h.rounds_started,
            hinted_pages: h.hinted_pages,
            late_hint_buffers: h.late_buffers,
            stats: b.stats().entries.clone(),
        })
    }

    /// Asks the guest to give `bytes` of its memory back (rounded down to 4 KiB pages); the
    /// driver inflates or deflates towards it. Pages it inflates are returned to the host
    /// (punched out of guest RAM) unless a migration is running.
    pub fn set_balloon_target(&self, bytes: u64) -> Result<BalloonStatus, BalloonTargetError> {
        let memory = self.0.ram.size();
        if bytes > memory {
            return Err(BalloonTargetError::TooBig { bytes, memory });
        }
        let balloon = self
            .0
            .balloon
            .as_ref()
            .ok_or(BalloonTargetError::NoBalloon)?;
        balloon
            .lock()
            .unwrap()
            .set_target(u32::try_from(bytes / PAGE).unwrap_or(u32::MAX));
        self.balloon().ok_or(BalloonTargetError::NoBalloon)
    }
}
