//! The virtio-mmio transport, register layout version 2 (virtio 1.2 §4.2.2), as a device on
//! the VMM's MMIO bus.
//!
//! The guest driver reaches the device only through 32-bit register accesses in the first
//! 0x100 bytes and config space accesses above; a queue notification is a write to QueueNotify
//! on a vCPU thread, processed synchronously there. Host requests (a balloon target, a round
//! of free page hints) come from VMM threads through the same `Mutex` the bus holds, so they
//! are atomic with respect to buffer processing.
//!
//! What the transport enforces (virtio 1.2 §2.1, §3.1, §4.2.2.1):
//! - status bits are only ever added, in order (DRIVER before FEATURES_OK before DRIVER_OK);
//!   writing 0 resets the device; any driver error sets DEVICE_NEEDS_RESET (and a config
//!   interrupt once DRIVER_OK), never a panic;
//! - FEATURES_OK sticks only if the driver accepted VIRTIO_F_VERSION_1 and nothing that was not
//!   offered; features change only between DRIVER and FEATURES_OK;
//! - queues are set up only between FEATURES_OK and DRIVER_OK, and a queue becomes ready only
//!   with a power-of-two size up to its maximum and rings aligned and inside guest RAM, so the
//!   device never sees an unchecked queue;
//! - InterruptStatus bit 0 is "used buffer", bit 1 "config change": setting a bit raises the
//!   line, InterruptACK clears bits, [`MmioTransport::raise_pending`] raises the line again
//!   after a restore (an edge raised before the interrupt controller's state was loaded is
//!   lost).
//!
//! Its state (section `section_ids::VIRTIO_MMIO`, layout in `mmio/state.rs`) carries every
//! register, each queue's setup and ring positions, and the device's own state.
//! `mmio/state.rs` adds the save and the load to [`MmioTransport`] and stands on this file;
//! this one only calls them.

#![forbid(unsafe_code)]

mod state;

use std::sync::Arc;

use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend};

use super::device::{
    VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1, VirtioDevice, VirtioError, status,
};
use crate::devices::device::{Device, DeviceStateError, SectionKind};
use crate::devices::irq::IrqLine;
use crate::memory::GuestRam;
use crate::section_ids::VIRTIO_MMIO;

/// Version of the transport's section layout (the device's own state has its own version).
pub const VERSION: u32 = 1;
/// The bus window of one device: 0x100 bytes of registers and the device's config space after
/// them, in the one 4 KiB page Linux maps for `virtio_mmio.device=4K@...`.
pub const MMIO_SIZE: u64 = 0x1000;

/// "virt" in little-endian ASCII (virtio 1.2 §4.2.2, MagicValue).
const MAGIC: u32 = 0x7472_6976;
/// The non-legacy register layout (virtio 1.2 §4.2.2, Version).
const MMIO_VERSION: u32 = 2;
/// Any value is allowed (Linux matches on DeviceID only); "FRRY" in little-endian ASCII.
const VENDOR_ID: u32 = u32::from_le_bytes(*b"FRRY");

/// Register offsets (virtio 1.2 §4.2.2, table "MMIO Device Register Layout").
use ferry_guest_abi::virtio::mmio as reg;
pub use reg::CONFIG as CONFIG_OFFSET;

/// InterruptStatus bits (virtio 1.2 §4.2.2).
pub const INT_USED_BUFFER: u32 = 1;
pub const INT_CONFIG: u32 = 2;

/// The kernel command line fragment that makes Linux probe a virtio-mmio device at `base` with
/// interrupt `irq` (Linux `drivers/virtio/virtio_mmio.c`: `virtio_mmio.device=<size>@<base>:<irq>`,
/// the size parsed by `memparse`), e.g. `virtio_mmio.device=4K@0xd0000000:5`.
pub fn cmdline_fragment(base: u64, irq: u32) -> String {
    format!("virtio_mmio.device={}K@{base:#x}:{irq}", MMIO_SIZE >> 10)
}

/// What the driver wrote about a queue, checked only when it sets QueueReady.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct QueueSetup {
    size: u16,
    desc: u64,
    driver: u64,
    device: u64,
}

/// Why a queue could not be made ready (or restored ready).
#[derive(Debug, thiserror::Error)]
enum QueueSetupError {
    #[error("queue {queue}: {source} (size {size}, maximum {max})")]
    Invalid {
        queue: usize,
        size: u16,
        max: u16,
        #[source]
        source: virtio_queue::Error,
    },
    #[error("queue {queue}: the {ring} ({len} bytes at {gpa:#x}) is not inside guest RAM")]
    NotRam {
        queue: usize,
        ring: &'static str,
        gpa: u64,
        len: u64,
    },
}

