//! This VMM's state as migration sections: what saves each, and the order they load in. The
//! engine carries sections without knowing them; this module and the devices' registry are the
//! places that do. Every id, the VM's own and its devices', is declared in `section_ids`, with
//! its table of what each holds.
//!
//! The VM's own parts (vCPUs, clock, interrupt controller, local APICs) are here; devices on
//! the buses are saved and loaded by `Devices`. Every section but one is mandatory both ways: a
//! destination refuses an id or instance it has no part for and a stream that lacks one of its
//! parts. The exceptions are the VM generation ID's (8) and the PIT's (11), which a
//! destination loads a stream without (a source older than the device; `devices::vmgenid` and
//! `devices::pit` say why that is safe); a destination that does not know one refuses it like
//! any unknown id. A snapshot's record of its
//! disk image (10, `snapshot::image`) is not state: a load of a VM with a disk skips it.
//!
//! Each kind has a range of layout versions, the oldest this VMM loads to the one it writes
//! (`SectionKind`); `versions` lists them all, the VM's own and its devices', for the VM's
//! description, so a destination refuses a layout it cannot load before the source pauses.
//! (The test that saves and loads a real VM's sections is `vm::build`'s: it needs a VM built.)

use ferry_migrate::wire::SectionId;
use ferry_migrate::{Section, StatePart};

use crate::devices::{self, DeviceStateError, Devices, SectionKind, SectionNeed};
use crate::kvm::clock;
use crate::kvm::irqchip::{self, Chip};
use crate::kvm::state::{self, StateError};
use crate::part_timer::PartTimer;
use crate::section_ids::{self, IRQCHIP, LAPIC, VCPU, VM_CLOCK};
use crate::vm::shared::Shared;
use crate::vmconfig::SectionVersion;

/// Layout version of the interrupt controller sections this VMM writes, and the oldest it
/// loads: the same, the layout (KVM's own structs) never having changed.
const IRQCHIP_VERSION: u32 = 1;
const IRQCHIP_OLDEST: u32 = IRQCHIP_VERSION;
/// The same for the local APIC's sections.
const LAPIC_VERSION: u32 = 1;
const LAPIC_OLDEST: u32 = LAPIC_VERSION;

/// One of the VM's own sections: the name its errors give it, and its kind.
struct Part {
    name: &'static str,
    kind: SectionKind,
}

const VCPU_PART: Part = Part {
    name: section_ids::name(VCPU),
    kind: SectionKind {
        id: VCPU,
        version: state::VCPU_STATE_VERSION,
        oldest: state::VCPU_STATE_OLDEST,
    },
};
const CLOCK_PART: Part = Part {
    name: section_ids::name(VM_CLOCK),
    kind: SectionKind {
        id: VM_CLOCK,
        version: clock::CLOCK_STATE_VERSION,
        oldest: clock::CLOCK_STATE_OLDEST,
    },
};
const IRQCHIP_PART: Part = Part {
    name: section_ids::name(IRQCHIP),
    kind: SectionKind {
        id: IRQCHIP,
        version: IRQCHIP_VERSION,
        oldest: IRQCHIP_OLDEST,
    },
};
const LAPIC_PART: Part = Part {
    name: section_ids::name(LAPIC),
    kind: SectionKind {
        id: LAPIC,
        version: LAPIC_VERSION,
        oldest: LAPIC_OLDEST,
    },
};
/// The VM's own sections, in id order.
const PARTS: [Part; 4] = [VCPU_PART, CLOCK_PART, IRQCHIP_PART, LAPIC_PART];

/// Every kind of section a VM with `devices` writes, its own then its devices', with the
/// layouts it writes and loads and whether it needs them: the list its description carries.
pub(crate) fn versions(devices: &Devices) -> Vec<SectionVersion> {
    PARTS
        .iter()
        .map(|p| (p.name, p.kind, SectionNeed::Mandatory))
        .chain(devices.kinds())
        .map(|(name, kind, need)| SectionVersion::new(name, kind, need))
        .collect()
}

/// Why the VM's state could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SectionError {
    #[error(transparent)]
    Kvm(#[from] StateError),
    #[error(transparent)]
    Device(#[from] devices::LoadError),
    #[error("the stream has no {what} section (id {}, instance {instance}); the source is not a ferry VM like this one", id.0)]
    Missing {
        what: &'static str,
        id: SectionId,
        instance: u32,
    },
    #[error(
        "{0} instance {1} is unknown to this VMM; use matching ferry versions and VM configurations"
    )]
    Unknown(SectionId, u32),
    #[error(transparent)]
    Version(#[from] DeviceStateError),
    #[error("cannot create the vCPUs to load: {0}")]
    CreateVcpus(Box<crate::error::VmmError>),
}

fn section(part: &Part, instance: u32, data: Vec<u8>) -> Section {
    Section {
        id: part.kind.id,
        instance,
        version: part.kind.version,
        data,
    }
}

fn instance(chip: Chip) -> u32 {
    Chip::ALL.iter().position(|&c| c == chip).unwrap() as u32
}

