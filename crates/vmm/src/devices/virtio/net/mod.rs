//! virtio-net (device id 1), per virtio 1.2 §5.1 "Network Device": a NIC over a tap device
//! of the host ([`crate::tap`]).
//!
//! Features offered: VIRTIO_F_VERSION_1 (by the transport), MAC, STATUS (the link is always
//! up) and MTU (1500); no checksum or segmentation offloads, no MRG_RXBUF, no control queue,
//! one queue pair. So every frame is whole, at most [`MAX_FRAME`] bytes, and goes in one
//! buffer chain after a 12-byte header the device writes zeroed (`num_buffers` 1) and
//! ignores from the driver.
//!
//! **Transmit is synchronous**: a frame the driver makes available is written to the tap
//! inside `process_queue`, on the vCPU thread that wrote QueueNotify, and its buffer returned
//! before the notify completes. So at a pause no frame is half sent: each is on the tap or
//! still in the available ring, and the ring's `next_avail` migrates with the transport.
//!
//! **Receive fills a buffer the driver made available with one frame read from the tap,
//! read only once the buffer is there**: a frame the guest was given is in its memory and in
//! the used ring (both migrate) or still in the tap. The one exception: at a migration's save
//! the frames waiting in the source's tap are taken into the device (`Net::take_waiting`) and
//! carried in its state, and the destination gives them to the guest before its own tap's,
//! so that none that came before the save is lost with the source's tap. Receive runs on the vCPU thread at an rx notify (the
//! driver gave buffers), on the VMM's receive thread when the tap has a frame (`vm::net`),
//! and once on the first vCPU thread to run after the gate opened, unless the receive
//! thread took a turn first (the frames that waited during a pause need not wait for it), always under the transport's lock, and only while the device's gate is open:
//! the VM closes it, under that lock, once its vCPUs are paused, and opens it when they run
//! again. So no frame reaches guest memory while the VM is paused, after the final pass
//! looked at it.
//!
//! Invariants (beside the module doc of `virtio`):
//! - Guest memory is read and written only through `GuestRam::memory()`, a bounce buffer
//!   between it and the tap, so every received frame is dirty-tracked for the migration.
//! - A chain too short for the header and a frame, or with no writable buffer, is returned
//!   unused and counted; a frame longer than [`MAX_FRAME`] is dropped and counted.
//! - The MAC is the device's and migrates; the destination's own `mac=`, if given, must be
//!   the same (`vm::net`), and a clone (a restore) gets the one given or a new one.
//! - The driver is asked to notify the receive queue only when the device ran out of buffers
//!   (`VIRTQ_USED_F_NO_NOTIFY` otherwise): the receive thread takes buffers when a frame
//!   comes, so a guest answering frames makes one exit per batch, for its transmit notify.

#![forbid(unsafe_code)]

mod device;
mod host;
mod marks;
mod options;
mod spec;
mod state;
#[cfg(test)]
mod tests;

pub use device::{Net, Receive};
pub use marks::OpenMarks;
pub use options::{Mac, NetError, NetOptions, TapSource};
pub use spec::{DEVICE_TYPE, F_MAC, F_MTU, F_STATUS, HEADER, MAX_FRAME, QUEUE_SIZE};
pub use state::{NetState, NetStats, STATE_VERSION};
