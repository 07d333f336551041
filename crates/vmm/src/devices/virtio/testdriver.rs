//! A host-side virtio driver for tests: it lays out split queues in a [`GuestRam`] and talks to
//! an [`MmioTransport`] only through its registers and config space, as a guest driver does, so
//! the tests exercise the device exactly as Linux would (and as a hostile driver could).

#![forbid(unsafe_code)]

use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::device::{VirtioDevice, status};
use super::mmio::{CONFIG_OFFSET, MmioTransport};
use crate::devices::device::Device;
use crate::devices::irq::IrqLine;
use crate::memory::GuestRam;

/// Guest RAM of every test: the smallest guest.
pub const RAM: u64 = 64 << 20;
/// Descriptor flags (virtio 1.2 §2.7.5).
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;
/// Queue `i`'s rings live in the 64 KiB at `RINGS + i * RING_SPAN`: a 1024-entry queue needs
/// 16 KiB of descriptors, 2 KiB of available ring and 8 KiB of used ring.
const RINGS: u64 = 0x10_0000;
const RING_SPAN: u64 = 0x1_0000;
/// Buffers the driver writes (commands, PFN arrays) come from here up.
const BUFFERS: u64 = 0x20_0000;

/// Register offsets (virtio 1.2 §4.2.2).
pub use ferry_guest_abi::virtio::mmio as reg;

/// The driver's view of one queue.
#[derive(Clone, Copy, Debug, Default)]
pub struct TestQueue {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub next_desc: u16,
    pub avail_idx: u16,
    pub last_used: u16,
}

/// A test driver bound to one transport.
#[derive(Debug)]
pub struct Driver<D> {
    pub t: MmioTransport<D>,
    pub ram: Arc<GuestRam>,
    irq: EventFd,
    pub queues: Vec<TestQueue>,
    next_buffer: u64,
}

impl<D: VirtioDevice> Driver<D> {
    /// A reset device on fresh RAM.
    pub fn new(device: D) -> Driver<D> {
        let ram = Arc::new(GuestRam::new(RAM).unwrap());
        Driver::with_ram(device, ram)
    }

    pub fn with_ram(device: D, ram: Arc<GuestRam>) -> Driver<D> {
        let irq = IrqLine::unconnected().unwrap();
        let probe = irq.eventfd().try_clone().unwrap();
        Driver {
            t: MmioTransport::new(device, ram.clone(), irq),
            ram,
            irq: probe,
            queues: Vec::new(),
            next_buffer: BUFFERS,
        }
    }

    /// A device the driver has brought to DRIVER_OK with `features` and every queue set up.
    pub fn running(device: D, features: u64) -> Driver<D> {
        let mut d = Driver::new(device);
        assert!(d.negotiate(features), "features {features:#x} refused");
        let mut q = 0;
        while d.queue_max(q) > 0 {
            let size = d.queue_max(q).min(64);
            assert!(d.setup_queue(q, size), "queue {q}");
            q += 1;
        }
        d.driver_ok();
        d
    }

