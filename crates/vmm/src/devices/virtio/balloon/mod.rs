//! virtio-balloon (device id 5), per virtio 1.2 §5.5 "Memory Balloon Device": the host asks the
//! guest for memory back (inflate), learns which pages the guest considers free (free page
//! hinting, for the migration to skip them), and takes back pages the guest reports free
//! (free page reporting).
//!
//! Features offered: VIRTIO_F_VERSION_1 (by the transport), [`F_STATS_VQ`],
//! [`F_FREE_PAGE_HINT`], [`F_PAGE_POISON`], [`F_REPORTING`]; not VIRTIO_BALLOON_F_MUST_TELL_HOST,
//! so deflation is only counted, and not DEFLATE_ON_OOM. Queues are inflateq, deflateq, then
//! statsq, free_page_vq and reporting_vq each only if its feature was negotiated, numbered
//! over the ones that exist (a missing queue takes no index), as Linux numbers them
//! (`virtio_find_vqs` skips unnamed queues) and the spec's queue list implies.
//!
//! Invariants:
//! - Pages go back to the host (`GuestRam::punch_hole`) only while [`Discard::Allowed`] (the VMM
//!   forbids it while a migration runs: a hole reads as zeros on this side only) and while the
//!   guest's poison value is 0 (a hole would replace its poison pattern with zeros).
//! - Only whole 4 KiB pages inside guest RAM are ever punched or recorded as hints: a range is
//!   cut to RAM (the 3-4 GiB hole and anything beyond RAM fall away), its start rounded up and
//!   its end rounded down.
//! - Free page hints are recorded only inside a round the driver started with the current
//!   command id, and never while the guest poisons free pages with a non-zero value: the
//!   destination would read zeros where the guest expects its poison (counted as
//!   `poisoned_buffers`, see [`HintStatus`]).
//! - Every buffer taken is returned (the statistics buffer when the host asks for fresh
//!   statistics), so a driver never waits on a buffer the device forgot.
//!
//! The host side ([`MmioTransport<Balloon>`](super::MmioTransport)'s methods in `host.rs`) runs
//! under the transport's lock: the VMM keeps an `Arc<Mutex<MmioTransport<Balloon>>>` beside the
//! bus's `Arc<Mutex<dyn Device>>` to the same transport.

#![forbid(unsafe_code)]

mod hinting;
mod host;
mod pages;
mod state;
mod stats;
#[cfg(test)]
mod tests;

use virtio_queue::Queue;

use super::chain::Chain;
use super::{Disposition, Negotiated, VirtioDevice, VirtioError, drain};
use crate::devices::DeviceStateError;
use crate::memory::GuestRam;
use hinting::HintRound;
use stats::StatsSlot;

pub use hinting::{CMD_ID_DONE, CMD_ID_MIN, CMD_ID_STOP, HintCounters, HintPhase, HintStatus};
pub use host::BalloonError;
pub use pages::PAGE;
pub use state::STATE_VERSION;
pub use stats::{BalloonStats, MAX_STATS, tag as stat_tag};

/// The balloon's virtio device id (virtio 1.2 §5).
pub const DEVICE_TYPE: u32 = 5;
/// Feature bits (virtio 1.2 §5.5.3).
pub const F_STATS_VQ: u64 = 1 << 1;
pub const F_FREE_PAGE_HINT: u64 = 1 << 3;
pub const F_PAGE_POISON: u64 = 1 << 4;
pub const F_REPORTING: u64 = 1 << 5;
const OFFERED: u64 = F_STATS_VQ | F_FREE_PAGE_HINT | F_PAGE_POISON | F_REPORTING;
const NAME: &str = "virtio-balloon";

/// Config space (virtio 1.2 §5.5.4): four le32 fields.
const CFG_NUM_PAGES: usize = 0;
const CFG_ACTUAL: usize = 4;
const CFG_CMD_ID: usize = 8;
const CFG_POISON: usize = 12;
const CONFIG_SIZE: usize = 16;

/// A balloon queue's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vq {
    Inflate,
    Deflate,
    Stats,
    FreePage,
    Reporting,
}

/// Every queue in spec order, the feature it needs (0: always there) and its maximum size.
/// Sizes are QEMU's: 128 for inflate, deflate and stats (Linux keeps one buffer in each),
/// 1024 (`VIRTQUEUE_MAX_SIZE`) for free page hints (Linux queues one buffer per free 4 MiB
/// block while the queue has room), 32 for reporting (Linux's `PAGE_REPORTING_CAPACITY`).
const QUEUES: [(Vq, u64, u16); 5] = [
    (Vq::Inflate, 0, 128),
    (Vq::Deflate, 0, 128),
    (Vq::Stats, F_STATS_VQ, 128),
    (Vq::FreePage, F_FREE_PAGE_HINT, 1024),
    (Vq::Reporting, F_REPORTING, 32),
];

