//! This VMM's state as migration sections: which ids it uses, what saves each, and the order
//! they load in. The engine carries sections without knowing them; this module is the one
//! place that does.
//!
//! | id | what | instances |
//! | --- | --- | --- |
//! | 1 | a vCPU's registers, FPU, MSRs, events, MP state | vCPU id |
//! | 2 | the VM's kvmclock | 0 |
//! | 3 | a 16550 UART (`devices::serial`) | 0 = COM1, 1 = COM2 |
//! | 4 | the telemetry port (`devices::telemetry_port`) | 0 |
//! | 5 | the in-kernel PICs and IOAPIC | 0 = PIC master, 1 = PIC slave, 2 = IOAPIC |
//! | 6 | a vCPU's local APIC | vCPU id |
//! | 7 | a virtio-mmio device: transport, queues and the device (`devices::virtio`; the balloon) | 0 |
//!
//! Devices on the buses bring their own ids (3, 4 and 7); the VM's own parts are here. Every
//! section is mandatory both ways: a destination refuses an id or instance it has no part for
//! and a stream that lacks one of its parts.

use ferry_migrate::wire::SectionId;
use ferry_migrate::{Section, StatePart};

use crate::devices::{self, DeviceStateError};
use crate::kvm::irqchip::{self, Chip};
use crate::kvm::state::{self, StateError};
use crate::part_timer::PartTimer;
use crate::vm::shared::Shared;

pub const VCPU: SectionId = SectionId(1);
pub const VM_CLOCK: SectionId = SectionId(2);
pub const IRQCHIP: SectionId = SectionId(5);
pub const LAPIC: SectionId = SectionId(6);
/// Layout versions of the VM's own sections.
const IRQCHIP_VERSION: u32 = 1;
const LAPIC_VERSION: u32 = 1;

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

fn section(id: SectionId, instance: u32, version: u32, data: Vec<u8>) -> Section {
    Section {
        id,
        instance,
        version,
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
        out.push(section(VCPU, id, state::VCPU_STATE_VERSION, vcpu_state));
        out.push(section(LAPIC, id, LAPIC_VERSION, lapic));
    }
    let clock = state::save_clock(vm)?;
    timer.mark(|| "vm clock".into(), clock.len());
    out.push(section(VM_CLOCK, 0, state::CLOCK_STATE_VERSION, clock));
    for chip in Chip::ALL {
        let data = irqchip::save_chip(vm, chip)?;
        timer.mark(|| format!("irqchip {chip:?}"), data.len());
        out.push(section(IRQCHIP, instance(chip), IRQCHIP_VERSION, data));
    }
    out.extend(shared.devices.save(&mut timer));
    Ok((out, timer.finish()))
}

