//! The virtio-mmio transport's state section, layout [`super::VERSION`] 1: a plain value
//! ([`TransportState`]), its byte layout, and its validation against the device and guest RAM
//! before anything is replaced. This file adds the save (`state`) and the load (`load`) to
//! [`MmioTransport`], standing on `mmio.rs`, which only calls them and names nothing here.
//!
//! Layout (little-endian):
//!
//! | field | bytes |
//! | --- | --- |
//! | device type | 4 |
//! | status, DeviceFeaturesSel, DriverFeaturesSel | 4 each |
//! | driver features | 8 |
//! | QueueSel, InterruptStatus, ConfigGeneration | 4 each |
//! | queue count (at most [`MAX_QUEUES`]) | 2 |
//! | per queue: size 2, ready 1, event idx 1, desc 8, driver 8, device 8, next_avail 2, next_used 2 | 32 |
//! | device state length (at most [`MAX_DEVICE_STATE`]), then the device's own bytes | 4 + n |
//!
//! Invariant: [`MmioTransport::apply`] either refuses with `Malformed` naming the field, and
//! leaves transport and device as they were, or replaces both.

#![forbid(unsafe_code)]

use virtio_queue::QueueT;

use super::super::codec::{Reader, Writer};
use super::super::device::{
    Negotiated, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1, VirtioDevice, status,
};
use super::{INT_CONFIG, INT_USED_BUFFER, MmioTransport, QueueSetup};
use crate::devices::device::DeviceStateError;

/// Queues a section may carry: more than any device here has (a balloon has 5), few enough
/// that a corrupt count cannot make the decoder allocate much.
pub const MAX_QUEUES: usize = 16;
/// Bytes of device state a section may carry: a balloon's is under 1 KiB, a NIC's up to its
/// pending frames' 2 MiB; the cap only bounds what a corrupt length can make the decoder
/// accept.
pub const MAX_DEVICE_STATE: usize = 4 << 20;

/// One queue as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueRecord {
    pub size: u16,
    pub ready: bool,
    pub event_idx: bool,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
    pub next_avail: u16,
    pub next_used: u16,
}

/// Everything the transport migrates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportState {
    pub device_type: u32,
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub queue_sel: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<QueueRecord>,
    pub device: Vec<u8>,
}

impl TransportState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.device_type)
            .u32(self.status)
            .u32(self.device_features_sel)
            .u32(self.driver_features_sel)
            .u64(self.driver_features)
            .u32(self.queue_sel)
            .u32(self.interrupt_status)
            .u32(self.config_generation)
            .u16(self.queues.len() as u16);
        for q in &self.queues {
            w.u16(q.size)
                .bool(q.ready)
                .bool(q.event_idx)
                .u64(q.desc)
                .u64(q.driver)
                .u64(q.device)
                .u16(q.next_avail)
                .u16(q.next_used);
        }
        w.blob(&self.device);
        w.into_bytes()
    }

    /// The fields of `b`, each present and within its cap (not yet checked against a device).
    pub fn decode(name: &'static str, b: &[u8]) -> Result<TransportState, DeviceStateError> {
        let mut r = Reader::new(name, b);
        let mut s = TransportState {
            device_type: r.u32("device type")?,
            status: r.u32("status")?,
            device_features_sel: r.u32("DeviceFeaturesSel")?,
            driver_features_sel: r.u32("DriverFeaturesSel")?,
            driver_features: r.u64("driver features")?,
            queue_sel: r.u32("QueueSel")?,
            interrupt_status: r.u32("InterruptStatus")?,
            config_generation: r.u32("ConfigGeneration")?,
            queues: Vec::new(),
            device: Vec::new(),
        };
        let count = r.u16("queue count")? as usize;
        if count > MAX_QUEUES {
            return Err(r.malformed(format!("{count} queues, above the cap {MAX_QUEUES}")));
        }
        for _ in 0..count {
            s.queues.push(QueueRecord {
                size: r.u16("queue size")?,
                ready: r.bool("queue ready")?,
                event_idx: r.bool("queue event idx")?,
                desc: r.u64("queue descriptor table")?,
                driver: r.u64("queue available ring")?,
                device: r.u64("queue used ring")?,
                next_avail: r.u16("queue next_avail")?,
                next_used: r.u16("queue next_used")?,
            });
        }
        s.device = r.blob("device state", MAX_DEVICE_STATE)?.to_vec();
        r.finish()?;
        Ok(s)
    }
}