fn existing(features: u64) -> impl Iterator<Item = Vq> {
    QUEUES
        .into_iter()
        .filter(move |&(_, f, _)| f == 0 || features & f != 0)
        .map(|(vq, _, _)| vq)
}

/// The index of queue `vq` for a driver that negotiated `features`, if it exists.
pub fn queue_index(features: u64, vq: Vq) -> Option<usize> {
    existing(features).position(|v| v == vq)
}

/// Whether inflated and reported pages may be given back to the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Discard {
    #[default]
    Allowed,
    /// While a migration runs: a page punched on the source would not be punched on the
    /// destination, and the migration would have to learn of it.
    Forbidden,
}

/// What the balloon did, since it was created (they migrate).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BalloonCounters {
    /// Pages in guest RAM the driver put in the balloon.
    pub inflated_pages: u64,
    /// Pages in guest RAM the driver took out of the balloon.
    pub deflated_pages: u64,
    /// Pages given back to the host (inflated or reported).
    pub discarded_pages: u64,
    /// Inflate or deflate PFNs outside guest RAM.
    pub ignored_pfns: u64,
    /// Whole pages in guest RAM the driver reported free.
    pub reported_pages: u64,
    /// Buffers refused as malformed (returned unused).
    pub malformed_buffers: u64,
}

/// The balloon device model.
#[derive(Debug, Default)]
pub struct Balloon {
    /// The driver's accepted features (set at DRIVER_OK or restore; 0 after a reset).
    features: u64,
    num_pages: u32,
    actual: u32,
    poison_val: u32,
    discard: Discard,
    hint: HintRound,
    stats: StatsSlot,
    counters: BalloonCounters,
}

impl Balloon {
    pub fn new() -> Balloon {
        Balloon::default()
    }

    /// The guest's poison value, if it negotiated PAGE_POISON (else it is meaningless).
    fn poison(&self) -> u32 {
        match self.features & F_PAGE_POISON {
            0 => 0,
            _ => self.poison_val,
        }
    }

    fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        for (at, v) in [
            (CFG_NUM_PAGES, self.num_pages),
            (CFG_ACTUAL, self.actual),
            (CFG_CMD_ID, self.hint.cmd_id),
            (CFG_POISON, self.poison_val),
        ] {
            c[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        c
    }

    fn handle(&mut self, vq: Vq, chain: Chain, ram: &GuestRam) -> Disposition {
        let head = chain.head;
        match vq {
            Vq::Inflate => self.inflate(&chain, ram),
            Vq::Deflate => self.deflate(&chain, ram),
            Vq::Reporting => self.report(&chain, ram),
            Vq::FreePage => self.free_page_buffer(&chain, ram),
            Vq::Stats => return self.stats_buffer(chain, ram),
        }
        Disposition::Return { head, len: 0 }
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn features(&self) -> u64 {
        OFFERED
    }

    fn max_queues(&self) -> usize {
        QUEUES.len()
    }

    fn queue_count(&self, features: u64) -> usize {
        existing(features).count()
    }

    fn queue_max_size(&self, features: u64, index: usize) -> u16 {
        let vq = existing(features).nth(index);
        QUEUES.iter().find(|q| Some(q.0) == vq).map_or(0, |q| q.2)
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config();
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset.saturating_add(i as u64);
            *b = usize::try_from(at)
                .ok()
                .and_then(|at| c.get(at))
                .copied()
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut c = self.config();
        for (i, &b) in data.iter().enumerate() {
            match offset.checked_add(i as u64).map(|a| a as usize) {
                Some(at @ (CFG_ACTUAL..=7 | CFG_POISON..=15)) => c[at] = b,
                _ => tracing::debug!("{NAME}: driver write to a device-owned config byte ignored"),
            }
        }
        let word = |at: usize| u32::from_le_bytes(c[at..at + 4].try_into().unwrap());
        self.actual = word(CFG_ACTUAL);
        self.poison_val = word(CFG_POISON);
    }

    fn activate(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        // What the driver set goes; the host's target, the command id counter (an id is never
        // reused) and the counters stay.
        self.features = 0;
        self.actual = 0;
        self.poison_val = 0;
        self.stats.held = None;
        self.hint.reset();
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        ram: &GuestRam,
    ) -> Result<bool, VirtioError> {
        let Some(vq) = existing(self.features).nth(index) else {
            return Ok(false);
        };
        let features = self.features;
        let drained = drain(index, queue, ram.memory(), features, |chain| {
            self.handle(vq, chain, ram)
        })?;
        self.counters.malformed_buffers += drained.malformed;
        Ok(drained.used)
    }

    fn save(&self) -> Vec<u8> {
        self.state().encode()
    }

    fn restore(
        &mut self,
        data: &[u8],
        negotiated: &Negotiated<'_>,
    ) -> Result<(), DeviceStateError> {
        let s = state::BalloonState::decode(data, negotiated)?;
        self.apply_state(s, negotiated.features);
        Ok(())
    }
}
