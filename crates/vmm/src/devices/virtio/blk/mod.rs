//! virtio-blk (device id 2), per virtio 1.2 §5.2 "Block Device": a disk over a raw image file
//! on the host.
//!
//! Features offered: VIRTIO_F_VERSION_1 (by the transport), SEG_MAX, BLK_SIZE (512: see
//! `spec.rs`), FLUSH, DISCARD, WRITE_ZEROES, and RO for a read-only disk; not SIZE_MAX,
//! GEOMETRY, TOPOLOGY, CONFIG_WCE, MQ or indirect descriptors. One request queue of up to 256
//! entries. Config space is the device's alone: capacity, seg_max, blk_size, the discard and
//! write-zeroes limits, write_zeroes_may_unmap = 1. Requests: IN, OUT, FLUSH (fdatasync
//! whatever the cache mode), GET_ID ("ferry-" and a hash of the image's device and inode,
//! kept across a migration: see `spec.rs`), DISCARD (punches a hole), WRITE_ZEROES (a hole
//! with the unmap flag, else a zeroed range). DISCARD and WRITE_ZEROES answer S_UNSUPP unless
//! negotiated; FLUSH works whatever was negotiated (syncing is always allowed).
//!
//! **Requests are served synchronously**, inside `process_queue`, on the vCPU thread that
//! wrote QueueNotify, under the transport's lock. So when the vCPUs are paused no request is
//! in flight: each buffer the driver made available is either answered (its status written,
//! its head in the used ring) or still in the available ring, untouched. The queue's
//! `next_avail` migrates with the transport's state, so the destination takes the untouched
//! ones at the driver's next notify (a driver that notified before the pause had its buffers
//! served before the notify returned). Nothing is lost, nothing done twice, and the device
//! state has nothing in flight to carry. The cost: a vCPU waits for its disk I/O; a
//! request's length is bounded by the disk and a discard's by `spec.rs`'s limit.
//!
//! Invariants (beside the module doc of `virtio`):
//! - Guest memory is read and written only through `GuestRam::memory()`, a bounce buffer
//!   between it and the file (`image.rs`), so the data of every IN is dirty-tracked for the
//!   migration.
//! - Every byte of the image touched lies below the capacity the driver was given; a request
//!   out of range, of a length that is not whole sectors, writing a read-only disk, or arriving
//!   before the image is attached is answered S_IOERR; a chain with no status byte in guest
//!   RAM is returned unused and counted (`request.rs`, `serve.rs`). A host I/O error is S_IOERR
//!   and a warning naming the image and the errno.
//! - The capacity is the image's size in whole 512-byte sectors: a partial last sector is not
//!   visible to the guest (raw images are made in whole sectors; refusing one would gain
//!   nothing).
//! - A deferred device ([`Block::deferred`]) opens its image only at [`Block::attach`], after
//!   its state is restored, and refuses an image whose size is not the source's: on a
//!   migration's destination the image is opened after the hand-over, so two hosts never
//!   write it at once. The VMM calls [`Block::flush`] after pausing the vCPUs and before
//!   saving the state. In a local handover the source's open image may be passed instead
//!   ([`Block::pass_image`]): kept until the attach, which takes it over (`image.rs`,
//!   `Image::take_over`) rather than opening the path.
//! - While tracking ([`Block::start_tracking`]) every OUT, DISCARD and WRITE_ZEROES marks the
//!   4 KiB chunks it touched (`dirty.rs`), for a migration that copies the disk itself.

#![forbid(unsafe_code)]

mod device;
mod dirty;
mod error;
mod host;
mod image;
mod options;
mod request;
mod serve;
mod spec;
mod state;
mod stats;
#[cfg(test)]
mod tests;

pub use device::Block;
pub use dirty::{DIRTY_CHUNK, DirtyChunks, MIRROR_LAG, WriteLog};
pub use error::BlockError;
pub use options::{Cache, DiskOptions};
pub use spec::{
    BLK_SIZE, BlkConfig, DEVICE_TYPE, DiskId, F_BLK_SIZE, F_DISCARD, F_FLUSH, F_RO, F_SEG_MAX,
    F_WRITE_ZEROES, QUEUE_SIZE, SEG_MAX,
};
pub use state::{BlockState, STATE_VERSION};
pub use stats::BlockStats;
