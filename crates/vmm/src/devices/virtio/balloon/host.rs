//! The balloon's host side: what the VMM asks of it, from its own threads, through the
//! transport (so a config change raises the transport's config interrupt and a returned buffer
//! its used-buffer interrupt).
//!
//! The VMM keeps an `Arc<Mutex<MmioTransport<Balloon>>>` and registers a clone of it on the
//! MMIO bus; every method here runs under that mutex, so it is atomic with respect to the
//! vCPU's buffer processing.

#![forbid(unsafe_code)]

use virtio_queue::QueueT;

use super::device::Balloon;
use super::hinting::HintStatus;
use super::spec::{BalloonCounters, Discard, F_FREE_PAGE_HINT, F_STATS_VQ, Vq, queue_index};
use super::stats::BalloonStats;
use crate::devices::virtio::device::VirtioError;
use crate::devices::virtio::mmio::MmioTransport;

/// Why a host request to the balloon cannot be served.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BalloonError {
    #[error(
        "the guest's balloon driver is not running (device status {status:#x}); wait until the guest has loaded virtio_balloon, or go on without it"
    )]
    NotRunning { status: u32 },
    #[error(
        "the guest's balloon driver did not accept {feature}; use a guest driver that supports it, or go on without it"
    )]
    NotNegotiated { feature: &'static str },
}

impl MmioTransport<Balloon> {
    fn require(&self, feature: u64, name: &'static str) -> Result<(), BalloonError> {
        if !self.driver_ok() {
            return Err(BalloonError::NotRunning {
                status: self.status(),
            });
        }
        match self.device().features & feature {
            0 => Err(BalloonError::NotNegotiated { feature: name }),
            _ => Ok(()),
        }
    }

    /// Asks the guest for a round of free page hints: a new command id in the config and a
    /// config interrupt. Returns the id.
    pub fn start_hinting(&mut self) -> Result<u32, BalloonError> {
        self.require(F_FREE_PAGE_HINT, "VIRTIO_BALLOON_F_FREE_PAGE_HINT")?;
        let id = self.device_mut().hint.begin();
        self.config_changed();
        Ok(id)
    }

    /// Ends the round: STOP in the config. Hint buffers processed from now on are returned
    /// to the driver unrecorded and counted as late. Does nothing if no round runs.
    pub fn stop_hinting(&mut self) {
        if self.device_mut().hint.stop() {
            self.config_changed();
        }
    }

    /// Releases the hinted pages: DONE in the config, after which the guest may reuse them.
    pub fn finish_hinting(&mut self) {
        if self.device_mut().hint.finish() {
            self.config_changed();
        }
    }

    /// Moves the `(gpa, len)` ranges recorded since the last take into `into`, in the order
    /// they were hinted (adjacent ranges merged). Each is whole 4 KiB pages of guest RAM.
    pub fn take_hints(&mut self, into: &mut Vec<(u64, u64)>) {
        self.device_mut().hint.take(into);
    }

    pub fn hint_status(&self) -> HintStatus {
        self.device().hint.status()
    }

    /// Sets the balloon's target size in 4 KiB pages (`num_pages`) and tells the driver.
    pub fn set_target(&mut self, pages: u32) {
        self.device_mut().num_pages = pages;
        self.config_changed();
    }

    /// The balloon's target size (`num_pages`), in 4 KiB pages.
    pub fn target(&self) -> u32 {
        self.device().num_pages
    }

    /// The balloon's size as the driver reports it (`actual`), in 4 KiB pages.
    pub fn actual(&self) -> u32 {
        self.device().actual
    }

    /// Allows or forbids giving inflated and reported pages back to the host.
    pub fn set_discard(&mut self, discard: Discard) {
        self.device_mut().discard = discard;
    }

    /// Returns the held statistics buffer so the driver refills it. Returns whether a buffer
    /// was held (with none held, the driver has not sent statistics yet, or a request is
    /// already out).
    pub fn request_stats(&mut self) -> Result<bool, BalloonError> {
        self.require(F_STATS_VQ, "VIRTIO_BALLOON_F_STATS_VQ")?;
        let features = self.device().features;
        let index = queue_index(features, Vq::Stats).expect("statsq exists with STATS_VQ");
        let mut returned = false;
        self.run_on_queue(index, |balloon, queue, ram| {
            let Some(head) = balloon.stats.held.take() else {
                return Ok(false);
            };
            returned = true;
            queue
                .add_used(ram.memory(), head, 0)
                .map_err(|source| VirtioError::UsedRing {
                    queue: index,
                    head,
                    source,
                })?;
            Ok(true)
        });
        Ok(returned)
    }

    /// The guest's latest statistics.
    pub fn stats(&self) -> &BalloonStats {
        &self.device().stats.latest
    }

    pub fn counters(&self) -> BalloonCounters {
        self.device().counters
    }
}
