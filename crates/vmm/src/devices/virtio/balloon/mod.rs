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

mod device;
mod hinting;
mod host;
mod pages;
mod spec;
mod state;
mod stats;
#[cfg(test)]
mod tests;

pub use device::Balloon;
pub use hinting::{CMD_ID_DONE, CMD_ID_MIN, CMD_ID_STOP, HintCounters, HintPhase, HintStatus};
pub use host::BalloonError;
pub use pages::PAGE;
pub use spec::{
    BalloonCounters, DEVICE_TYPE, Discard, F_FREE_PAGE_HINT, F_PAGE_POISON, F_REPORTING,
    F_STATS_VQ, Vq, queue_index,
};
pub use state::STATE_VERSION;
pub use stats::{BalloonStats, MAX_STATS, tag as stat_tag};
