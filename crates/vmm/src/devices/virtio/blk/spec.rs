//! What this device chooses within virtio 1.2 §5.2 "Block Device": the features it offers, its
//! one queue, and the limits it writes into config space ([`BlkConfig`]), each with the reason
//! for its value. The numbers the spec itself fixes (bits, offsets, request types, statuses)
//! are `ferry_guest_abi::virtio::blk`'s, shared with the guest's driver.

#![forbid(unsafe_code)]

use ferry_guest_abi::virtio::blk;

/// The block device's virtio device id (virtio 1.2 §5).
pub const DEVICE_TYPE: u32 = blk::DEVICE_ID;
pub(super) const NAME: &str = "virtio-blk";

/// Feature bits as masks.
pub const F_SEG_MAX: u64 = 1 << blk::F_SEG_MAX;
pub const F_RO: u64 = 1 << blk::F_RO;
pub const F_BLK_SIZE: u64 = 1 << blk::F_BLK_SIZE;
pub const F_FLUSH: u64 = 1 << blk::F_FLUSH;
pub const F_DISCARD: u64 = 1 << blk::F_DISCARD;
pub const F_WRITE_ZEROES: u64 = 1 << blk::F_WRITE_ZEROES;

/// Offered to every driver; a read-only disk adds [`F_RO`].
pub(super) const OFFERED: u64 = F_SEG_MAX | F_BLK_SIZE | F_FLUSH | F_DISCARD | F_WRITE_ZEROES;

/// The one request queue's largest size: 256 is QEMU's default for virtio-blk and lets Linux
/// keep a full request of [`SEG_MAX`] segments in flight without indirect descriptors.
pub const QUEUE_SIZE: u16 = 256;
/// Data segments in one request: a request is a header, its data and a status byte, each
/// at least one descriptor, and indirect descriptors are not offered, so a request of
/// `QUEUE_SIZE - 2` segments fills the ring (QEMU sets seg_max to queue size - 2 likewise).
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// The logical block size reported: 512, the protocol's own sector. An existing image keeps
/// the geometry its partition table and file systems were made with (4096 would move every
/// partition that starts on an odd 512-byte sector off a block boundary), and every request a
/// guest makes is whole sectors, so nothing the guest sends is misaligned for the device.
pub const BLK_SIZE: u32 = 512;
/// Sectors in one discard or write-zeroes request: 32 MiB. A punched hole costs little
/// whatever its size, but write-zeroes falls back to writing zeros where the file system
/// cannot zero a range, on the vCPU thread; 32 MiB bounds that stall to tens of ms on a disk
/// that writes at ~1 GB/s.
pub const MAX_ZEROING_SECTORS: u32 = 64 << 10;
/// Segments in one discard or write-zeroes request: one keeps the request simple to check;
/// Linux merges no discards then, and issues one request per range.
pub const MAX_ZEROING_SEGMENTS: u32 = 1;
/// Discards are aligned to 4 KiB (8 sectors), the block size of the host file systems an image
/// lives on (ext4, xfs): a hole is punched in whole blocks, a partial block is only zeroed.
pub const DISCARD_ALIGNMENT_SECTORS: u32 = 8;

/// What the driver reads in config space (virtio 1.2 §5.2.4). The limits are this ferry's
/// constants for a new device, but a device restored from another ferry keeps the values the
/// guest's driver read there, so they travel in the device's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlkConfig {
    /// Capacity in 512-byte sectors.
    pub capacity: u64,
    pub seg_max: u32,
    pub blk_size: u32,
    pub max_discard_sectors: u32,
    pub max_discard_seg: u32,
    pub discard_sector_alignment: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_write_zeroes_seg: u32,
    pub write_zeroes_may_unmap: bool,
}

impl BlkConfig {
    /// This ferry's config for a disk of `capacity` sectors.
    pub fn new(capacity: u64) -> BlkConfig {
        BlkConfig {
            capacity,
            seg_max: SEG_MAX,
            blk_size: BLK_SIZE,
            max_discard_sectors: MAX_ZEROING_SECTORS,
            max_discard_seg: MAX_ZEROING_SEGMENTS,
            discard_sector_alignment: DISCARD_ALIGNMENT_SECTORS,
            max_write_zeroes_sectors: MAX_ZEROING_SECTORS,
            max_write_zeroes_seg: MAX_ZEROING_SEGMENTS,
            // A hole reads as zeros, so a write-zeroes may punch one when the driver allows.
            write_zeroes_may_unmap: true,
        }
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity * blk::SECTOR_SIZE
    }

