//! [`Devices`]: every device of one VM registered on its bus under a section kind and an
//! instance number, the vCPU exits routed to them, and all of them saved and loaded as
//! sections.
//!
//! A registration is refused ([`RegisterError`]) when the device's section id is not listed as
//! a device's in `section_ids`, or when a device already registered has the same id and
//! instance: the two would save sections a destination cannot tell apart, and one of them would
//! load the other's state. So each (id, instance) names one device of the VM.
//!
//! Devices load in the order they were registered, whatever the stream's order, so a device may
//! count on the state of one registered before it (the VM generation ID device sets the
//! telemetry's record of the guest's last word on it, after the telemetry port replaced the
//! whole telemetry). A stream must hold a section for every device whose section is
//! [`SectionNeed::Mandatory`]; one without an optional device's section leaves that device as
//! it was built.

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use ferry_migrate::Section;
use ferry_migrate::wire::SectionId;

use super::bus::{Bus, BusError};
use super::device::{BusKind, Device, DeviceStateError, SectionKind, SectionNeed};
use crate::part_timer::PartTimer;
use crate::section_ids::{self, Owner};

/// A registered device.
struct Entry {
    name: &'static str,
    kind: SectionKind,
    need: SectionNeed,
    instance: u32,
    device: Arc<Mutex<dyn Device>>,
}

/// Why a device could not be registered.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegisterError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(
        "{second} would save its state as {id} instance {instance}, which is {first}'s: a \
         destination could not tell the two apart; give {second} an instance number of its own"
    )]
    Twin {
        id: SectionId,
        instance: u32,
        /// The device registered first under `id` and `instance`.
        first: &'static str,
        /// The device refused.
        second: &'static str,
    },
    #[error(
        "{name} saves its state as {id}, which section_ids.rs does not list as a device's; \
         declare the device's id there, a number no other state uses"
    )]
    Unlisted { name: &'static str, id: SectionId },
}

/// Why a section could not be loaded into the devices.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoadError {
    #[error(transparent)]
    State(#[from] DeviceStateError),
    #[error(
        "{0} instance {1} names no device of this VM; start the destination with the source's devices"
    )]
    NoDevice(SectionId, u32),
    #[error(
        "the stream has no state for {name} (instance {instance}); the source has different devices"
    )]
    Missing { name: &'static str, instance: u32 },
}

/// Every device of one VM, on its buses.
#[derive(Default)]
pub struct Devices {
    pio: Bus,
    mmio: Bus,
    entries: Vec<Entry>,
    /// Ports and MMIO pages already reported as unknown: each is logged once, then ignored.
    unknown: Mutex<HashSet<(BusKind, u64)>>,
}

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Devices")
            .field("pio", &self.pio)
            .field("mmio", &self.mmio)
            .finish_non_exhaustive()
    }
}

impl Devices {
    /// Places `device` at `base..base + len` on `bus`, its state saved as `instance` of its
    /// kind; refuses (and places nothing) a device whose id and instance another device has,
    /// or whose id is not a device's in `section_ids`.
    pub fn register(
        &mut self,
        name: &'static str,
        instance: u32,
        (bus, base, len): (BusKind, u64, u64),
        device: Arc<Mutex<dyn Device>>,
    ) -> Result<(), RegisterError> {
        let (kind, need) = {
            let d = device.lock().unwrap();
            (d.kind(), d.need())
        };
        let id = kind.id;
        if section_ids::find(id).map(|l| l.owner) != Some(Owner::Device) {
            return Err(RegisterError::Unlisted { name, id });
        }
        if let Some(first) = self
            .entries
            .iter()
            .find(|e| e.kind.id == id && e.instance == instance)
        {
            return Err(RegisterError::Twin {
                id,
                instance,
                first: first.name,
                second: name,
            });
        }
        let target = match bus {
            BusKind::Pio => &mut self.pio,
            BusKind::Mmio => &mut self.mmio,
        };
        target.insert(name, base, len, device.clone())?;
        self.entries.push(Entry {
            name,
            kind,
            need,
            instance,
            device,
        });
        Ok(())
    }

    pub fn io_out(&self, port: u16, data: &[u8]) {
        if !self.pio.write(port.into(), data) {
            self.unknown(BusKind::Pio, port.into(), "write to I/O port");
        }
    }

