//! Everything that talks to KVM. No other module of the VMM imports `kvm-ioctls`.
//!
//! - `mod.rs`: open `/dev/kvm`, create the VM, register guest RAM as memory slots of a 64th
//!   of RAM, between [`MIN_SLOT_BYTES`] and [`SLOT_BYTES`] (more when KVM has too few slots),
//!   and keep the [`SlotTable`] that says which slot maps which guest addresses.
//! - `vcpu.rs`: configure a vCPU for PVH entry and run it, turning exits into device calls.
//! - `kick.rs`: get a vCPU thread out of `KVM_RUN` without racing it.
//! - `irqchip.rs`: the in-kernel interrupt controller, its irqfds and its state.
//! - `pit.rs`: the in-kernel PIT, its channel 2 as port 0x61 reaches it, and its state.
//! - `state.rs`: a vCPU's state as bytes; `clock.rs`: the VM's kvmclock and the vCPUs' TSCs
//!   across a move, over `tsc.rs` (the TSC offset, frequency and readings); `dirty.rs`: the
//!   dirty log, over `log_state.rs`, what it knows of each slot (logging, pages not yet armed);
//!   `ring.rs`: the dirty ring, which the log reads instead of the slots' bitmaps when enabled,
//!   over `rings.rs`, the mapped rings themselves.
//! - `host.rs`: what the host's KVM offers guests (the guest physical address width).
//!
//! Invariant: a slot is found by guest address in the table built where the slots were
//! registered, never by a position in some other list (RAM regions, the engine's sorted
//! regions) that would have to stay numbered alike.

pub mod clock;
pub mod dirty;
pub mod host;
pub mod irqchip;
pub mod kick;
pub mod log_state;
pub mod pit;
pub mod ring;
pub mod rings;
pub mod state;
pub mod tsc;
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
    #[error(
        "KVM ran out of kernel memory registering guest RAM at {gpa:#x} ({registered} of {total} bytes done): it keeps bookkeeping per guest page for every memory slot (on a host with shadow paging, 8 bytes per 4 KiB page, 1/512 of guest RAM); lower --memory or free host memory"
    )]
    OutOfMemory {
        gpa: u64,
        registered: u64,
        total: u64,
    },
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
    #[error("cannot create the in-kernel PIT: {0}")]
    Pit(vmm_sys_util::errno::Error),
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

/// Most guest RAM per memory slot: 1 GiB. Dirty logging is turned on, fetched and turned off
/// a slot at a time, and only for slots holding populated memory (see `dirty.rs`), so the
/// slot is the granule at which a migration's fixed costs follow the memory a guest uses
/// rather than the memory it has: a 512 GiB guest that touched 256 MiB logs one or two slots,
/// and each fetch of a slot's log is a 32 KiB bitmap. Turning logging on write-protects a
/// slot's mapped pages in one ioctl, so the slot also bounds that step (a fully mapped 1 GiB
/// slot is 262,144 pages). 1 GiB keeps huge pages of either size whole, and a 512 GiB guest
/// within 513 slots (KVM allows 32,764 on Linux 5.x and later, 509 before; see
/// [`slot_bytes`]).
pub const SLOT_BYTES: u64 = 1 << 30;

/// Least guest RAM per memory slot: 64 MiB, so that a small guest is cut into enough slots
/// (a 2 GiB guest into 32) for the same rule to pay at its scale; a slot is one more ioctl per
/// dirty sync, a few microseconds.
pub const MIN_SLOT_BYTES: u64 = 64 << 20;

/// Slots a guest's RAM is cut into, at most, when the sizes above allow: RAM / 64 per slot.
const SLOTS_PER_GUEST: u64 = 64;

/// Largest slot ever made: 4 TiB, a power of two under KVM's limit of 2^31 - 1 pages a slot.
const MAX_SLOT_BYTES: u64 = 4 << 40;

/// Slots kept free of guest RAM in the count KVM allows, for whatever else a VMM maps.
const SPARE_SLOTS: u64 = 8;

