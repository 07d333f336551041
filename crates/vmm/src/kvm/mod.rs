//! Everything that talks to KVM. No other module of the VMM imports `kvm-ioctls`.
//!
//! - `mod.rs`: open `/dev/kvm`, create the VM, register guest RAM as memory slots and keep
//!   the [`SlotTable`] that says which slot maps which guest addresses.
//! - `vcpu.rs`: configure a vCPU for PVH entry and run it, turning exits into device calls.
//! - `kick.rs`: get a vCPU thread out of `KVM_RUN` without racing it.
//! - `irqchip.rs`: the in-kernel interrupt controller, its irqfds and its state.
//! - `state.rs`: a vCPU's and the VM clock's state as bytes; `dirty.rs`: the dirty log.
//!
//! Invariant: a slot is found by guest address in the table built where the slots were
//! registered, never by a position in some other list (RAM regions, the engine's sorted
//! regions) that would have to stay numbered alike.

pub mod dirty;
pub mod irqchip;
pub mod kick;
pub mod state;
pub mod vcpu;

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VmFd};

use crate::memory::GuestRam;

/// Why KVM could not be set up, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error(
        "cannot open /dev/kvm: permission denied; run ferry as root or add your user to the kvm group (sudo usermod -aG kvm $USER, then log in again)"
    )]
    PermissionDenied,
    #[error(
        "cannot open /dev/kvm: it does not exist; enable virtualisation in the firmware and load the kvm module (modprobe kvm_intel or kvm_amd)"
    )]
    NotPresent,
    #[error("cannot open /dev/kvm: {0}")]
    Open(vmm_sys_util::errno::Error),
    #[error("KVM API version {0} is not the stable version 12 ferry needs")]
    ApiVersion(i32),
    #[error("cannot create a KVM VM: {0}")]
    CreateVm(vmm_sys_util::errno::Error),
    #[error("cannot register guest RAM at {gpa:#x} ({size} bytes) with KVM: {source}")]
    MemorySlot {
        gpa: u64,
        size: u64,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("cannot set up vCPU {id}: {what}: {source}")]
    Vcpu {
        id: u8,
        what: &'static str,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    #[error("cannot create the in-kernel interrupt controller: {0}")]
    Irqchip(vmm_sys_util::errno::Error),
    #[error("cannot connect an interrupt line to GSI {gsi}: {source}")]
    Irqfd {
        gsi: u32,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
}

/// Opens `/dev/kvm`, mapping the common failures to advice.
pub fn open() -> Result<Kvm, KvmError> {
    let kvm = Kvm::new().map_err(|e| match e.errno() {
        libc::EACCES | libc::EPERM => KvmError::PermissionDenied,
        libc::ENOENT | libc::ENXIO | libc::ENODEV => KvmError::NotPresent,
        _ => KvmError::Open(e),
    })?;
    match kvm.get_api_version() {
        12 => Ok(kvm),
        v => Err(KvmError::ApiVersion(v)),
    }
}

/// For test suites that boot real VMs: panics, loudly and with the fix, when `/dev/kvm` cannot
/// be opened. Every machine of this project has KVM, so a test must fail rather than skip.
pub fn require_for_tests() {
    if let Err(e) = open() {
        panic!("\n\n*** THIS TEST NEEDS /dev/kvm AND CANNOT USE IT ***\n*** {e} ***\n\n");
    }
}

/// One KVM memory slot: its number, the guest range it maps and the mapping behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySlot {
    pub slot: u32,
    pub gpa: u64,
    pub size: u64,
    /// Host virtual address of the mapping, as registered.
    pub host_addr: u64,
}

impl MemorySlot {
    /// Guest pages in the slot.
    pub fn pages(&self) -> u64 {
        self.size / ferry_guest_abi::PAGE_SIZE
    }

    /// The slot's registration with `flags`.
    fn region(&self, flags: u32) -> kvm_userspace_memory_region {
        kvm_userspace_memory_region {
            slot: self.slot,
            flags,
            guest_phys_addr: self.gpa,
            memory_size: self.size,
            userspace_addr: self.host_addr,
        }
    }
}

/// Why a guest range has no one memory slot.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlotError {
    #[error("guest address {gpa:#x} is in no KVM memory slot (not RAM)")]
    NotRam { gpa: u64 },
    #[error("guest address {gpa:#x} is not page aligned")]
    Unaligned { gpa: u64 },
    #[error("{pages} pages at {gpa:#x} run past the end of KVM memory slot {slot} ({slot_end:#x})")]
    PastSlotEnd {
        gpa: u64,
        pages: u64,
        slot: u32,
        slot_end: u64,
    },
}

/// The VM's memory slots, found by guest address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotTable {
    slots: Vec<MemorySlot>,
}

