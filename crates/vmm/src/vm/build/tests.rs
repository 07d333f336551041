//! A VM built on real KVM: its interrupts and device state through a migration, the layouts its description announces, the generation ID section.

use std::time::Duration;

use ferry_migrate::Section;
use ferry_migrate::wire::SectionId;

use super::*;
use crate::section_ids::{IRQCHIP, LAPIC, SERIAL, TELEMETRY_PORT, VCPU, VM_GENERATION_ID};
use crate::sections::{load, save};

fn incoming() -> IncomingVm {
    incoming_with(Preparation::Prepared, false)
}

fn incoming_with(preparation: Preparation, next_layout: bool) -> IncomingVm {
    kvm::require_for_tests();
    let config = VmConfig {
        memory_bytes: crate::memory::MIN_MEMORY,
        vcpus: 1,
        kernel: Arc::from(&[][..]),
        cmdline: String::new(),
        guest: GuestKind::Foreign,
        serial: SerialOutput::Discard,
        balloon: true,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout,
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
        (count(VCPU), count(LAPIC), count(IRQCHIP), count(SERIAL)),
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

    let c = incoming_with(Preparation::Unprepared, false);
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

/// The description lists exactly the kinds the VM saves, at the versions it saves them
/// in; a VM of the next telemetry layout takes today's sections, and today's refuses its
/// description at the hello as its state at the load.
#[test]
fn the_description_announces_the_layouts_saved_and_a_newer_layout_goes_one_way() {
    let today = incoming();
    let next = incoming_with(Preparation::Prepared, true);
    for vm in [&today, &next] {
        let (saved, _) = save(&vm.shared).unwrap();
        let listed = &vm.shared.description.sections;
        for s in &saved {
            let l = listed.iter().find(|l| l.id == s.id.0);
            assert_eq!(l.map(|l| l.version), Some(s.version), "{s:?} in {listed:?}");
        }
        assert!(
            listed.iter().all(|l| saved.iter().any(|s| s.id.0 == l.id)),
            "{listed:?}"
        );
    }
    let telemetry = |vm: &IncomingVm| {
        let id = TELEMETRY_PORT.0;
        let s = vm.shared.description.sections.iter().find(|s| s.id == id);
        s.map(|s| (s.name.clone(), s.oldest, s.version)).unwrap()
    };
    let name = String::from("telemetry port");
    let (oldest, current, newer) = (
        telemetry_port::OLDEST,
        telemetry_port::VERSION,
        telemetry_port::NEXT_VERSION,
    );
    assert_eq!(telemetry(&today), (name.clone(), oldest, current));
    assert_eq!(telemetry(&next), (name, oldest, newer));

    // Older to newer: accepted at the hello and loaded.
    let to_next = incoming_with(Preparation::Prepared, true);
    let described = today.shared.description.encode();
    assert_eq!(to_next.shared.description.accepts(&described), Ok(()));
    load(&to_next.shared, &save(&today.shared).unwrap().0).unwrap();
    // Newer to older: refused at the hello, and by the load were it to get there.
    let to_today = incoming();
    let e = to_today
        .shared
        .description
        .accepts(&next.shared.description.encode())
        .unwrap_err();
    let want = format!(
        "telemetry port state version {newer} is outside the versions {oldest} to {current}"
    );
    assert!(e.contains(&want), "{e}");
    let e = load(&to_today.shared, &save(&next.shared).unwrap().0)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&want), "{e}");
}

/// Issue 48: a source older than the VM generation ID (no section 8 in its stream nor in
/// its description) is taken, and the destination keeps its own ID; a source that has the
/// section hands its ID over.
#[test]
fn a_source_without_the_generation_id_section_is_taken_and_one_with_it_hands_it_over() {
    let source = incoming();
    let (saved, _) = save(&source.shared).unwrap();
    let older: Vec<Section> = saved
        .iter()
        .filter(|s| s.id != VM_GENERATION_ID)
        .cloned()
        .collect();
    let mut described = source.shared.description.clone();
    described.sections.retain(|s| s.id != VM_GENERATION_ID.0);
    let id = |vm: &IncomingVm| vm.shared.generation.lock().unwrap().id();
    let destination = incoming();
    let own = id(&destination);
    assert_ne!(own, id(&source), "each VM draws its own");
    let accepts = destination.shared.description.accepts(&described.encode());
    assert_eq!(accepts, Ok(()));
    load(&destination.shared, &older).unwrap();
    assert_eq!(id(&destination), own);
    load(&destination.shared, &saved).unwrap();
    assert_eq!(id(&destination), id(&source));
}