/// The slot size for `ram` bytes of RAM in `regions` regions when KVM allows `max_slots`: a
/// 64th of RAM as a power of two between [`MIN_SLOT_BYTES`] and [`SLOT_BYTES`], doubled
/// until the slots fit (each region may end in a partial slot).
pub fn slot_bytes(ram: u64, regions: u64, max_slots: u64) -> u64 {
    let limit = max_slots.saturating_sub(SPARE_SLOTS).max(2 * regions);
    let mut size = (ram / SLOTS_PER_GUEST)
        .next_power_of_two()
        .clamp(MIN_SLOT_BYTES, SLOT_BYTES);
    while ram.div_ceil(size) + regions > limit && size < MAX_SLOT_BYTES {
        size *= 2;
    }
    size
}

/// One KVM memory slot: its number, the guest range it maps and the mapping behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySlot {
    pub slot: u32,
    pub gpa: u64,
    pub size: u64,
    /// Host virtual address of the mapping, as registered.
    pub host_addr: u64,
    /// Offset of the slot's memory in the guest RAM memfd.
    pub file_offset: u64,
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
    /// Each RAM region cut into slots at guest addresses that are multiples of `slot_bytes`
    /// (a power of two), numbered in the order given.
    pub fn for_regions(regions: &[crate::memory::RamRegion], slot_bytes: u64) -> SlotTable {
        let mut slots = Vec::new();
        for r in regions {
            let mut at = r.gpa;
            while at < r.gpa + r.size {
                let end = ((at / slot_bytes + 1) * slot_bytes).min(r.gpa + r.size);
                slots.push(MemorySlot {
                    slot: slots.len() as u32,
                    gpa: at,
                    size: end - at,
                    host_addr: r.host_addr + (at - r.gpa),
                    file_offset: r.file_offset + (at - r.gpa),
                });
                at = end;
            }
        }
        SlotTable { slots }
    }

    pub fn slots(&self) -> &[MemorySlot] {
        &self.slots
    }

    /// The slot KVM knows as number `slot`.
    pub fn by_number(&self, slot: u32) -> Option<&MemorySlot> {
        // Slots are numbered in table order; the search is for a table that is not.
        match self.slots.get(slot as usize) {
            Some(s) if s.slot == slot => Some(s),
            _ => self.slots.iter().find(|s| s.slot == slot),
        }
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

/// A KVM VM with guest RAM registered in memory slots.
#[derive(Debug)]
pub struct KvmVm {
    pub kvm: Kvm,
    pub vm: VmFd,
    /// The slots registered in [`KvmVm::new`]; the dirty log finds them here by address.
    slots: SlotTable,
    /// Which slots log dirty pages now, and what each still holds from the log's start
    /// (`dirty.rs`, `log_state.rs`), by index in `slots`.
    logging: std::sync::Mutex<log_state::Logging>,
    /// Entries per vCPU of the dirty ring, when it is enabled (`ring.rs`).
    ring_entries: Option<u32>,
    /// The vCPUs' rings, mapped once the vCPUs exist.
    rings: std::sync::OnceLock<rings::DirtyRings>,
}

impl KvmVm {
    pub fn new(kvm: Kvm, ram: &GuestRam) -> Result<KvmVm, KvmError> {
        let vm = kvm.create_vm().map_err(KvmError::CreateVm)?;
        let max_slots = kvm.check_extension_raw(u64::from(kvm_bindings::KVM_CAP_NR_MEMSLOTS));
        let slot_bytes = slot_bytes(
            ram.size(),
            ram.regions().len() as u64,
            u64::try_from(max_slots).unwrap_or(0),
        );
        let slots = SlotTable::for_regions(ram.regions(), slot_bytes);
        for s in slots.slots() {
            // SAFETY: the slot describes a live mapping owned by `ram`, which the VM's owner
            // keeps alive for as long as the VM (see `Vm`); slots do not overlap (each is a
            // piece of one RAM region, and regions do not overlap).
            unsafe { vm.set_user_memory_region(s.region(0)) }.map_err(|source| {
                match source.errno() {
                    libc::ENOMEM => KvmError::OutOfMemory {
                        gpa: s.gpa,
                        registered: s.file_offset,
                        total: ram.size(),
                    },
                    _ => KvmError::MemorySlot {
                        gpa: s.gpa,
                        size: s.size,
                        source,
                    },
                }
            })?;
        }
        let logging = std::sync::Mutex::new(log_state::Logging::new(slots.slots().len()));
        Ok(KvmVm {
            kvm,
            vm,
            slots,
            logging,
            ring_entries: None,
            rings: std::sync::OnceLock::new(),
        })
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

    /// Slots numbered against address order: the low region is slot number 1.
    fn table() -> SlotTable {
        let region = |gpa, size| RamRegion {
            gpa,
            size,
            file_offset: 0,
            host_addr: 0,
        };
        SlotTable::for_regions(&[region(4 * GIB, GIB), region(0, 3 * GIB)], 4 * GIB)
    }

    #[test]
    fn regions_are_cut_into_slots_at_multiples_of_the_slot_size() {
        let region = |gpa, size, file_offset| RamRegion {
            gpa,
            size,
            file_offset,
            host_addr: 1 << 40,
        };
        let t = SlotTable::for_regions(
            &[
                region(0, 3 * GIB, 0),
                region(4 * GIB, 2 * GIB + (2 << 20), 3 * GIB),
            ],
            GIB,
        );
        let got: Vec<_> = t
            .slots()
            .iter()
            .map(|s| {
                (
                    s.slot,
                    s.gpa,
                    s.size,
                    s.file_offset,
                    s.host_addr - (1 << 40),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, GIB, 0, 0),
                (1, GIB, GIB, GIB, GIB),
                (2, 2 * GIB, GIB, 2 * GIB, 2 * GIB),
                (3, 4 * GIB, GIB, 3 * GIB, 0),
                (4, 5 * GIB, GIB, 4 * GIB, GIB),
                (5, 6 * GIB, 2 << 20, 5 * GIB, 2 * GIB),
            ]
        );
        let (s, first) = t.lookup(5 * GIB + 3 * PAGE, 2).unwrap();
        assert_eq!((s.slot, first), (4, 3));
        assert!(t.lookup(5 * GIB - PAGE, 2).is_err(), "crosses a slot end");
    }

    #[test]
    fn the_slot_size_grows_only_when_kvm_has_too_few_slots() {
        assert_eq!(slot_bytes(256 << 20, 1, 32_764), 64 << 20, "the least");
        assert_eq!(slot_bytes(2 * GIB, 1, 32_764), 64 << 20, "32 slots");
        assert_eq!(slot_bytes(3 * GIB, 1, 32_764), 64 << 20, "48 slots");
        assert_eq!(slot_bytes(8 * GIB, 2, 32_764), 128 << 20, "64 slots");
        assert_eq!(slot_bytes(64 * GIB, 2, 32_764), GIB);
        assert_eq!(slot_bytes(511 * GIB, 2, 32_764), GIB, "the most");
        assert_eq!(
            slot_bytes(2 * GIB, 1, 20),
            256 << 20,
            "9 slots of the 12 allowed"
        );
        assert_eq!(
            slot_bytes(511 * GIB, 2, 509),
            2 * GIB,
            "509 slots: 256 of 2 GiB"
        );
        assert_eq!(
            slot_bytes(64 * GIB, 2, 40),
            4 * GIB,
            "18 slots of the 32 allowed"
        );
        assert_eq!(
            slot_bytes(64 * GIB, 2, 0),
            32 * GIB,
            "none allowed: two slots a region"
        );
        assert_eq!(
            slot_bytes(64 << 40, 2, 0),
            4 << 40,
            "never above KVM's slot size"
        );
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
