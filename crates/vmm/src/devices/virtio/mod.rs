//! virtio devices: the virtio-mmio transport ([`mmio`]) and the device models behind it
//! ([`balloon`], [`blk`], [`net`]), per the virtio 1.2 specification.
//!
//! Who owns what: the transport ([`MmioTransport`]) owns everything the spec puts in the
//! transport — device status, feature negotiation, the queues and their validation, the
//! interrupt status and the config generation. A [`VirtioDevice`] owns only its device-specific
//! state (its config space and what it does with buffers). The device sees a queue only when
//! the transport hands it one: never a queue the driver has not made ready and validated,
//! never before DRIVER_OK, never after DEVICE_NEEDS_RESET.
//!
//! Invariants, for every device here:
//! - Guest memory is read and written only through [`GuestRam::memory`](crate::memory::GuestRam::memory), whose writes are
//!   dirty-tracked for the migration (see `memory.rs`); no raw pointers.
//! - Nothing a driver writes can make a device panic, loop, or touch memory outside guest RAM.
//!   A malformed buffer is returned unused and counted; a driver error the device cannot answer
//!   (a broken ring, a head outside the queue) sets DEVICE_NEEDS_RESET and stops the device
//!   until the driver resets it. Chains are walked by [`chain::walk`], which bounds them.
//! - A queue's `next_avail` and `next_used` are part of the migrated state, so a queue restored
//!   mid-run neither processes a buffer again nor loses one.

#![forbid(unsafe_code)]

pub mod balloon;
pub mod blk;
pub mod chain;
mod codec;
pub mod device;
pub mod mmio;
pub mod net;
#[cfg(test)]
mod testdriver;

pub use device::{
    Disposition, Drained, Negotiated, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1, VirtioDevice,
    VirtioError, drain, status,
};
pub use mmio::MmioTransport;
