//! The parts of the virtio 1.x specification that the built-in guest's balloon driver and the
//! VMM's virtio-mmio devices both speak: the MMIO (version 2) register map, device status bits,
//! the split virtqueue's descriptor flags and the balloon's features and configuration. One
//! copy for both sides, in this no_std crate.

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