impl<D: VirtioDevice> MmioTransport<D> {
    pub(super) fn state(&self) -> TransportState {
        TransportState {
            device_type: self.device.device_type(),
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt_status,
            config_generation: self.config_generation,
            queues: self
                .queues
                .iter()
                .zip(&self.setups)
                .map(|(q, s)| QueueRecord {
                    size: s.size,
                    ready: q.is_some(),
                    event_idx: q.as_ref().is_some_and(|q| q.event_idx_enabled()),
                    desc: s.desc,
                    driver: s.driver,
                    device: s.device,
                    next_avail: q.as_ref().map_or(0, |q| q.next_avail()),
                    next_used: q.as_ref().map_or(0, |q| q.next_used()),
                })
                .collect(),
            device: self.device.save(),
        }
    }

    /// Decodes a section's bytes and [`apply`](Self::apply)s them.
    pub(super) fn load(&mut self, data: &[u8]) -> Result<(), DeviceStateError> {
        let state = TransportState::decode(self.device.name(), data)?;
        self.apply(state)
    }

    /// Validates `s` against this device and guest RAM, then replaces the transport's and the
    /// device's state with it.
    fn apply(&mut self, s: TransportState) -> Result<(), DeviceStateError> {
        let name = self.device.name();
        let bad = |reason: String| DeviceStateError::Malformed {
            device: name,
            reason,
        };
        if s.device_type != self.device.device_type() {
            return Err(bad(format!(
                "device type {} where this VM has {} (device {})",
                s.device_type,
                self.device.device_type(),
                name
            )));
        }
        check_status(s.status).map_err(|r| bad(r.into()))?;
        let features_ok = s.status & status::FEATURES_OK != 0;
        let unoffered = s.driver_features & !self.offered();
        if unoffered != 0 {
            return Err(bad(format!(
                "driver features {unoffered:#x} were never offered"
            )));
        }
        if features_ok && s.driver_features & VIRTIO_F_VERSION_1 == 0 {
            return Err(bad("FEATURES_OK without VIRTIO_F_VERSION_1".into()));
        }
        if s.interrupt_status & !(INT_USED_BUFFER | INT_CONFIG) != 0 {
            return Err(bad(format!(
                "InterruptStatus {:#x} has unknown bits",
                s.interrupt_status
            )));
        }
        if s.queues.len() != self.queues.len() {
            return Err(bad(format!(
                "{} queues where the device has {}",
                s.queues.len(),
                self.queues.len()
            )));
        }
        let count = self.device.queue_count(s.driver_features);
        let event_idx = s.driver_features & VIRTIO_F_RING_EVENT_IDX != 0;
        let mut queues = Vec::with_capacity(s.queues.len());
        for (i, r) in s.queues.iter().enumerate() {
            let setup = QueueSetup {
                size: r.size,
                desc: r.desc,
                driver: r.driver,
                device: r.device,
            };
            let queue = if r.ready {
                if !features_ok || i >= count {
                    return Err(bad(format!(
                        "queue {i} is ready, but the negotiation gives it no queue"
                    )));
                }
                if r.event_idx != event_idx {
                    return Err(bad(format!(
                        "queue {i}'s event idx flag is not as negotiated"
                    )));
                }
                let positions = (r.next_avail, r.next_used);
                let q = self
                    .checked_queue(i, setup, positions, s.driver_features)
                    .map_err(|e| bad(e.to_string()))?;
                Some(q)
            } else if (r.next_avail, r.next_used, r.event_idx) != (0, 0, false) {
                return Err(bad(format!(
                    "queue {i} is not ready but has ring positions"
                )));
            } else {
                None
            };
            queues.push((setup, queue));
        }
        let ready_sizes: Vec<u16> = queues
            .iter()
            .map(|(_, q)| q.as_ref().map_or(0, |q| q.size()))
            .collect();
        let negotiated = Negotiated {
            features: if features_ok { s.driver_features } else { 0 },
            ready_sizes: &ready_sizes,
        };
        // The device validates and replaces its own state last: if it refuses, nothing changed.
        self.device.restore(&s.device, &negotiated)?;
        self.status = s.status;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.driver_features = s.driver_features;
        self.queue_sel = s.queue_sel;
        self.interrupt_status = s.interrupt_status;
        self.config_generation = s.config_generation;
        (self.setups, self.queues) = queues.into_iter().unzip();
        Ok(())
    }
}

/// A status the transport could have reached: known bits, set in order.
fn check_status(s: u32) -> Result<(), &'static str> {
    let has = |b| s & b != 0;
    if s & !status::KNOWN != 0 {
        Err("status has unknown bits")
    } else if has(status::FEATURES_OK) && !has(status::DRIVER) {
        Err("status has FEATURES_OK without DRIVER")
    } else if has(status::DRIVER_OK) && !has(status::FEATURES_OK) {
        Err("status has DRIVER_OK without FEATURES_OK")
    } else {
        Ok(())
    }
}
