//! The parts of the virtio 1.x specification that the built-in guest's balloon driver and the
//! VMM's virtio-mmio devices both speak: the MMIO (version 2) register map, device status bits,
//! the split virtqueue's descriptor flags, and the balloon's and the block device's features and
//! configuration. One copy for both sides, in this no_std crate.

/// MMIO register offsets (virtio 1.2, 4.2.2).
pub mod mmio {
    pub const MAGIC_VALUE: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
    /// "virt", little endian.
    pub const MAGIC: u32 = 0x7472_6976;
}

/// Device status bits (2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    pub const FAILED: u32 = 0x80;
}

/// `VIRTIO_F_VERSION_1`: the device is a virtio 1.x device.
pub const F_VERSION_1: u32 = 32;

/// Split virtqueue descriptor flags (2.7.5).
pub const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;

/// The balloon (5.5).
pub mod balloon {
    pub const DEVICE_ID: u32 = 5;
    pub const F_STATS_VQ: u32 = 1;
    pub const F_FREE_PAGE_HINT: u32 = 3;
    pub const F_PAGE_POISON: u32 = 4;
    pub const F_REPORTING: u32 = 5;
    /// Config offsets: the device's target, the driver's actual size (both in 4 KiB pages),
    /// the free page hint command id, the poison value.
    pub const CONFIG_NUM_PAGES: u64 = 0;
    pub const CONFIG_ACTUAL: u64 = 4;
    pub const CONFIG_CMD_ID: u64 = 8;
    pub const CONFIG_POISON_VAL: u64 = 12;
    /// Command ids with a meaning of their own; any other is a request for a round of hints.
    pub const CMD_ID_STOP: u32 = 0;
    pub const CMD_ID_DONE: u32 = 1;
    /// Balloon pages are 4 KiB whatever the guest's page size (the PFN shift).
    pub const PFN_SHIFT: u32 = 12;
}

/// The block device (5.2): what the built-in guest's disk driver and the VMM's virtio-blk
/// device both speak.
pub mod blk {
    pub const DEVICE_ID: u32 = 2;
    /// Feature bits (5.2.3).
    pub const F_SEG_MAX: u32 = 2;
    pub const F_RO: u32 = 5;
    pub const F_BLK_SIZE: u32 = 6;
    pub const F_FLUSH: u32 = 9;
    pub const F_DISCARD: u32 = 13;
    pub const F_WRITE_ZEROES: u32 = 14;
    /// Config offsets (5.2.4): capacity in 512-byte sectors (`u64`), the most segments in a
    /// request (`u32`), the logical block size (`u32`), and the discard and write-zeroes
    /// limits (`u32` each; `write_zeroes_may_unmap` is a byte).
    pub const CONFIG_CAPACITY: u64 = 0;
    pub const CONFIG_SEG_MAX: u64 = 12;
    pub const CONFIG_BLK_SIZE: u64 = 20;
    pub const CONFIG_MAX_DISCARD_SECTORS: u64 = 36;
    pub const CONFIG_MAX_DISCARD_SEG: u64 = 40;
    pub const CONFIG_DISCARD_SECTOR_ALIGNMENT: u64 = 44;
    pub const CONFIG_MAX_WRITE_ZEROES_SECTORS: u64 = 48;
    pub const CONFIG_MAX_WRITE_ZEROES_SEG: u64 = 52;
    pub const CONFIG_WRITE_ZEROES_MAY_UNMAP: u64 = 56;
    /// Bytes of config space the device has.
    pub const CONFIG_SIZE: u64 = 60;
    /// The unit of `sector` in a request and of the capacity, whatever the block size.
    pub const SECTOR_SIZE: u64 = 512;
    /// Request types (5.2.6): the header's first `u32`.
    pub const T_IN: u32 = 0;
    pub const T_OUT: u32 = 1;
    pub const T_FLUSH: u32 = 4;
    pub const T_GET_ID: u32 = 8;
    pub const T_DISCARD: u32 = 11;
    pub const T_WRITE_ZEROES: u32 = 13;
    /// Bytes of a request's header: type (`u32`), reserved (`u32`), sector (`u64`).
    pub const HEADER_SIZE: u32 = 16;
    /// Bytes of the device ID a GET_ID request returns.
    pub const ID_BYTES: u32 = 20;
    /// Bytes of one discard or write-zeroes segment: sector (`u64`), sectors (`u32`), flags
    /// (`u32`, bit 0 = unmap).
    pub const SEGMENT_SIZE: u32 = 16;
    pub const SEGMENT_F_UNMAP: u32 = 1;
    /// The status byte the device writes last (5.2.6).
    pub const S_OK: u8 = 0;
    pub const S_IOERR: u8 = 1;
    pub const S_UNSUPP: u8 = 2;
}

/// The network device (5.1): what the built-in guest's NIC driver and the VMM's virtio-net
/// device both speak. One queue pair, no offloads: every frame is whole and its checksums are
/// the sender's.
pub mod net {
    pub const DEVICE_ID: u32 = 1;
    /// Feature bits (5.1.3): the device has a MAC address in config space, a link status, and
    /// a maximum MTU.
    pub const F_MTU: u32 = 3;
    pub const F_MAC: u32 = 5;
    pub const F_STATUS: u32 = 16;
    /// Config offsets (5.1.4): the MAC (6 bytes), the status (`u16`), the most queue pairs
    /// (`u16`), the MTU (`u16`).
    pub const CONFIG_MAC: u64 = 0;
    pub const CONFIG_STATUS: u64 = 6;
    pub const CONFIG_MAX_VIRTQUEUE_PAIRS: u64 = 8;
    pub const CONFIG_MTU: u64 = 10;
    /// Bytes of config space the device has.
    pub const CONFIG_SIZE: u64 = 12;
    /// The status field's bit: the link is up.
    pub const S_LINK_UP: u16 = 1;
    /// The queues: receive 0, transmit 1 (one pair, no control queue).
    pub const RX_QUEUE: u16 = 0;
    pub const TX_QUEUE: u16 = 1;
    /// Bytes of the header before every frame in both directions (5.1.6: `virtio_net_hdr` with
    /// `num_buffers`, as a VERSION_1 device has it): flags, gso_type, hdr_len, gso_size,
    /// csum_start, csum_offset, num_buffers. Without offloads the device writes it zeroed with
    /// `num_buffers` 1, and a driver sends it zeroed.
    pub const HEADER_SIZE: u32 = 12;
    /// The offset of `num_buffers` (`u16`) in the header.
    pub const HEADER_NUM_BUFFERS: u32 = 10;
    /// The MTU the device reports and the largest frame it passes (an Ethernet header of 14
    /// bytes and 1500 of payload; no VLAN tag, no FCS).
    pub const MTU: u16 = 1500;
    pub const MAX_FRAME: u32 = 1514;
}
