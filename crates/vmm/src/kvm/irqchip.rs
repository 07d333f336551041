//! KVM's in-kernel interrupt controller (`KVM_CREATE_IRQCHIP`): a PIC pair and an IOAPIC for
//! the VM, a local APIC per vCPU. Devices raise their lines through irqfds; the controller's
//! state migrates as sections: each PIC and the IOAPIC as one (the raw `kvm_irqchip` KVM
//! reports), each local APIC as one (the raw `kvm_lapic_state`, 1 KiB of registers).
//!
//! The PIT (`pit.rs`) is created after it: KVM's PIT raises IRQ 0 through this controller.

#![forbid(unsafe_code)]

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, kvm_irqchip, kvm_lapic_state,
};
use kvm_ioctls::{VcpuFd, VmFd};
use zerocopy::{FromBytes, IntoBytes};

use super::KvmError;
use super::state::{StateError, kvm};
use crate::devices::irq::IrqLine;

/// The VM-wide parts of the controller, each a section instance of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chip {
    PicMaster,
    PicSlave,
    Ioapic,
}

impl Chip {
    pub const ALL: [Chip; 3] = [Chip::PicMaster, Chip::PicSlave, Chip::Ioapic];

    fn id(self) -> u32 {
        match self {
            Chip::PicMaster => KVM_IRQCHIP_PIC_MASTER,
            Chip::PicSlave => KVM_IRQCHIP_PIC_SLAVE,
            Chip::Ioapic => KVM_IRQCHIP_IOAPIC,
        }
    }
}

/// Creates the controller; must come before the first vCPU.
pub fn create(vm: &VmFd) -> Result<(), KvmError> {
    vm.create_irq_chip().map_err(KvmError::Irqchip)
}

/// Lets `line` raise `gsi` (0-15 reach both the PICs and the IOAPIC, KVM's default routing).
pub fn connect(vm: &VmFd, line: &IrqLine, gsi: u32) -> Result<(), KvmError> {
    vm.register_irqfd(line.eventfd(), gsi)
        .map_err(|source| KvmError::Irqfd { gsi, source })
}

/// The master PIC's interrupt request register.
#[cfg(test)]
pub(crate) fn pic_master_irr(vm: &VmFd) -> u8 {
    pic_irr(vm, Chip::PicMaster)
}

/// A PIC's interrupt request register (the slave's bit 0 is IRQ 8, the RTC's), read from its
/// saved bytes (the chip union holds a `kvm_pic_state` for chips 0 and 1).
#[cfg(test)]
pub(crate) fn pic_irr(vm: &VmFd, pic: Chip) -> u8 {
    use std::mem::offset_of;
    let bytes = save_chip(vm, pic).unwrap();
    bytes[offset_of!(kvm_irqchip, chip) + offset_of!(kvm_bindings::kvm_pic_state, irr)]
}

pub fn save_chip(vm: &VmFd, chip: Chip) -> Result<Vec<u8>, StateError> {
    let mut c = kvm_irqchip {
        chip_id: chip.id(),
        ..Default::default()
    };
    vm.get_irqchip(&mut c)
        .map_err(kvm("read the interrupt controller"))?;
    Ok(c.as_bytes().to_vec())
}

pub fn restore_chip(vm: &VmFd, chip: Chip, bytes: &[u8]) -> Result<(), StateError> {
    let c = kvm_irqchip::read_from_bytes(bytes).map_err(|_| {
        StateError::Malformed(format!(
            "{chip:?} state of {} bytes, want {}",
            bytes.len(),
            size_of::<kvm_irqchip>()
        ))
    })?;
    if c.chip_id != chip.id() || c.pad != 0 {
        return Err(StateError::Malformed(format!(
            "{chip:?} state names chip {} (padding {:#x})",
            c.chip_id, c.pad
        )));
    }
    vm.set_irqchip(&c)
        .map_err(kvm("write the interrupt controller"))
}

pub fn save_lapic(vcpu: &VcpuFd) -> Result<Vec<u8>, StateError> {
    Ok(vcpu
        .get_lapic()
        .map_err(kvm("read the local APIC"))?
        .as_bytes()
        .to_vec())
}

pub fn decode_lapic(bytes: &[u8]) -> Result<kvm_lapic_state, StateError> {
    kvm_lapic_state::read_from_bytes(bytes).map_err(|_| {
        StateError::Malformed(format!(
            "local APIC state of {} bytes, want {}",
            bytes.len(),
            size_of::<kvm_lapic_state>()
        ))
    })
}

const _: () = assert!(size_of::<kvm_irqchip>() == 520);
const _: () = assert!(size_of::<kvm_lapic_state>() == 1024);
