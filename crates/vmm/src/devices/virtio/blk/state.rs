//! The block device's own state, carried inside the transport's section: a plain value
//! ([`BlockState`]), its byte layout (version [`STATE_VERSION`]), and its validation, first
//! on its own and against what the driver negotiated ([`BlockState::decode`]), then against
//! the destination's disk ([`BlockState::fits`]).
//!
//! Layout (little-endian): version 4; config known 1, then capacity 8, seg_max, blk_size,
//! max_discard_sectors, max_discard_seg, discard_sector_alignment, max_write_zeroes_sectors,
//! max_write_zeroes_seg 4 each, write_zeroes_may_unmap 1 (zeros when unknown); read-only 1;
//! id known 1, id 20; counters 8 × 9.
//!
//! Not carried: the image's path and cache mode (the destination has its own), the dirty
//! bitmap (it belongs to the source's migration), and requests in flight: there are none
//! (see the module doc of `blk`). The negotiated features are the transport's.

#![forbid(unsafe_code)]

use super::options::DiskOptions;
use super::spec::{BlkConfig, DiskId, F_RO, NAME};
use super::stats::BlockStats;
use crate::devices::device::DeviceStateError;
use crate::devices::virtio::codec::{Reader, Writer};
use crate::devices::virtio::device::Negotiated;

/// Version of the block device's state layout.
pub const STATE_VERSION: u32 = 1;
/// The most discard or write-zeroes segments a loaded config may allow: a request's segments
/// are copied out of guest memory at once, so this bounds that copy (64 KiB).
const MAX_SEGMENTS_LOADED: u32 = 4096;

/// What a config not yet known is written as, and must read as.
const UNKNOWN: BlkConfig = BlkConfig {
    capacity: 0,
    seg_max: 0,
    blk_size: 0,
    max_discard_sectors: 0,
    max_discard_seg: 0,
    discard_sector_alignment: 0,
    max_write_zeroes_sectors: 0,
    max_write_zeroes_seg: 0,
    write_zeroes_may_unmap: false,
};

/// Everything the block device migrates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockState {
    pub config: Option<BlkConfig>,
    pub read_only: bool,
    pub id: Option<DiskId>,
    pub stats: BlockStats,
}

impl BlockState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        let c = self.config.unwrap_or(UNKNOWN);
        w.u32(STATE_VERSION)
            .bool(self.config.is_some())
            .u64(c.capacity)
            .u32(c.seg_max)
            .u32(c.blk_size)
            .u32(c.max_discard_sectors)
            .u32(c.max_discard_seg)
            .u32(c.discard_sector_alignment)
            .u32(c.max_write_zeroes_sectors)
            .u32(c.max_write_zeroes_seg)
            .bool(c.write_zeroes_may_unmap)
            .bool(self.read_only)
            .bool(self.id.is_some());
        for b in self.id.unwrap_or_default() {
            w.u8(b);
        }
        for v in self.stats.words() {
            w.u64(v);
        }
        w.into_bytes()
    }

    /// Decodes `b` and validates it on its own and against what the driver negotiated.
    pub fn decode(b: &[u8], n: &Negotiated<'_>) -> Result<BlockState, DeviceStateError> {
        let mut r = Reader::new(NAME, b);
        let version = r.u32("block state version")?;
        DeviceStateError::check_version(NAME, version, STATE_VERSION..=STATE_VERSION)?;
        let known = r.bool("config known")?;
        let c = BlkConfig {
            capacity: r.u64("capacity")?,
            seg_max: r.u32("seg_max")?,
            blk_size: r.u32("blk_size")?,
            max_discard_sectors: r.u32("max_discard_sectors")?,
            max_discard_seg: r.u32("max_discard_seg")?,
            discard_sector_alignment: r.u32("discard_sector_alignment")?,
            max_write_zeroes_sectors: r.u32("max_write_zeroes_sectors")?,
            max_write_zeroes_seg: r.u32("max_write_zeroes_seg")?,
            write_zeroes_may_unmap: r.bool("write_zeroes_may_unmap")?,
        };
        let read_only = r.bool("read-only")?;
        let has_id = r.bool("id known")?;
        let mut id = DiskId::default();
        for b in &mut id {
            *b = r.u8("id")?;
        }
        let mut words = [0u64; BlockStats::WORDS];
        for w in &mut words {
            *w = r.u64("block counters")?;
        }
        r.finish()?;
        let bad = |reason: String| DeviceStateError::Malformed {
            device: NAME,
            reason,
        };
        if known {
            if !c.blk_size.is_power_of_two() || !(512..=65536).contains(&c.blk_size) {
                return Err(bad(format!(
                    "blk_size {} is not a power of two from 512 to 64 KiB",
                    c.blk_size
                )));
            }
            for (what, segs) in [
                ("max_discard_seg", c.max_discard_seg),
                ("max_write_zeroes_seg", c.max_write_zeroes_seg),
            ] {
                if !(1..=MAX_SEGMENTS_LOADED).contains(&segs) {
                    return Err(bad(format!(
                        "{what} {segs} is not 1 to {MAX_SEGMENTS_LOADED}"
                    )));
                }
            }
            if c.capacity.checked_mul(512).is_none() {
                return Err(bad(format!(
                    "capacity of {} sectors overflows a byte count",
                    c.capacity
                )));
            }
        } else if c != UNKNOWN {
            return Err(bad(
                "config fields are set but the config is marked unknown".into(),
            ));
        }
        if n.features & F_RO != 0 && !read_only {
            return Err(bad(
                "the driver negotiated a read-only disk, but the disk is read-write".into(),
            ));
        }
        Ok(BlockState {
            config: known.then_some(c),
            read_only,
            id: has_id.then_some(id),
            stats: BlockStats::from_words(words),
        })
    }

    /// Refuses a state the destination's disk (`options`, and the whole sectors of its image
    /// if open) cannot carry on: read-only where the source was read-write (or the reverse:
    /// the guest's driver negotiated what it saw), or an image whose size differs from the
    /// source's disk.
    pub fn fits(
        &self,
        options: &DiskOptions,
        image_sectors: Option<u64>,
    ) -> Result<(), DeviceStateError> {
        let bad = |reason: String| DeviceStateError::Malformed {
            device: NAME,
            reason,
        };
        let mode = |ro: bool| if ro { "read-only" } else { "read-write" };
        let read_only = options.readonly;
        if read_only != self.read_only {
            return Err(bad(format!(
                "the source's disk is {} but this VM's is {}; give the destination's disk as the source's was (with ,readonly exactly when the source had it)",
                mode(self.read_only),
                mode(read_only)
            )));
        }
        let Some(sectors) = image_sectors else {
            return Ok(());
        };
        let path = &options.path;
        match self.config {
            Some(c) if c.capacity == sectors => Ok(()),
            Some(c) => Err(bad(format!(
                "the source's disk has {} sectors ({} bytes) but this VM's image {} has {sectors} ({} bytes); give the destination the source's image or one of its size",
                c.capacity,
                c.capacity_bytes(),
                path.display(),
                sectors * 512
            ))),
            None => Err(bad(format!(
                "the source's disk was never attached, but this VM's image {} is open; give the destination a deferred disk",
                path.display()
            ))),
        }
    }
}
