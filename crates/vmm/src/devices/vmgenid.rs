//! The VM generation ID device (`ferry_guest_abi::vmgenid`): 16 read-only bytes on the ports
//! 0x0ff0..0x1000, drawn at random when the VM is built, kept across a live migration and a
//! local handover (they travel in its section), and drawn again by a restore once its state is
//! loaded and before the guest runs (`IncomingVm::identity`, `Identity::Renewed`, which
//! `snapshot::restore` sets), so that every clone of a
//! snapshot differs from the VM it was taken from and from every other clone. The guest's own
//! reports of the ID (`Kind::VmGeneration`) are recorded by the telemetry; this device carries
//! the last of them across a migration with the ID, since the guest reports only a change and
//! a destination would otherwise show none.
//!
//! The ID comes from the kernel's random source (getrandom(2), through the `getrandom` crate
//! that tempfile already brought into the tree), and is drawn again in the one case of 2^128
//! where it comes out all-ones, what a guest reads with no device.
//!
//! # Its section, and why it is optional on load
//!
//! Section 8, layout 1, [`STATE_SIZE`] bytes: the ID; then 1 if the guest has reported the ID
//! it read (else 0 and zeros to the end), that ID, and the changes it has seen (u64,
//! little-endian).
//!
//! Every other section is mandatory both ways, and a newer ferry must still take a guest from
//! an older one, which writes no section 8. Of the two ways to carry the ID past that rule this
//! is the smaller: the other, a third layout of the telemetry port's section (loading 2..=3),
//! would need a device on the bus without a section of its own (which the registry has no
//! notion of), tie this device's state to another's, and move the layouts the version-range
//! tests stand on (`telemetry_port::Layout::Next`). So this section is
//! [`SectionNeed::Optional`], the one rule added, kept where it applies (`Devices::load`, and
//! `VmDescription::accepts`, which does not ask a source for an optional section):
//!
//! - An older source (no section 8) to a newer destination: the description does not ask for
//!   it and the load does without it; the destination keeps the ID it drew when it was built.
//!   The guest comes from a ferry without the device: if it ever looked, it read all-ones, and
//!   to it a device has appeared, which a guest that watches the ID takes as a clone (a
//!   harmless re-seed).
//! - A newer source to an older destination: the older ferry does not know id 8 and refuses
//!   the guest at the hello, before the pause, as it would any newer layout; the rule that a
//!   newer ferry takes an older one's guest and never the reverse is unchanged.
//! - Between two ferries that have it, the ID moves with the guest. It loads after the
//!   telemetry port's section (devices load in registration order), whose load replaces the
//!   telemetry this device then writes the guest's last report into.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use ferry_guest_abi::vmgenid::{GenerationId, SIZE};

use super::device::{Device, DeviceStateError, SectionKind, SectionNeed};
use super::telemetry::GuestTelemetry;
use crate::section_ids::{self, VM_GENERATION_ID};

/// Its layout version, the one this ferry writes and the oldest it loads: the first.
pub const VERSION: u32 = 1;
/// Ports the device answers: the ID's bytes, one port each.
pub const LEN: u64 = SIZE as u64;
/// The state's bytes: the ID, the guest-reported flag, the ID it reported and its changes.
pub const STATE_SIZE: usize = SIZE + 1 + SIZE + 8;
const NAME: &str = section_ids::name(VM_GENERATION_ID);