/// A virtio device on the MMIO bus.
pub struct MmioTransport<D> {
    device: D,
    ram: Arc<GuestRam>,
    irq: IrqLine,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    setups: Vec<QueueSetup>,
    /// The ready (validated) queues; QueueReady reads 1 for a `Some`.
    queues: Vec<Option<Queue>>,
    interrupt_status: u32,
    config_generation: u32,
}

impl<D> std::fmt::Debug for MmioTransport<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("status", &self.status)
            .field("driver_features", &self.driver_features)
            .field("interrupt_status", &self.interrupt_status)
            .finish_non_exhaustive()
    }
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// Puts `device` behind the transport; it reads and writes `ram` and interrupts on `irq`.
    pub fn new(device: D, ram: Arc<GuestRam>, irq: IrqLine) -> Self {
        let n = device.max_queues();
        let mut t = MmioTransport {
            device,
            ram,
            irq,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            setups: vec![QueueSetup::default(); n],
            queues: (0..n).map(|_| None).collect(),
            interrupt_status: 0,
            config_generation: 0,
        };
        t.reset();
        t
    }

    /// The device, for reading its state and counters.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, for a host request; a request that changes config space must call
    /// [`MmioTransport::config_changed`] after.
    pub(crate) fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// The driver has set DRIVER_OK and the device does not need a reset: queues may run.
    pub fn driver_ok(&self) -> bool {
        self.status & (status::DRIVER_OK | status::DEVICE_NEEDS_RESET) == status::DRIVER_OK
    }

    /// The features the driver accepted (meaningful once FEATURES_OK is set).
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    pub fn interrupt_status(&self) -> u32 {
        self.interrupt_status
    }

    /// Everything offered: the device's features and the transport's VERSION_1.
    fn offered(&self) -> u64 {
        self.device.features() | VIRTIO_F_VERSION_1
    }

    /// Raises the line again if an interrupt is pending; the VMM calls it once the interrupt
    /// controller's state is loaded after a restore.
    pub fn raise_pending(&self) {
        if self.interrupt_status != 0 {
            self.raise();
        }
    }

    fn raise(&self) {
        if let Err(e) = self.irq.raise() {
            tracing::warn!("{}: cannot raise its interrupt: {e}", self.device.name());
        }
    }

    fn signal(&mut self, bits: u32) {
        self.interrupt_status |= bits;
        self.raise();
    }

    /// The device changed its config space: a new generation, and a config interrupt if the
    /// driver is running (before DRIVER_OK the driver reads config when it probes).
    pub(crate) fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        if self.driver_ok() {
            self.signal(INT_CONFIG);
        }
    }

    /// A driver error: the device stops until the driver resets it (virtio 1.2 §2.1.2).
    fn needs_reset(&mut self, why: impl std::fmt::Display) {
        tracing::warn!("{}: {why}; device needs reset", self.device.name());
        let was_running = self.driver_ok();
        self.status |= status::DEVICE_NEEDS_RESET;
        if was_running {
            self.signal(INT_CONFIG);
        }
    }

    /// Runs `f` on ready queue `index` if the driver is running, then interrupts if it returned
    /// buffers, or sets DEVICE_NEEDS_RESET if it failed. Returns whether `f` ran.
    pub(crate) fn run_on_queue(
        &mut self,
        index: usize,
        f: impl FnOnce(&mut D, &mut Queue, &GuestRam) -> Result<bool, VirtioError>,
    ) -> bool {
        if !self.driver_ok() {
            return false;
        }
        let Some(Some(queue)) = self.queues.get_mut(index) else {
            return false;
        };
        match f(&mut self.device, queue, &self.ram) {
            // Without EVENT_IDX this is always true; with it, the driver's used_event says.
            Ok(true) => {
                if queue.needs_notification(self.ram.memory()).unwrap_or(true) {
                    self.signal(INT_USED_BUFFER);
                }
            }
            Ok(false) => {}
            Err(e) => self.needs_reset(e),
        }
        true
    }

    fn reset(&mut self) {
        self.device.reset();
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.interrupt_status = 0;
        self.queues.fill_with(|| None);
        self.setups.fill(QueueSetup::default());
    }

    fn read_register(&self, offset: u64) -> u32 {
        let q = self.queue_sel as usize;
        match offset {
            reg::MAGIC_VALUE => MAGIC,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.offered() as u32,
                1 => (self.offered() >> 32) as u32,
                _ => 0,
            },
            // "0x0 if the queue is not available" (virtio 1.2 §4.2.2).
            reg::QUEUE_NUM_MAX if q < self.queue_count() => {
                self.device.queue_max_size(self.driver_features, q).into()
            }
            reg::QUEUE_READY => self.queues.get(q).is_some_and(Option::is_some).into(),
            reg::INTERRUPT_STATUS => self.interrupt_status,
            reg::STATUS => self.status,
            reg::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    fn queue_count(&self) -> usize {
        self.device
            .queue_count(self.driver_features)
            .min(self.queues.len())
    }

    /// The selected queue, if the driver may set it up now.
    fn setup_slot(&mut self) -> Option<usize> {
        let q = self.queue_sel as usize;
        let phase = self.status
            & (status::FEATURES_OK | status::DRIVER_OK | status::DEVICE_NEEDS_RESET)
            == status::FEATURES_OK;
        if !phase || q >= self.queue_count() {
            tracing::warn!(
                "{}: queue {q} set up outside FEATURES_OK..DRIVER_OK or beyond the queues; ignored",
                self.device.name()
            );
            return None;
        }
        if self.queues[q].is_some() {
            tracing::warn!(
                "{}: queue {q} changed while ready; ignored",
                self.device.name()
            );
            return None;
        }
        Some(q)
    }

    fn write_register(&mut self, offset: u64, v: u32) {
        let set_half = |addr: &mut u64, high: bool| {
            *addr = match high {
                false => (*addr & !0xffff_ffff) | u64::from(v),
                true => (*addr & 0xffff_ffff) | (u64::from(v) << 32),
            }
        };
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES => {
                let open = self.status & (status::DRIVER | status::FEATURES_OK) == status::DRIVER;
                match (open, self.driver_features_sel) {
                    (true, 0) => set_half(&mut self.driver_features, false),
                    (true, 1) => set_half(&mut self.driver_features, true),
                    (true, _) => {}
                    (false, _) => tracing::warn!(
                        "{}: features written outside DRIVER..FEATURES_OK; ignored",
                        self.device.name()
                    ),
                }
            }
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM => {
                if let Some(q) = self.setup_slot() {
                    // A size beyond u16 is no power of two the device offers: refused at ready.
                    self.setups[q].size = u16::try_from(v).unwrap_or(0);
                }
            }
            reg::QUEUE_DESC_LOW | reg::QUEUE_DESC_HIGH => {
                if let Some(q) = self.setup_slot() {
                    set_half(&mut self.setups[q].desc, offset == reg::QUEUE_DESC_HIGH);
                }
            }
            reg::QUEUE_DRIVER_LOW | reg::QUEUE_DRIVER_HIGH => {
                if let Some(q) = self.setup_slot() {
                    set_half(&mut self.setups[q].driver, offset == reg::QUEUE_DRIVER_HIGH);
                }
            }
            reg::QUEUE_DEVICE_LOW | reg::QUEUE_DEVICE_HIGH => {
                if let Some(q) = self.setup_slot() {
                    set_half(&mut self.setups[q].device, offset == reg::QUEUE_DEVICE_HIGH);
                }
            }
            reg::QUEUE_READY => self.set_queue_ready(v),
            reg::QUEUE_NOTIFY => self.notify(v),
            reg::INTERRUPT_ACK => self.interrupt_status &= !v,
            reg::STATUS => self.set_status(v),
            _ => tracing::debug!(
                "{}: write of {v:#x} to read-only or unknown register {offset:#x} ignored",
                self.device.name()
            ),
        }
    }

    fn set_queue_ready(&mut self, v: u32) {
        // A ready queue may still be turned off before DRIVER_OK.
        let q = self.queue_sel as usize;
        let before_driver_ok = self.status & status::DRIVER_OK == 0;
        if v == 0 && before_driver_ok && q < self.queues.len() {
            self.queues[q] = None;
            return;
        }
        let Some(q) = self.setup_slot() else { return };
        if v != 1 {
            return;
        }
        let features = self.driver_features;
        match self.checked_queue(q, self.setups[q], (0, 0), features) {
            Ok(queue) => self.queues[q] = Some(queue),
            Err(e) => self.needs_reset(e),
        }
    }

    /// Queue `index` as `setup` describes it, ready at ring positions `(next_avail,
    /// next_used)`, if the setup is valid: size, alignment, rings in guest RAM.
    fn checked_queue(
        &self,
        index: usize,
        setup: QueueSetup,
        (next_avail, next_used): (u16, u16),
        features: u64,
    ) -> Result<Queue, QueueSetupError> {
        let max = self.device.queue_max_size(features, index);
        let queue = Queue::try_from(QueueState {
            max_size: max,
            next_avail,
            next_used,
            event_idx_enabled: features & VIRTIO_F_RING_EVENT_IDX != 0,
            size: setup.size,
            ready: true,
            desc_table: setup.desc,
            avail_ring: setup.driver,
            used_ring: setup.device,
        })
        .map_err(|source| QueueSetupError::Invalid {
            queue: index,
            size: setup.size,
            max,
            source,
        })?;
        // Ring sizes for `n` entries (virtio 1.2 §2.7): 16-byte descriptors; flags, idx,
        // n 2-byte entries and used_event; flags, idx, n 8-byte entries and avail_event.
        let n = u64::from(setup.size);
        for (ring, gpa, len) in [
            ("descriptor table", setup.desc, 16 * n),
            ("available ring", setup.driver, 6 + 2 * n),
            ("used ring", setup.device, 6 + 8 * n),
        ] {
            if !GuestMemoryBackend::check_range(self.ram.memory(), GuestAddress(gpa), len as usize)
            {
                return Err(QueueSetupError::NotRam {
                    queue: index,
                    ring,
                    gpa,
                    len,
                });
            }
        }
        Ok(queue)
    }

    fn notify(&mut self, v: u32) {
        // Without VIRTIO_F_NOTIFICATION_DATA the value is the queue index.
        let index = v as usize;
        if !self.run_on_queue(index, |d, q, ram| d.process_queue(index, q, ram)) {
            tracing::debug!(
                "{}: notification of queue {index} ignored: the driver is not running or the queue is not ready",
                self.device.name()
            );
        }
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // DEVICE_NEEDS_RESET is the device's to set; a driver writing back what it read
        // neither sets nor clears it.
        let sticky = self.status & status::DEVICE_NEEDS_RESET;
        let v = v & status::KNOWN & !status::DEVICE_NEEDS_RESET;
        let current = self.status & !status::DEVICE_NEEDS_RESET;
        if v & current != current {
            return self.needs_reset(format_args!(
                "the driver cleared status bits ({current:#x} to {v:#x})"
            ));
        }
        let added = v & !current;
        let mut accepted = v;
        if added & status::FEATURES_OK != 0 {
            let unoffered = self.driver_features & !self.offered();
            if v & status::DRIVER == 0 {
                return self.needs_reset("FEATURES_OK before DRIVER");
            } else if self.driver_features & VIRTIO_F_VERSION_1 == 0 || unoffered != 0 {
                // Not an error: the driver reads status back and sees FEATURES_OK missing.
                tracing::warn!(
                    "{}: features {:#x} refused (VERSION_1 is required; not offered: {unoffered:#x})",
                    self.device.name(),
                    self.driver_features
                );
                accepted &= !(status::FEATURES_OK | status::DRIVER_OK);
            }
        }
        if added & status::DRIVER_OK != 0 && accepted & status::DRIVER_OK != 0 {
            if accepted & status::FEATURES_OK == 0 {
                return self.needs_reset("DRIVER_OK without FEATURES_OK");
            }
            self.device.activate(self.driver_features);
        }
        self.status = accepted | sticky;
    }
}

impl<D: VirtioDevice> Device for MmioTransport<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            return self.device.read_config(offset - reg::CONFIG, data);
        }
        match <&mut [u8; 4]>::try_from(&mut *data) {
            Ok(word) if offset.is_multiple_of(4) => {
                *word = self.read_register(offset).to_le_bytes();
            }
            _ => {
                data.fill(0);
                tracing::debug!("{}: register read not 32-bit aligned", self.device.name());
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            return self.device.write_config(offset - reg::CONFIG, data);
        }
        match <[u8; 4]>::try_from(data) {
            Ok(word) if offset.is_multiple_of(4) => {
                self.write_register(offset, u32::from_le_bytes(word));
            }
            _ => tracing::debug!("{}: register write not 32-bit aligned", self.device.name()),
        }
    }

    fn kind(&self) -> SectionKind {
        SectionKind::single(VIRTIO_MMIO, VERSION)
    }

    fn save(&self) -> Vec<u8> {
        self.state().encode()
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version(self.device.name(), version, self.kind().loads())?;
        self.load(data)
    }
}

#[cfg(test)]
mod tests;