    pub fn io_in(&self, port: u16, data: &mut [u8]) {
        if !self.pio.read(port.into(), data) {
            data.fill(0xff);
            self.unknown(BusKind::Pio, port.into(), "read of I/O port");
        }
    }

    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        if !self.mmio.read(addr, data) {
            data.fill(0xff);
            self.unknown(BusKind::Mmio, addr & !0xfff, "read from MMIO page");
        }
    }

    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        if !self.mmio.write(addr, data) {
            self.unknown(BusKind::Mmio, addr & !0xfff, "write to MMIO page");
        }
    }

    /// Every device's state, one section each.
    pub fn save(&self, timer: &mut PartTimer) -> Vec<Section> {
        self.entries
            .iter()
            .map(|e| {
                let data = e.device.lock().unwrap().save();
                timer.mark(|| format!("{} {}", e.name, e.instance), data.len());
                Section {
                    id: e.kind.id,
                    instance: e.instance,
                    version: e.kind.version,
                    data,
                }
            })
            .collect()
    }

    /// Each kind of device section this VM writes, once (COM1 and COM2 are one kind), under
    /// the name of its first instance, in registration order, with whether a stream must hold
    /// it: what the VM's description announces so that a destination checks the layouts before
    /// the source pauses.
    pub fn kinds(&self) -> Vec<(&'static str, SectionKind, SectionNeed)> {
        let mut kinds: Vec<(&'static str, SectionKind, SectionNeed)> = Vec::new();
        for e in &self.entries {
            if !kinds.iter().any(|(_, k, _)| k.id == e.kind.id) {
                kinds.push((e.name, e.kind, e.need));
            }
        }
        kinds
    }

    /// Whether `id` is a device section of this VM (the others are the VM's own).
    pub fn owns(&self, id: SectionId) -> bool {
        self.entries.iter().any(|e| e.kind.id == id)
    }

    /// Restores every device from `sections` (those with a device id), in registration order;
    /// each section must name a device, and each device with a mandatory section find it.
    pub fn load(&self, sections: &[Section], timer: &mut PartTimer) -> Result<(), LoadError> {
        let is = |e: &Entry, s: &Section| e.kind.id == s.id && e.instance == s.instance;
        if let Some(s) = sections
            .iter()
            .filter(|s| self.owns(s.id))
            .find(|s| !self.entries.iter().any(|e| is(e, s)))
        {
            return Err(LoadError::NoDevice(s.id, s.instance));
        }
        if let Some(e) = self
            .entries
            .iter()
            .find(|e| e.need.is_mandatory() && !sections.iter().any(|s| is(e, s)))
        {
            return Err(LoadError::Missing {
                name: e.name,
                instance: e.instance,
            });
        }
        for e in &self.entries {
            if let Some(s) = sections.iter().find(|s| is(e, s)) {
                e.device.lock().unwrap().restore(s.version, &s.data)?;
                timer.mark(|| format!("{} {}", e.name, e.instance), s.data.len());
            }
        }
        Ok(())
    }

    fn unknown(&self, bus: BusKind, addr: u64, what: &str) {
        if self.unknown.lock().unwrap().insert((bus, addr)) {
            tracing::warn!("guest {what} {addr:#x} ignored: no device there (logged once)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::irq::IrqLine;
    use crate::devices::serial::{self, SerialDevice, SerialOutput};
    use crate::section_ids::SERIAL;

    /// A UART whose output goes nowhere.
    fn uart() -> Arc<Mutex<SerialDevice>> {
        let line = IrqLine::unconnected().unwrap();
        Arc::new(Mutex::new(
            SerialDevice::new(&SerialOutput::Discard, line).unwrap(),
        ))
    }

    /// Two UARTs with different scratch registers, saved and loaded into a fresh pair.
    fn pair() -> (Devices, [Arc<Mutex<SerialDevice>>; 2]) {
        let mut devices = Devices::default();
        let uarts = [uart(), uart()];
        for (i, (u, port)) in uarts.iter().zip([0x3f8, 0x2f8]).enumerate() {
            devices
                .register("uart", i as u32, (BusKind::Pio, port, 8), u.clone())
                .unwrap();
        }
        (devices, uarts)
    }

    /// The 16550's scratch register, at offset 7.
    const SCRATCH: u16 = 7;

    #[test]
    fn two_instances_of_one_kind_migrate_apart() {
        let (source, _) = pair();
        source.io_out(0x3f8 + SCRATCH, &[0x11]);
        source.io_out(0x2f8 + SCRATCH, &[0x22]);
        let mut timer = PartTimer::start();
        let sections = source.save(&mut timer);
        assert_eq!(sections.len(), 2);
        let parts = timer.finish();
        assert_eq!(
            parts.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["uart 0", "uart 1"],
            "a part per device, named"
        );
        assert_eq!(sections[0].id, sections[1].id);
        assert_ne!(sections[0].instance, sections[1].instance);
        assert_eq!(
            source.kinds(),
            [(
                "uart",
                SectionKind::single(SERIAL, serial::VERSION),
                SectionNeed::Mandatory
            )],
            "one kind for both instances"
        );

        let (destination, _) = pair();
        destination
            .load(&sections, &mut PartTimer::start())
            .unwrap();
        let mut b = [0u8];
        destination.io_in(0x3f8 + SCRATCH, &mut b);
        assert_eq!(b, [0x11]);
        destination.io_in(0x2f8 + SCRATCH, &mut b);
        assert_eq!(b, [0x22]);
    }

    #[test]
    fn a_missing_or_foreign_instance_is_refused_by_name() {
        let (source, _) = pair();
        let mut sections = source.save(&mut PartTimer::start());
        let (destination, _) = pair();
        let second = sections.pop().unwrap();
        assert_eq!(
            destination.load(&sections, &mut PartTimer::start()),
            Err(LoadError::Missing {
                name: "uart",
                instance: 1
            })
        );
        sections.push(Section {
            instance: 9,
            ..second
        });
        assert_eq!(
            destination.load(&sections, &mut PartTimer::start()),
            Err(LoadError::NoDevice(SERIAL, 9))
        );
    }

    /// Two devices of one id and instance would save sections a destination cannot tell
    /// apart: the second is refused, naming both, and placed on no bus.
    #[test]
    fn a_twin_is_refused_naming_both_devices() {
        let mut devices = Devices::default();
        devices
            .register("COM1", 0, (BusKind::Pio, 0x3f8, 8), uart())
            .unwrap();
        let e = devices
            .register("COM2", 0, (BusKind::Pio, 0x2f8, 8), uart())
            .unwrap_err();
        assert_eq!(
            e,
            RegisterError::Twin {
                id: SERIAL,
                instance: 0,
                first: "COM1",
                second: "COM2"
            }
        );
        let text = e.to_string();
        assert!(
            text.contains("COM1") && text.contains("COM2") && text.contains("instance number"),
            "{text}"
        );
        assert_eq!(devices.save(&mut PartTimer::start()).len(), 1);
        let mut b = [0u8];
        devices.io_in(0x2f8 + SCRATCH, &mut b);
        assert_eq!(b, [0xff], "the twin is on no bus");
        devices
            .register("COM2", 1, (BusKind::Pio, 0x2f8, 8), uart())
            .unwrap();
    }

    /// A device whose id `section_ids` does not list as a device's (a VM part's, or none).
    struct Stray(SectionId);

    impl Device for Stray {
        fn read(&mut self, _: u64, _: &mut [u8]) {}
        fn write(&mut self, _: u64, _: &[u8]) {}
        fn kind(&self) -> SectionKind {
            SectionKind::single(self.0, 1)
        }
        fn save(&self) -> Vec<u8> {
            Vec::new()
        }
        fn restore(&mut self, _: u32, _: &[u8]) -> Result<(), DeviceStateError> {
            Ok(())
        }
    }

    #[test]
    fn a_device_with_an_id_not_listed_as_a_device_s_is_refused() {
        let mut devices = Devices::default();
        for id in [crate::section_ids::LAPIC, SectionId(99)] {
            let stray = Arc::new(Mutex::new(Stray(id)));
            let e = devices
                .register("stray", 0, (BusKind::Pio, 0x80, 1), stray)
                .unwrap_err();
            assert_eq!(e, RegisterError::Unlisted { name: "stray", id });
        }
    }

    #[test]
    fn unknown_addresses_read_as_all_ones() {
        let devices = Devices::default();
        let mut b = [0u8; 4];
        devices.io_in(0x60, &mut b);
        assert_eq!(b, [0xff; 4]);
        devices.mmio_read(0xfee0_0000, &mut b);
        assert_eq!(b, [0xff; 4]);
        devices.io_out(0x60, &[1]);
    }
}