/// Why no generation ID could be drawn.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot draw a VM generation ID from the kernel's random source: {0}; ferry needs getrandom(2) (Linux 3.17 or later, not denied by a seccomp filter)"
)]
pub struct EntropyError(#[source] getrandom::Error);

/// A new ID, random and never all-ones.
fn draw() -> Result<GenerationId, EntropyError> {
    loop {
        let mut id = GenerationId([0; SIZE]);
        getrandom::fill(&mut id.0).map_err(EntropyError)?;
        if id != GenerationId::ABSENT {
            return Ok(id);
        }
    }
}

#[derive(Debug)]
pub struct VmGenId {
    id: GenerationId,
    /// Where the guest's reports of the ID are recorded, which the state carries.
    telemetry: Arc<Mutex<GuestTelemetry>>,
}

impl VmGenId {
    /// A device with an ID of its own, drawn now.
    pub fn new(telemetry: Arc<Mutex<GuestTelemetry>>) -> Result<VmGenId, EntropyError> {
        Ok(VmGenId {
            id: draw()?,
            telemetry,
        })
    }

    /// The ID the guest reads now.
    pub fn id(&self) -> GenerationId {
        self.id
    }

    /// Draws a new ID: the VM is a clone. The guest sees it at its next look.
    pub fn renew(&mut self) -> Result<(), EntropyError> {
        self.id = draw()?;
        Ok(())
    }
}

impl Device for VmGenId {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.id.read(offset, data);
    }

    /// Read-only: a write is ignored, as a ROM ignores one.
    fn write(&mut self, _: u64, _: &[u8]) {}

    fn kind(&self) -> SectionKind {
        SectionKind::single(VM_GENERATION_ID, VERSION)
    }

    /// Optional: see the module doc.
    fn need(&self) -> SectionNeed {
        SectionNeed::Optional
    }

    fn save(&self) -> Vec<u8> {
        let t = self.telemetry.lock().unwrap();
        let mut state = Vec::with_capacity(STATE_SIZE);
        state.extend_from_slice(&self.id.0);
        match (t.generation_id, t.generation_changes) {
            (Some(seen), Some(changes)) => {
                state.push(1);
                state.extend_from_slice(&seen.0);
                state.extend_from_slice(&changes.to_le_bytes());
            }
            _ => state.resize(STATE_SIZE, 0),
        }
        state
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version(NAME, version, self.kind().loads())?;
        let malformed = |reason: String| DeviceStateError::Malformed {
            device: NAME,
            reason,
        };
        let data: &[u8; STATE_SIZE] = data
            .try_into()
            .map_err(|_| malformed(format!("{} bytes, not {STATE_SIZE}", data.len())))?;
        let id = GenerationId(data[..SIZE].try_into().unwrap());
        if id == GenerationId::ABSENT {
            return Err(malformed("an all-ones ID, which no VM shows".into()));
        }
        let rest = &data[SIZE + 1..];
        let seen = match data[SIZE] {
            0 if rest.iter().all(|&b| b == 0) => None,
            1 => Some((
                GenerationId(rest[..SIZE].try_into().unwrap()),
                u64::from_le_bytes(rest[SIZE..].try_into().unwrap()),
            )),
            flag => {
                return Err(malformed(format!(
                    "guest-report flag {flag} (0 or 1, and zeros after a 0)"
                )));
            }
        };
        self.id = id;
        let mut t = self.telemetry.lock().unwrap();
        t.generation_id = seen.map(|(id, _)| id);
        t.generation_changes = seen.map(|(_, changes)| changes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use ferry_guest_abi::report::{self, Kind, Report};
    use ferry_migrate::Section;

    use super::*;
    use crate::devices::irq::IrqLine;
    use crate::devices::serial::{SerialDevice, SerialOutput};
    use crate::devices::{BusKind, Devices, LoadError};
    use crate::part_timer::PartTimer;

    fn device() -> VmGenId {
        VmGenId::new(Default::default()).unwrap()
    }

    /// The guest's report that it read `id`, having seen `changes` changes.
    fn reported(id: GenerationId, changes: u64) -> Report {
        let mut detail = [0; report::DETAIL_WORDS];
        [
            detail[report::vm_generation::ID_LOW],
            detail[report::vm_generation::ID_HIGH],
        ] = id.to_detail();
        detail[report::vm_generation::CHANGES] = changes;
        Report {
            kind: Kind::VmGeneration as u16,
            detail,
            ..Report::default()
        }
    }

    #[test]
    fn the_ports_show_the_id_and_a_renewal_changes_it() {
        let mut d = device();
        let first = d.id();
        assert_ne!(first, GenerationId::ABSENT);
        let words: [u32; 4] = std::array::from_fn(|k| {
            let mut w = [0; 4];
            d.read(4 * k as u64, &mut w);
            u32::from_le_bytes(w)
        });
        assert_eq!(GenerationId::from_words(words), first);
        d.write(0, &[0; 4]);
        assert_eq!(d.id(), first, "read-only");
        d.renew().unwrap();
        assert_ne!(d.id(), first);
        assert_ne!(device().id(), device().id(), "two VMs, two IDs");
    }

    #[test]
    fn the_telemetry_records_the_guests_report_and_the_state_carries_it() {
        let source = device();
        assert!(
            source.save()[SIZE..].iter().all(|&b| b == 0),
            "no report yet"
        );
        source
            .telemetry
            .lock()
            .unwrap()
            .record(&reported(source.id(), 3), 10);
        let t = source.telemetry.lock().unwrap().clone();
        assert_eq!(
            (t.generation_id, t.generation_changes),
            (Some(source.id()), Some(3))
        );
        assert_eq!((t.heartbeats, t.pages_written), (0, 0), "no counter moved");
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["generation_id"], source.id().to_string());
        assert_eq!(json["generation_changes"], 3);

        let saved = source.save();
        assert_eq!(saved.len(), STATE_SIZE);
        let mut destination = device();
        destination.restore(VERSION, &saved).unwrap();
        assert_eq!(destination.id(), source.id(), "a migration keeps the ID");
        let t = destination.telemetry.lock().unwrap().clone();
        assert_eq!(
            (t.generation_id, t.generation_changes),
            (Some(source.id()), Some(3))
        );
    }

    #[test]
    fn a_malformed_state_is_refused_and_changes_nothing() {
        let mut d = device();
        let id = d.id();
        let good = device().save();
        let mut cases = vec![good[..STATE_SIZE - 1].to_vec(), [&good[..], &[0]].concat()];
        let mut flag = good.clone();
        flag[SIZE] = 2;
        cases.push(flag);
        let mut stray = good.clone();
        stray[STATE_SIZE - 1] = 1;
        cases.push(stray);
        let mut absent = good.clone();
        absent[..SIZE].fill(0xff);
        cases.push(absent);
        for bad in cases {
            assert!(matches!(
                d.restore(VERSION, &bad),
                Err(DeviceStateError::Malformed { .. })
            ));
        }
        assert!(matches!(
            d.restore(VERSION + 1, &good),
            Err(DeviceStateError::Version { .. })
        ));
        assert_eq!(d.id(), id);
    }

    /// A VM of a UART and this device, with the device's id.
    fn vm() -> (Devices, Arc<Mutex<VmGenId>>) {
        let mut devices = Devices::default();
        let uart = SerialDevice::new(&SerialOutput::Discard, IrqLine::unconnected().unwrap());
        let at = (BusKind::Pio, 0x3f8, 8);
        devices
            .register("uart", 0, at, Arc::new(Mutex::new(uart.unwrap())))
            .unwrap();
        let genid = Arc::new(Mutex::new(device()));
        let at = (BusKind::Pio, u64::from(ferry_guest_abi::vmgenid::PORT), LEN);
        devices.register(NAME, 0, at, genid.clone()).unwrap();
        (devices, genid)
    }

    /// Issue 48: a newer ferry takes a guest from an older one, whose stream has no section 8;
    /// the destination keeps its own ID. The UART's section stays mandatory.
    #[test]
    fn a_stream_without_the_section_loads_and_the_destination_keeps_its_id() {
        let (source, source_id) = vm();
        let all = source.save(&mut PartTimer::start());
        let older: Vec<Section> = all
            .iter()
            .filter(|s| s.id != VM_GENERATION_ID)
            .cloned()
            .collect();
        let (destination, own) = vm();
        let before = own.lock().unwrap().id();
        destination.load(&older, &mut PartTimer::start()).unwrap();
        assert_eq!(own.lock().unwrap().id(), before);
        destination.load(&all, &mut PartTimer::start()).unwrap();
        assert_eq!(own.lock().unwrap().id(), source_id.lock().unwrap().id());
        let no_uart: Vec<Section> = all
            .iter()
            .filter(|s| s.id == VM_GENERATION_ID)
            .cloned()
            .collect();
        assert!(matches!(
            destination.load(&no_uart, &mut PartTimer::start()),
            Err(LoadError::Missing { name: "uart", .. })
        ));
        let kinds = destination.kinds();
        assert_eq!(kinds[1].2, SectionNeed::Optional, "{kinds:?}");
    }
}