/// Loads `sections` into a VM whose vCPUs have not run: the clock, the interrupt controller,
/// then each vCPU with its local APIC, then the devices; returns where the time went.
pub(crate) fn load(shared: &Shared, sections: &[Section]) -> Result<Vec<StatePart>, SectionError> {
    for s in sections {
        let known = match s.id {
            VCPU | LAPIC => s.instance < u32::from(shared.description.vcpus),
            VM_CLOCK => s.instance == 0,
            IRQCHIP => (s.instance as usize) < Chip::ALL.len(),
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
    let clock = find(
        sections,
        VM_CLOCK,
        0,
        "VM clock",
        state::CLOCK_STATE_VERSION,
    )?;
    state::restore_clock(vm, clock)?;
    timer.mark(|| "vm clock".into(), clock.len());
    for chip in Chip::ALL {
        let data = find(
            sections,
            IRQCHIP,
            instance(chip),
            "interrupt controller",
            IRQCHIP_VERSION,
        )?;
        irqchip::restore_chip(vm, chip, data)?;
        timer.mark(|| format!("irqchip {chip:?}"), data.len());
    }
    for (id, vcpu) in shared.vcpus().iter().enumerate() {
        let id = id as u32;
        let vcpu_state = find(sections, VCPU, id, "vCPU", state::VCPU_STATE_VERSION)?;
        let lapic_bytes = find(sections, LAPIC, id, "local APIC", LAPIC_VERSION)?;
        let lapic = irqchip::decode_lapic(lapic_bytes)?;
        state::restore_vcpu(vm, &vcpu.lock().unwrap(), vcpu_state, &lapic)?;
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

/// The data of the one section `id`/`instance`, checked to be of `version`.
fn find<'a>(
    sections: &'a [Section],
    id: SectionId,
    instance: u32,
    what: &'static str,
    version: u32,
) -> Result<&'a [u8], SectionError> {
    let s = sections
        .iter()
        .find(|s| s.id == id && s.instance == instance)
        .ok_or(SectionError::Missing { what, id, instance })?;
    DeviceStateError::check_version(what, s.version, version)?;
    Ok(&s.data)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::devices::serial::SerialOutput;
    use crate::kvm;
    use crate::vm::build::{IncomingVm, Preparation, Vm};
    use crate::vm::config::{GuestKind, VmConfig};

    fn incoming() -> IncomingVm {
        incoming_with(Preparation::Prepared)
    }

    fn incoming_with(preparation: Preparation) -> IncomingVm {
        kvm::require_for_tests();
        let config = VmConfig {
            memory_bytes: crate::memory::MIN_MEMORY,
            vcpus: 1,
            kernel: Arc::from(&[][..]),
            cmdline: String::new(),
            guest: GuestKind::Foreign,
            serial: SerialOutput::Discard,
            balloon: true,
            host_pages: Default::default(),
        };
        Vm::incoming_with(config, preparation).unwrap()
    }

    fn pic_irr(shared: &Shared) -> u8 {
        irqchip::pic_master_irr(&shared.kvm.vm)
    }

    /// COM1's interrupt (GSI 4) reaches KVM's interrupt controller through its irqfd, and the
    /// controller's state, the vCPU with its local APIC and both UARTs move to another VM.
    #[test]
    fn serial_interrupts_reach_the_in_kernel_controller_and_its_state_migrates() {
        const COM1: u16 = ferry_guest_abi::SERIAL_PORT;
        let a = incoming();
        let shared = &a.shared;
        assert_eq!(
            pic_irr(shared) & 1 << 4,
            0,
            "no request before the UART raises it"
        );
        shared.devices.io_out(COM1 + 1, &[0x02]); // IER: transmitter empty
        shared.devices.io_out(COM1, b"x");
        shared.devices.io_out(0x2f8 + 7, &[0x5c]); // COM2's scratch register
        let deadline = Instant::now() + Duration::from_secs(2);
        while pic_irr(shared) & 1 << 4 == 0 {
            assert!(Instant::now() < deadline, "IRQ 4 never reached the PIC");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (saved, parts) = save(shared).unwrap();
        let names: Vec<&str> = parts.iter().map(|p| p.name.as_str()).collect();
        assert!(
            names.contains(&"vcpu 0") && names.contains(&"serial port 1"),
            "every part is named: {names:?}"
        );
        let count = |id| saved.iter().filter(|s| s.id == id).count();
        assert_eq!(
            (
                count(VCPU),
                count(LAPIC),
                count(IRQCHIP),
                count(crate::devices::serial::SECTION)
            ),
            (1, 1, 3, 2)
        );

        let b = incoming();
        let parts = load(&b.shared, &saved).unwrap();
        assert_eq!(parts.len(), names.len(), "the load names what the save did");
        assert_ne!(
            pic_irr(&b.shared) & 1 << 4,
            0,
            "the pending request migrated"
        );
        let mut scratch = [0u8];
        b.shared.devices.io_in(0x2f8 + 7, &mut scratch);
        assert_eq!(scratch, [0x5c], "COM2 kept its own state");

        let c = incoming_with(Preparation::Unprepared);
        assert!(c.shared.vcpus().is_empty(), "no vCPU before the load");
        let parts = load(&c.shared, &saved).unwrap();
        assert_eq!(parts[0].name, "create vCPUs", "{parts:?}");
        assert_eq!(c.shared.vcpus().len(), 1);

        let mut unknown = saved.clone();
        unknown.push(Section {
            id: SectionId(99),
            instance: 0,
            version: 1,
            data: vec![],
        });
        let err = load(&incoming().shared, &unknown).unwrap_err().to_string();
        assert!(err.contains("section 99 instance 0 is unknown"), "{err}");
        let without_lapic: Vec<Section> = saved.iter().filter(|s| s.id != LAPIC).cloned().collect();
        let err = load(&incoming().shared, &without_lapic)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no local APIC section"), "{err}");
    }
}