    /// The config space bytes; fields this device does not offer (size_max, geometry,
    /// topology, writeback, num_queues) read zero.
    pub fn bytes(&self) -> [u8; blk::CONFIG_SIZE as usize] {
        let mut c = [0u8; blk::CONFIG_SIZE as usize];
        let mut put = |at: u64, v: &[u8]| c[at as usize..at as usize + v.len()].copy_from_slice(v);
        put(blk::CONFIG_CAPACITY, &self.capacity.to_le_bytes());
        for (at, v) in [
            (blk::CONFIG_SEG_MAX, self.seg_max),
            (blk::CONFIG_BLK_SIZE, self.blk_size),
            (blk::CONFIG_MAX_DISCARD_SECTORS, self.max_discard_sectors),
            (blk::CONFIG_MAX_DISCARD_SEG, self.max_discard_seg),
            (
                blk::CONFIG_DISCARD_SECTOR_ALIGNMENT,
                self.discard_sector_alignment,
            ),
            (
                blk::CONFIG_MAX_WRITE_ZEROES_SECTORS,
                self.max_write_zeroes_sectors,
            ),
            (blk::CONFIG_MAX_WRITE_ZEROES_SEG, self.max_write_zeroes_seg),
        ] {
            put(at, &v.to_le_bytes());
        }
        put(
            blk::CONFIG_WRITE_ZEROES_MAY_UNMAP,
            &[u8::from(self.write_zeroes_may_unmap)],
        );
        c
    }
}

/// What GET_ID returns: 20 bytes, not NUL-terminated when all are used (virtio 1.2 §5.2.6).
pub type DiskId = [u8; blk::ID_BYTES as usize];

/// The id of an image with inode `ino` on device `dev`: "ferry-" and 14 hex digits of a hash
/// of the two, so it is the same every time the same file is opened on a host and differs
/// between files (a path would change with the mount point). A restored device keeps the
/// source's id, so the guest's `/dev/disk/by-id/virtio-ferry-…` does not change when it moves.
pub fn disk_id(dev: u64, ino: u64) -> DiskId {
    // FNV-1a, 64 bits: stable across builds and platforms, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in dev.to_le_bytes().into_iter().chain(ino.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let text = format!("ferry-{:014x}", h >> 8);
    text.as_bytes().try_into().expect("6 + 14 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_bytes_sit_at_the_spec_offsets() {
        let c = BlkConfig::new(0x1_0000_0001).bytes();
        let u32_at =
            |at: u64| u32::from_le_bytes(c[at as usize..at as usize + 4].try_into().unwrap());
        assert_eq!(&c[..8], &0x1_0000_0001u64.to_le_bytes());
        assert_eq!(u32_at(blk::CONFIG_SEG_MAX), 254);
        assert_eq!(u32_at(blk::CONFIG_BLK_SIZE), 512);
        assert_eq!(u32_at(blk::CONFIG_MAX_DISCARD_SECTORS), 65536);
        assert_eq!(u32_at(blk::CONFIG_MAX_WRITE_ZEROES_SEG), 1);
        assert_eq!(u32_at(blk::CONFIG_DISCARD_SECTOR_ALIGNMENT), 8);
        assert_eq!(c[blk::CONFIG_WRITE_ZEROES_MAY_UNMAP as usize], 1);
        assert_eq!(u32_at(8), 0, "size_max is not offered");
    }

    #[test]
    fn disk_ids_are_stable_and_tell_files_apart() {
        let id = disk_id(0x803, 42);
        assert_eq!(&id[..6], b"ferry-");
        assert!(id[6..].iter().all(u8::is_ascii_hexdigit));
        assert_eq!(id, disk_id(0x803, 42));
        assert_ne!(id, disk_id(0x803, 43));
        assert_ne!(id, disk_id(0x804, 42));
    }
}
