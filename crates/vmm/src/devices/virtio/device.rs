//! The virtio device contract (see the module doc of `virtio`): the feature bits and status
//! every device shares, [`VirtioDevice`], and the drain of a queue's available buffers into a
//! device, bounded and validated.

#![forbid(unsafe_code)]

use virtio_queue::{Queue, QueueOwnedT, QueueT};

use super::chain::{self, Chain};
use crate::devices::device::DeviceStateError;
use crate::memory::{GuestRam, TrackedMemory};

/// The device complies with virtio 1.x (virtio 1.2 §6, bit 32); the transport requires it.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// The driver and device use `used_event`/`avail_event` (virtio 1.2 §6, bit 29). Not offered by
/// any device here, but a queue's flag migrates with it.
pub const VIRTIO_F_RING_EVENT_IDX: u64 = 1 << 29;

/// Device status bits (virtio 1.2 §2.1).
pub mod status {
    pub use ferry_guest_abi::virtio::status::*;
    /// Every bit the spec defines; others written by a driver are dropped.
    pub const KNOWN: u32 =
        ACKNOWLEDGE | DRIVER | DRIVER_OK | FEATURES_OK | DEVICE_NEEDS_RESET | FAILED;
}

/// What the driver negotiated and set up, for a device restoring its own state against it.
#[derive(Clone, Copy, Debug)]
pub struct Negotiated<'a> {
    /// The features the driver accepted (zero before FEATURES_OK).
    pub features: u64,
    /// Each queue's size if the driver made it ready, else 0.
    pub ready_sizes: &'a [u16],
}

/// A driver error the device cannot answer by returning one buffer: the transport sets
/// DEVICE_NEEDS_RESET and logs this.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error(
        "queue {queue}: the driver's available ring is invalid ({source}); the guest driver is broken, the device waits for a reset"
    )]
    AvailRing {
        queue: usize,
        #[source]
        source: virtio_queue::Error,
    },
    #[error(
        "queue {queue}: buffer head {head} cannot be returned in the used ring ({source}); the guest driver is broken, the device waits for a reset"
    )]
    UsedRing {
        queue: usize,
        head: u16,
        #[source]
        source: virtio_queue::Error,
    },
    #[error(
        "queue {queue}: the driver made buffer {head} available, outside the queue of {size}; the guest driver is broken, the device waits for a reset"
    )]
    Head { queue: usize, head: u16, size: u16 },
}

/// A virtio device model behind a transport. The transport calls these with the device's lock
/// held (the transport's own), from the vCPU thread for guest accesses and from VMM threads for
/// host requests.
pub trait VirtioDevice: Send {
    /// The virtio device id (virtio 1.2 §5): 5 for a balloon.
    fn device_type(&self) -> u32;
    /// A name for logs and errors.
    fn name(&self) -> &'static str;
    /// Device feature bits offered (the transport adds [`VIRTIO_F_VERSION_1`]).
    fn features(&self) -> u64;
    /// The most queues any negotiation can give.
    fn max_queues(&self) -> usize;
    /// How many queues exist for a driver that accepted `features` (indices `0..n`).
    fn queue_count(&self, features: u64) -> usize;
    /// The largest size queue `index` may have for a driver that accepted `features`: a power
    /// of two up to 32768, or 0 if there is no such queue.
    fn queue_max_size(&self, features: u64, index: usize) -> u16;
    /// Reads device config space at `offset`; bytes beyond it read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver writes device config space; fields the driver may not write are unchanged.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// The driver set DRIVER_OK having accepted `features`.
    fn activate(&mut self, features: u64);
    /// The driver reset the device: forget everything the driver set up.
    fn reset(&mut self);
    /// The driver notified queue `index`: process its available buffers. Returns whether
    /// buffers were returned in the used ring (the transport then interrupts).
    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        ram: &GuestRam,
    ) -> Result<bool, VirtioError>;
    /// The device's own state, with its own version inside.
    fn save(&self) -> Vec<u8>;
    /// Replaces the device's own state with a saved one, validated against what the driver
    /// negotiated; on error nothing changed.
    fn restore(&mut self, data: &[u8], negotiated: &Negotiated<'_>)
    -> Result<(), DeviceStateError>;
}

/// Reads `data.len()` bytes of a device's config space `config` at `offset`; bytes beyond
/// it read as zero (what [`VirtioDevice::read_config`] promises).
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        let at = offset.saturating_add(i as u64);
        *b = usize::try_from(at)
            .ok()
            .and_then(|at| config.get(at))
            .copied()
            .unwrap_or(0);
    }
}

/// What a device does with one buffer it took from a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Return buffer `head` to the driver with `len` bytes written (it may be an earlier held
    /// buffer rather than this one).
    Return { head: u16, len: u32 },
    /// Keep this buffer for later (a balloon's statistics buffer).
    Hold,
}

/// What [`drain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drained {
    /// Buffers were returned in the used ring.
    pub used: bool,
    /// Chains refused as malformed (returned unused).
    pub malformed: u64,
}

/// Takes every buffer the driver has made available on `queue` (as of the call: buffers added
/// meanwhile wait for their own notification), walks each chain and hands it to `handle`;
/// a malformed chain is returned with length 0 without reaching `handle`.
pub fn drain(
    index: usize,
    queue: &mut Queue,
    mem: &TrackedMemory,
    features: u64,
    mut handle: impl FnMut(Chain) -> Disposition,
) -> Result<Drained, VirtioError> {
    let heads: Vec<u16> = queue
        .iter(mem)
        .map_err(|source| VirtioError::AvailRing {
            queue: index,
            source,
        })?
        .map(|c| c.head_index())
        .collect();
    let table = (queue.desc_table(), queue.size());
    let mut out = Drained::default();
    for head in heads {
        if head >= table.1 {
            // Not even the head is a descriptor: there is nothing to return.
            return Err(VirtioError::Head {
                queue: index,
                head,
                size: table.1,
            });
        }
        let disposition = match chain::walk(mem, table, head, features) {
            Ok(chain) => handle(chain),
            Err(e) => {
                tracing::warn!("virtio queue {index}: buffer {head} refused: {e}");
                out.malformed += 1;
                Disposition::Return { head, len: 0 }
            }
        };
        if let Disposition::Return { head, len } = disposition {
            queue
                .add_used(mem, head, len)
                .map_err(|source| VirtioError::UsedRing {
                    queue: index,
                    head,
                    source,
                })?;
            out.used = true;
        }
    }
    Ok(out)
}
