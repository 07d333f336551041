//! Every section id this VMM uses, each declared once here with its name and whose it is: the
//! VM's own parts (`sections.rs` saves and loads them) or a device's (`devices::Devices`
//! registers it). No other code names an id by its number (a test's deliberately unknown id
//! aside).
//!
//! | id | what | instances |
//! | --- | --- | --- |
//! | 1 | a vCPU's registers, FPU, MSRs, events, MP state | vCPU id |
//! | 2 | the VM's clocks: kvmclock, the host's wall clock and TSC with it, the guest TSC's kHz, each vCPU's TSC offset (`kvm::clock`) | 0 |
//! | 3 | a 16550 UART (`devices::serial`) | 0 = COM1, 1 = COM2 |
//! | 4 | the telemetry port (`devices::telemetry_port`) | 0 |
//! | 5 | the in-kernel PICs and IOAPIC | 0 = PIC master, 1 = PIC slave, 2 = IOAPIC |
//! | 6 | a vCPU's local APIC | vCPU id |
//! | 7 | a virtio-mmio device: transport, queues and the device (`devices::virtio`; the balloon) | 0 |
//! | 8 | the VM generation ID (`devices::vmgenid`), optional on load | 0 |
//! | 9 | a copied disk's blocks (`disk_copy::chunk`): iterative state, chunks sent while the guest runs, never a section of the pause | the disk's virtio-mmio instance |
//! | 10 | a snapshot's record of its disk image (`snapshot::image`): written only into a snapshot file, checked before a restore, skipped by the state load | the disk's virtio-mmio instance |
//! | 11 | KVM's in-kernel PIT and port 0x61 (`devices::pit`), optional on load | 0 |
//! | 12 | the RTC and its CMOS (`devices::rtc`), optional on load | 0 |
//!
//! Invariant: the ids of [`ALL`] are distinct and none is 0 (the wire's invalid id), checked
//! when this file compiles; `Devices::register` refuses a device whose id is not listed here as
//! a device's, and a second device of one id and instance. An id is never reused for another
//! state: a destination reads a section by its id, so a new kind of state takes a new number.

#![forbid(unsafe_code)]

use ferry_migrate::wire::SectionId;

pub const VCPU: SectionId = SectionId(1);
pub const VM_CLOCK: SectionId = SectionId(2);
pub const SERIAL: SectionId = SectionId(3);
pub const TELEMETRY_PORT: SectionId = SectionId(4);
pub const IRQCHIP: SectionId = SectionId(5);
pub const LAPIC: SectionId = SectionId(6);
pub const VIRTIO_MMIO: SectionId = SectionId(7);
pub const VM_GENERATION_ID: SectionId = SectionId(8);
pub const DISK_BLOCKS: SectionId = SectionId(9);
pub const DISK_IMAGE: SectionId = SectionId(10);
pub const PIT: SectionId = SectionId(11);
pub const RTC: SectionId = SectionId(12);

/// Who saves and loads a section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The VM itself (`sections.rs`): vCPUs, the clock, the interrupt controller.
    Vm,
    /// A device on a bus, registered in `Devices`.
    Device,
    /// Iterative state: chunks the source sends while the guest runs (`disk_copy`).
    Chunks,
    /// A snapshot's own record (`snapshot::image`), never sent by a migration, never loaded.
    Snapshot,
}

/// One id of this VMM: the name its sections and their errors go by, and whose it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listed {
    pub id: SectionId,
    pub name: &'static str,
    pub owner: Owner,
}

const fn listed(id: SectionId, name: &'static str, owner: Owner) -> Listed {
    Listed { id, name, owner }
}

/// Every id of this VMM, in id order.
pub const ALL: [Listed; 12] = [
    listed(VCPU, "vCPU", Owner::Vm),
    listed(VM_CLOCK, "VM clock", Owner::Vm),
    listed(SERIAL, "serial port", Owner::Device),
    listed(TELEMETRY_PORT, "telemetry port", Owner::Device),
    listed(IRQCHIP, "interrupt controller", Owner::Vm),
    listed(LAPIC, "local APIC", Owner::Vm),
    listed(VIRTIO_MMIO, "virtio-mmio device", Owner::Device),
    listed(VM_GENERATION_ID, "VM generation ID", Owner::Device),
    listed(DISK_BLOCKS, "disk blocks", Owner::Chunks),
    listed(DISK_IMAGE, "disk image check", Owner::Snapshot),
    listed(PIT, "PIT", Owner::Device),
    listed(RTC, "RTC", Owner::Device),
];

/// The first id that `table` lists twice or that is 0, if any: the check [`ALL`] passes at
/// compile time (a `const fn`, so it can run there).
pub const fn first_bad(table: &[Listed]) -> Option<SectionId> {
    let mut i = 0;
    while i < table.len() {
        if table[i].id.0 == 0 {
            return Some(table[i].id);
        }
        let mut j = i + 1;
        while j < table.len() {
            if table[i].id.0 == table[j].id.0 {
                return Some(table[i].id);
            }
            j += 1;
        }
        i += 1;
    }
    None
}

const _: () = assert!(
    first_bad(&ALL).is_none(),
    "section_ids::ALL lists an id twice, or 0: give the new state a number of its own"
);

/// The entry of `id`, when this VMM uses it.
pub fn find(id: SectionId) -> Option<Listed> {
    ALL.iter().copied().find(|l| l.id == id)
}

/// The name of `id`, one of [`ALL`]'s (a compile-time error for any other id when used in a
/// constant).
pub const fn name(id: SectionId) -> &'static str {
    let mut i = 0;
    while i < ALL.len() {
        if ALL[i].id.0 == id.0 {
            return ALL[i].name;
        }
        i += 1;
    }
    panic!("a section id not listed in section_ids::ALL")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ids_are_distinct_nonzero_and_in_order() {
        assert_eq!(first_bad(&ALL), None);
        assert!(ALL.windows(2).all(|w| w[0].id < w[1].id), "{ALL:?}");
        let names: std::collections::HashSet<_> = ALL.iter().map(|l| l.name).collect();
        assert_eq!(names.len(), ALL.len(), "one name per id");
    }

    #[test]
    fn a_table_with_twins_or_a_zero_is_caught() {
        let twin = [ALL[0], ALL[2], listed(VCPU, "another vCPU", Owner::Device)];
        assert_eq!(first_bad(&twin), Some(VCPU));
        let zero = [ALL[0], listed(SectionId(0), "nothing", Owner::Vm)];
        assert_eq!(first_bad(&zero), Some(SectionId(0)));
    }

    #[test]
    fn names_and_owners_are_found_by_id() {
        assert_eq!(name(LAPIC), "local APIC");
        assert_eq!(find(SERIAL).map(|l| l.owner), Some(Owner::Device));
        assert_eq!(find(IRQCHIP).map(|l| l.owner), Some(Owner::Vm));
        assert_eq!(find(SectionId(99)), None);
    }
}
