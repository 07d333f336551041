//! What this device chooses within virtio 1.2 §5.1 "Network Device": the features it offers
//! and its queues. The numbers the spec itself fixes (bits, offsets, the header) are
//! `ferry_guest_abi::virtio::net`'s, shared with the guest's driver.

#![forbid(unsafe_code)]

use ferry_guest_abi::virtio::net;

/// The network device's virtio device id (virtio 1.2 §5).
pub const DEVICE_TYPE: u32 = net::DEVICE_ID;
pub(crate) const NAME: &str = "virtio-net";
pub const F_MTU: u64 = 1 << net::F_MTU;
pub const F_MAC: u64 = 1 << net::F_MAC;
pub const F_STATUS: u64 = 1 << net::F_STATUS;
/// Offered to every driver.
pub(crate) const OFFERED: u64 = F_MAC | F_STATUS | F_MTU;
/// Each queue's largest size: 256, QEMU's default for virtio-net.
pub const QUEUE_SIZE: u16 = 256;
/// The largest frame passed either way: an Ethernet header and a 1500-byte payload.
pub const MAX_FRAME: usize = net::MAX_FRAME as usize;
/// The header before every frame in a buffer.
pub const HEADER: usize = net::HEADER_SIZE as usize;
/// Frames a migration's state may carry from the source's tap: its default queue (1000), so
/// a guest that kept up loses none that came before the save.
pub const MAX_PENDING: usize = 1024;
/// Bytes they may take: the NIC's whole section (these, a length per frame, the MAC, counters
/// and queues) must fit the bound a destination puts on one section (1 MiB), or the migration
/// fails at its switchover; 960 KiB leaves the rest 64 KiB (it takes well under 8). With
/// full-size frames that is 649 of them; small ones stop at [`MAX_PENDING`].
pub const MAX_PENDING_BYTES: usize = 960 << 10;
const _: () = assert!(
    MAX_PENDING_BYTES + 4 * MAX_PENDING + (8 << 10)
        <= ferry_migrate::wire::MAX_SECTION_BYTES as usize
);
