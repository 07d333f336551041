//! Memory statistics (virtio 1.2 §5.5.6.3): the driver hands the device a buffer of
//! `(le16 tag, le64 value)` entries and the device keeps it; the host asks for fresh values by
//! returning the buffer, and the driver refills it and hands it back.
//!
//! Invariants: at most one buffer is held (a second one returns the first, as QEMU does, so
//! the driver never loses one); at most [`MAX_STATS`] entries are read from a buffer.

#![forbid(unsafe_code)]

use super::spec::BalloonCounters;
use crate::devices::virtio::chain::Chain;
use crate::devices::virtio::device::Disposition;
use crate::memory::GuestRam;

/// Entries read from one buffer: Linux 6.x defines tags 0 to 15 (`VIRTIO_BALLOON_S_NR`);
/// twice that leaves room for new tags and bounds what a driver makes the device copy.
pub const MAX_STATS: usize = 32;
/// `struct virtio_balloon_stat` is packed: le16 tag, le64 value (virtio 1.2 §5.5.6.3).
const ENTRY: usize = 10;

/// Tags the VMM is likely to show (virtio 1.2 §5.5.6.3).
pub mod tag {
    pub const SWAP_IN: u16 = 0;
    pub const SWAP_OUT: u16 = 1;
    pub const MAJOR_FAULTS: u16 = 2;
    pub const MINOR_FAULTS: u16 = 3;
    pub const FREE_MEMORY: u16 = 4;
    pub const TOTAL_MEMORY: u16 = 5;
    pub const AVAILABLE_MEMORY: u16 = 6;
    pub const DISK_CACHES: u16 = 7;
}

/// The guest's latest statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BalloonStats {
    /// `(tag, value)` in the driver's order.
    pub entries: Vec<(u16, u64)>,
    /// Buffers of statistics received.
    pub updates: u64,
}

impl BalloonStats {
    /// The value of `tag` (see [`tag`]), if the driver sent it.
    pub fn get(&self, tag: u16) -> Option<u64> {
        self.entries.iter().find(|e| e.0 == tag).map(|e| e.1)
    }
}

/// The statistics buffer the device holds, and what it held.
#[derive(Clone, Debug, Default)]
pub(super) struct StatsSlot {
    pub(super) held: Option<u16>,
    pub(super) latest: BalloonStats,
}

/// The entries in `bytes` (a trailing partial entry is ignored).
pub(super) fn parse(bytes: &[u8]) -> Vec<(u16, u64)> {
    bytes
        .chunks_exact(ENTRY)
        .take(MAX_STATS)
        .map(|e| {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            (tag, u64::from_le_bytes(e[2..].try_into().unwrap()))
        })
        .collect()
}

impl StatsSlot {
    /// A buffer on statsq: read it, hold it, return the one held before (if any); a malformed
    /// one is counted in `counters`.
    pub(super) fn buffer(
        &mut self,
        chain: Chain,
        ram: &GuestRam,
        counters: &mut BalloonCounters,
    ) -> Disposition {
        let Some(bytes) = chain.read(ram.memory(), MAX_STATS * ENTRY) else {
            tracing::warn!("virtio-balloon: a statistics buffer is not in guest RAM");
            counters.malformed_buffers += 1;
            return Disposition::Return {
                head: chain.head,
                len: 0,
            };
        };
        self.latest.entries = parse(&bytes);
        self.latest.updates += 1;
        match self.held.replace(chain.head) {
            Some(head) => Disposition::Return { head, len: 0 },
            None => Disposition::Hold,
        }
    }
}