/// Everything but RAM, taken while the vCPUs are paused, with where the time went.
pub(crate) fn save(shared: &Shared) -> Result<(Vec<Section>, Vec<StatePart>), SectionError> {
    let vm = &shared.kvm.vm;
    let mut timer = PartTimer::start();
    let mut out = Vec::with_capacity(2 * shared.vcpus().len() + 8);
    for (id, vcpu) in shared.vcpus().iter().enumerate() {
        let vcpu = vcpu.lock().unwrap();
        let id = id as u32;
        let vcpu_state = state::save_vcpu(vm, &vcpu, shared.msrs())?;
        let lapic = irqchip::save_lapic(&vcpu)?;
        timer.mark(|| format!("vcpu {id}"), vcpu_state.len() + lapic.len());
        out.push(section(&VCPU_PART, id, vcpu_state));
        out.push(section(&LAPIC_PART, id, lapic));
    }
    let clock = {
        let vcpus: Vec<_> = shared.vcpus().iter().map(|v| v.lock().unwrap()).collect();
        clock::save(vm, &vcpus.iter().map(|v| &**v).collect::<Vec<_>>())?
    };
    timer.mark(|| "vm clock".into(), clock.len());
    out.push(section(&CLOCK_PART, 0, clock));
    for chip in Chip::ALL {
        let data = irqchip::save_chip(vm, chip)?;
        timer.mark(|| format!("irqchip {chip:?}"), data.len());
        out.push(section(&IRQCHIP_PART, instance(chip), data));
    }
    out.extend(shared.devices.save(&mut timer));
    Ok((out, timer.finish()))
}

/// Loads `sections` into a VM whose vCPUs have not run: the clock (and the guest's TSC
/// frequency), the interrupt controller, then each vCPU with its local APIC and its TSC offset
/// (after its MSRs, `kvm::clock`), then the devices; returns where the time went.
pub(crate) fn load(shared: &Shared, sections: &[Section]) -> Result<Vec<StatePart>, SectionError> {
    for s in sections {
        let known = match s.id {
            VCPU | LAPIC => s.instance < u32::from(shared.description.vcpus),
            VM_CLOCK => s.instance == 0,
            IRQCHIP => (s.instance as usize) < Chip::ALL.len(),
            // A snapshot's record of its disk image, checked before the restore made this VM.
            id if crate::snapshot::image::is_record(id) => shared.disk.is_some(),
            id => shared.devices.owns(id),
        };
        if !known {
            return Err(SectionError::Unknown(s.id, s.instance));
        }
    }
    let mut timer = PartTimer::start();
    if shared
        .create_vcpus()
        .map_err(|e| SectionError::CreateVcpus(Box::new(e)))?
    {
        timer.mark(|| "create vCPUs".into(), 0);
    }
    let vm = &shared.kvm.vm;
    let (clock, clock_version) = find_versioned(sections, &CLOCK_PART, 0)?;
    let saved = clock::Saved::decode(clock_version, clock)?;
    let tsc = {
        let vcpus: Vec<_> = shared.vcpus().iter().map(|v| v.lock().unwrap()).collect();
        clock::restore(vm, &vcpus.iter().map(|v| &**v).collect::<Vec<_>>(), &saved)?
    };
    timer.mark(|| "vm clock".into(), clock.len());
    for chip in Chip::ALL {
        let data = find(sections, &IRQCHIP_PART, instance(chip))?;
        irqchip::restore_chip(vm, chip, data)?;
        timer.mark(|| format!("irqchip {chip:?}"), data.len());
    }
    for (id, vcpu) in shared.vcpus().iter().enumerate() {
        let id = id as u32;
        let vcpu_state = find(sections, &VCPU_PART, id)?;
        let lapic_bytes = find(sections, &LAPIC_PART, id)?;
        let lapic = irqchip::decode_lapic(lapic_bytes)?;
        let vcpu = vcpu.lock().unwrap();
        state::restore_vcpu(vm, &vcpu, vcpu_state, &lapic, tsc.msr_advance())?;
        tsc.apply(id as usize, &vcpu)?;
        timer.mark(
            || format!("vcpu {id}"),
            vcpu_state.len() + lapic_bytes.len(),
        );
    }
    shared.devices.load(sections, &mut timer)?;
    // An interrupt the balloon had pending when the source paused is raised again now that
    // the interrupt controller's state is in: raised before, it would have been overwritten.
    if let Some(balloon) = &shared.balloon {
        balloon.lock().unwrap().raise_pending();
    }
    Ok(timer.finish())
}

/// The data of the one section of `part` and `instance`, checked to be of a layout it loads.
fn find<'a>(sections: &'a [Section], part: &Part, instance: u32) -> Result<&'a [u8], SectionError> {
    Ok(find_versioned(sections, part, instance)?.0)
}

/// [`find`], with the layout version the section is in.
fn find_versioned<'a>(
    sections: &'a [Section],
    part: &Part,
    instance: u32,
) -> Result<(&'a [u8], u32), SectionError> {
    let id = part.kind.id;
    let s = sections
        .iter()
        .find(|s| s.id == id && s.instance == instance)
        .ok_or(SectionError::Missing {
            what: part.name,
            id,
            instance,
        })?;
    DeviceStateError::check_version(part.name, s.version, part.kind.loads())?;
    Ok((&s.data, s.version))
}