    pub fn read(&mut self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.t.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn write(&mut self, offset: u64, v: u32) {
        self.t.write(offset, &v.to_le_bytes());
    }

    pub fn status(&mut self) -> u32 {
        self.read(reg::STATUS)
    }

    pub fn add_status(&mut self, bits: u32) {
        let s = self.status();
        self.write(reg::STATUS, s | bits);
    }

    /// ACKNOWLEDGE, DRIVER, the features, FEATURES_OK; returns whether FEATURES_OK stuck.
    pub fn negotiate(&mut self, features: u64) -> bool {
        self.write(reg::STATUS, 0);
        self.add_status(status::ACKNOWLEDGE);
        self.add_status(status::DRIVER);
        self.write_features(features);
        self.add_status(status::FEATURES_OK);
        self.status() & status::FEATURES_OK != 0
    }

    pub fn write_features(&mut self, features: u64) {
        for sel in 0..2 {
            self.write(reg::DRIVER_FEATURES_SEL, sel);
            self.write(reg::DRIVER_FEATURES, (features >> (32 * sel)) as u32);
        }
    }

    pub fn device_features(&mut self) -> u64 {
        (0..2).fold(0, |acc, sel| {
            self.write(reg::DEVICE_FEATURES_SEL, sel);
            acc | u64::from(self.read(reg::DEVICE_FEATURES)) << (32 * sel)
        })
    }

    pub fn queue_max(&mut self, index: u32) -> u16 {
        self.write(reg::QUEUE_SEL, index);
        self.read(reg::QUEUE_NUM_MAX) as u16
    }

    /// Writes queue `index`'s rings at addresses of its own; returns whether QueueReady reads 1.
    pub fn setup_queue(&mut self, index: u32, size: u16) -> bool {
        let base = RINGS + u64::from(index) * RING_SPAN;
        let q = TestQueue {
            size,
            desc: base,
            avail: base + 0x4000,
            used: base + 0x5000,
            ..TestQueue::default()
        };
        self.setup_queue_at(index, q)
    }

    /// Writes queue `index`'s setup as `q` says, valid or not.
    pub fn setup_queue_at(&mut self, index: u32, q: TestQueue) -> bool {
        self.write(reg::QUEUE_SEL, index);
        self.write(reg::QUEUE_NUM, q.size.into());
        for (low, addr) in [
            (reg::QUEUE_DESC_LOW, q.desc),
            (reg::QUEUE_DRIVER_LOW, q.avail),
            (reg::QUEUE_DEVICE_LOW, q.used),
        ] {
            self.write(low, addr as u32);
            self.write(low + 4, (addr >> 32) as u32); // the High register follows
        }
        self.write(reg::QUEUE_READY, 1);
        let index = index as usize;
        if self.queues.len() <= index {
            self.queues.resize(index + 1, TestQueue::default());
        }
        self.queues[index] = q;
        self.read(reg::QUEUE_READY) == 1
    }

    pub fn driver_ok(&mut self) {
        self.add_status(status::DRIVER_OK);
    }

    /// Writes `bytes` into a fresh buffer; returns its guest address.
    pub fn buffer(&mut self, bytes: &[u8]) -> u64 {
        let at = self.next_buffer;
        self.next_buffer = (at + bytes.len().max(1) as u64).next_multiple_of(16);
        self.ram.write(at, bytes).unwrap();
        at
    }

    /// The table slot the next descriptor written to queue `q` takes.
    pub fn next_slot(&self, q: usize) -> u16 {
        self.queues[q].next_desc
    }

    /// Writes raw descriptors `(addr, len, flags, next)` (`next` an absolute slot) into the
    /// next slots of queue `q`'s table and makes the first available. Returns the head.
    pub fn add_raw(&mut self, q: usize, descs: &[(u64, u32, u16, u16)]) -> u16 {
        let tq = self.queues[q];
        let head = tq.next_desc;
        for (i, &d) in descs.iter().enumerate() {
            self.put_desc(tq.desc, (head + i as u16) % tq.size, d);
        }
        self.queues[q].next_desc = (head + descs.len() as u16) % tq.size;
        self.make_available(q, head);
        head
    }

    /// One chain of `(addr, len, writable)` buffers, made available. Returns the head.
    pub fn add(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> u16 {
        let (head, size) = (self.next_slot(q), self.queues[q].size);
        let n = bufs.len() as u16;
        let descs: Vec<_> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, w))| {
                let i = i as u16;
                let flags = if w { F_WRITE } else { 0 } | if i + 1 < n { F_NEXT } else { 0 };
                (addr, len, flags, (head + i + 1) % size)
            })
            .collect();
        self.add_raw(q, &descs)
    }

    pub fn put_desc(&self, table: u64, slot: u16, (addr, len, flags, next): (u64, u32, u16, u16)) {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..].copy_from_slice(&next.to_le_bytes());
        self.ram.write(table + u64::from(slot) * 16, &b).unwrap();
    }

    /// Puts `head` in queue `q`'s available ring and publishes the new index.
    pub fn make_available(&mut self, q: usize, head: u16) {
        let tq = &mut self.queues[q];
        let slot = u64::from(tq.avail_idx % tq.size);
        self.ram
            .write(tq.avail + 4 + 2 * slot, &head.to_le_bytes())
            .unwrap();
        tq.avail_idx = tq.avail_idx.wrapping_add(1);
        self.ram
            .write(tq.avail + 2, &tq.avail_idx.to_le_bytes())
            .unwrap();
    }

    pub fn notify(&mut self, q: usize) {
        self.write(reg::QUEUE_NOTIFY, q as u32);
    }

    /// The `(id, len)` entries the device added to queue `q`'s used ring since the last call.
    pub fn used(&mut self, q: usize) -> Vec<(u32, u32)> {
        let tq = self.queues[q];
        let mut b = [0u8; 2];
        self.ram.read(tq.used + 2, &mut b).unwrap();
        let idx = u16::from_le_bytes(b);
        let mut out = Vec::new();
        let mut at = tq.last_used;
        while at != idx {
            let mut e = [0u8; 8];
            let slot = u64::from(at % tq.size);
            self.ram.read(tq.used + 4 + 8 * slot, &mut e).unwrap();
            out.push((
                u32::from_le_bytes(e[..4].try_into().unwrap()),
                u32::from_le_bytes(e[4..].try_into().unwrap()),
            ));
            at = at.wrapping_add(1);
        }
        self.queues[q].last_used = idx;
        out
    }

    /// Whether the line was raised since the last call.
    pub fn raised(&self) -> bool {
        self.irq.read().is_ok_and(|n| n > 0)
    }

    /// Reads InterruptStatus and acknowledges what it read, as Linux's handler does.
    pub fn take_interrupts(&mut self) -> u32 {
        let s = self.read(reg::INTERRUPT_STATUS);
        self.write(reg::INTERRUPT_ACK, s);
        s
    }

    pub fn config32(&mut self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.t.read(CONFIG_OFFSET + offset, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn write_config32(&mut self, offset: u64, v: u32) {
        self.t.write(CONFIG_OFFSET + offset, &v.to_le_bytes());
    }
}