impl SlotTable {
    /// One slot per RAM region, numbered in the order given.
    pub fn for_regions(regions: &[crate::memory::RamRegion]) -> SlotTable {
        SlotTable {
            slots: regions
                .iter()
                .enumerate()
                .map(|(i, r)| MemorySlot {
                    slot: i as u32,
                    gpa: r.gpa,
                    size: r.size,
                    host_addr: r.host_addr,
                })
                .collect(),
        }
    }

    pub fn slots(&self) -> &[MemorySlot] {
        &self.slots
    }

    /// The slot holding the `pages` pages from `gpa` (page aligned), and the first page's
    /// index within it. A range that leaves its slot is an error, never cut short.
    pub fn lookup(&self, gpa: u64, pages: u64) -> Result<(&MemorySlot, u64), SlotError> {
        let page = ferry_guest_abi::PAGE_SIZE;
        if !gpa.is_multiple_of(page) {
            return Err(SlotError::Unaligned { gpa });
        }
        let s = self
            .slots
            .iter()
            .find(|s| gpa >= s.gpa && gpa - s.gpa < s.size)
            .ok_or(SlotError::NotRam { gpa })?;
        let first = (gpa - s.gpa) / page;
        if pages > s.pages() - first {
            return Err(SlotError::PastSlotEnd {
                gpa,
                pages,
                slot: s.slot,
                slot_end: s.gpa + s.size,
            });
        }
        Ok((s, first))
    }
}

/// A KVM VM with guest RAM registered, one memory slot per RAM region.
#[derive(Debug)]
pub struct KvmVm {
    pub kvm: Kvm,
    pub vm: VmFd,
    /// The slots registered in [`KvmVm::new`]; the dirty log finds them here by address.
    slots: SlotTable,
}

impl KvmVm {
    pub fn new(kvm: Kvm, ram: &GuestRam) -> Result<KvmVm, KvmError> {
        let vm = kvm.create_vm().map_err(KvmError::CreateVm)?;
        let slots = SlotTable::for_regions(ram.regions());
        for s in slots.slots() {
            // SAFETY: the slot describes a live mapping owned by `ram`, which the VM's owner
            // keeps alive for as long as the VM (see `Vm`); slots do not overlap (one per RAM
            // region).
            unsafe { vm.set_user_memory_region(s.region(0)) }.map_err(|source| {
                KvmError::MemorySlot {
                    gpa: s.gpa,
                    size: s.size,
                    source,
                }
            })?;
        }
        Ok(KvmVm { kvm, vm, slots })
    }

    pub fn slots(&self) -> &SlotTable {
        &self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RamRegion;

    const PAGE: u64 = ferry_guest_abi::PAGE_SIZE;
    const GIB: u64 = 1 << 30;

    /// Slots numbered against address order: the low slot is number 1.
    fn table() -> SlotTable {
        let region = |gpa, size| RamRegion {
            gpa,
            size,
            file_offset: 0,
            host_addr: 0,
        };
        SlotTable::for_regions(&[region(4 * GIB, GIB), region(0, 3 * GIB)])
    }

    #[test]
    fn a_slot_is_found_by_guest_address() {
        let t = table();
        let (s, first) = t.lookup(4 * GIB + 5 * PAGE, 10).unwrap();
        assert_eq!((s.slot, s.gpa, first), (0, 4 * GIB, 5));
        let (s, first) = t.lookup(PAGE, 3).unwrap();
        assert_eq!((s.slot, s.gpa, first), (1, 0, 1));
        let (s, first) = t.lookup(3 * GIB - PAGE, 1).unwrap();
        assert_eq!((s.slot, first), (1, 3 * GIB / PAGE - 1), "the last page");
        let (s, first) = t.lookup(4 * GIB, GIB / PAGE).unwrap();
        assert_eq!((s.slot, first), (0, 0), "a whole slot");
    }

    #[test]
    fn a_gpa_in_a_hole_is_not_ram() {
        let t = table();
        assert_eq!(
            t.lookup(3 * GIB, 1),
            Err(SlotError::NotRam { gpa: 3 * GIB }),
            "the MMIO hole"
        );
        assert_eq!(
            t.lookup(5 * GIB, 1),
            Err(SlotError::NotRam { gpa: 5 * GIB }),
            "above the last slot"
        );
        assert_eq!(
            t.lookup(PAGE + 1, 1),
            Err(SlotError::Unaligned { gpa: PAGE + 1 })
        );
    }

    #[test]
    fn a_range_crossing_a_slot_end_is_an_error() {
        let t = table();
        assert_eq!(
            t.lookup(3 * GIB - PAGE, 2),
            Err(SlotError::PastSlotEnd {
                gpa: 3 * GIB - PAGE,
                pages: 2,
                slot: 1,
                slot_end: 3 * GIB
            })
        );
        assert!(matches!(
            t.lookup(4 * GIB, GIB / PAGE + 1),
            Err(SlotError::PastSlotEnd { slot: 0, .. })
        ));
        assert!(
            t.lookup(0, u64::MAX).is_err(),
            "no overflow on a huge count"
        );
    }
}
