//! KVM's dirty ring (`KVM_CAP_DIRTY_LOG_RING_ACQ_REL`, or `KVM_CAP_DIRTY_LOG_RING`): each
//! vCPU pushes the pages it dirties onto a ring of its own, mapped into the VMM, instead of
//! setting bits in a slot's bitmap. A sync then reads what was dirtied since the last one,
//! whatever the size of the slots, and knows which vCPU dirtied each page (the per-vCPU dirty
//! limit needs that, `dirty_limit.rs`).
//!
//! The ring is enabled on the VM before any vCPU exists ([`KvmVm::enable_dirty_ring`]); each
//! vCPU's ring is mapped when the vCPUs are created ([`KvmVm::map_dirty_rings`]). Slots still
//! turn logging on and off as with the bitmap (`dirty.rs`): KVM pushes a page only for a slot
//! with `KVM_MEM_LOG_DIRTY_PAGES`, once per write-protection, and `KVM_RESET_DIRTY_RINGS`
//! re-protects the pages harvested. A ring has no bitmap to start all set, so with it the
//! log starts the old way (`KVM_DIRTY_LOG_INITIALLY_SET` is not enabled, and
//! `SourceVm::arm_dirty` answers unsupported): turning a slot's logging on write-protects
//! what it maps at once, the stall issue 52 measured.
//!
//! **Two harvesters.** The migration thread harvests every ring at a sync. A vCPU whose ring
//! fills exits to the VMM (`KVM_EXIT_DIRTY_RING_FULL`) and may not run again until entries are
//! reset, so its own thread harvests its ring then, into a pending bitmap per slot, which the
//! next sync takes (a page dirtied again after each reset is kept once). A ring's fetch index
//! is behind a lock, so the two never read one entry twice; an entry is marked for reset once
//! read and before its page is published, and the reset stops at the first entry not marked,
//! so a reset from either thread is safe while the other harvests.
//!
//! Invariant: entries harvested while no slot logs (a sync's leftovers after the log was
//! stopped) are dropped, so that a VM that is not migrating keeps nothing.

use ferry_migrate::bitmap::DirtyBitmap;
use kvm_bindings::{
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, kvm_dirty_gfn, kvm_enable_cap,
};

use super::KvmVm;
use super::dirty::{DirtyLogError, RingError};
use super::rings::{DirtyRings, Harvest};

/// `KVM_RESET_DIRTY_RINGS`: `_IO(KVMIO, 0xc7)` (kvm-ioctls lacks it).
const KVM_RESET_DIRTY_RINGS: libc::c_ulong = 0xAEC7;

/// Fewest entries a ring may have: one page of them.
pub const MIN_RING_ENTRIES: u32 = 256;
/// Most entries a ring may have (KVM's `KVM_DIRTY_RING_MAX_ENTRIES`).
pub const MAX_RING_ENTRIES: u32 = 65536;

/// Why a ring size cannot be used, with the fix.
pub fn check_entries(entries: u32) -> Result<(), RingError> {
    if !entries.is_power_of_two() || !(MIN_RING_ENTRIES..=MAX_RING_ENTRIES).contains(&entries) {
        return Err(RingError::Entries {
            entries,
            fewest: MIN_RING_ENTRIES,
            most: MAX_RING_ENTRIES,
        });
    }
    Ok(())
}

impl KvmVm {
    /// Enables the dirty ring with `entries` entries per vCPU; must come before any vCPU is
    /// created. Prefers the acquire/release flavour where KVM offers it.
    pub fn enable_dirty_ring(&mut self, entries: u32) -> Result<(), DirtyLogError> {
        check_entries(entries)?;
        let bytes = u64::from(entries) * std::mem::size_of::<kvm_dirty_gfn>() as u64;
        let offered = |cap: u32| self.vm.check_extension_raw(u64::from(cap)).max(0) as u64;
        let Some(cap) = [KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_DIRTY_LOG_RING]
            .into_iter()
            .find(|&c| offered(c) > 0)
        else {
            return Err(RingError::Unsupported.into());
        };
        if bytes > offered(cap) {
            let most = offered(cap) / std::mem::size_of::<kvm_dirty_gfn>() as u64;
            return Err(RingError::TooLarge { entries, most }.into());
        }
        let mut enable = kvm_enable_cap {
            cap,
            ..Default::default()
        };
        enable.args[0] = bytes;
        self.vm
            .enable_cap(&enable)
            .map_err(|source| DirtyLogError::Kvm {
                what: "enable the dirty ring",
                slot: 0,
                source,
            })?;
        self.ring_entries = Some(entries);
        Ok(())
    }

    /// Maps each vCPU's ring, when the ring is enabled; `vcpus` by id. Done once, when the
    /// vCPUs are created.
    pub fn map_dirty_rings(&self, vcpus: &[std::os::fd::RawFd]) -> Result<(), DirtyLogError> {
        let Some(size) = self.ring_entries else {
            return Ok(());
        };
        // Pending bitmaps by slot number: the table numbers its slots in order.
        let slot_pages: Vec<u64> = (0..self.slots.slots().len() as u32)
            .map(|n| self.slots.by_number(n).map_or(0, |s| s.pages()))
            .collect();
        let rings = DirtyRings::map(vcpus, size, &slot_pages)
            .map_err(|source| RingError::Map { source })?;
        let _ = self.rings.set(rings);
        Ok(())
    }

    /// The dirty rings, when the VM has them.
    pub fn dirty_rings(&self) -> Option<&DirtyRings> {
        self.rings.get()
    }

    /// Re-protects every page harvested from any ring so far.
    pub fn reset_dirty_rings(&self) -> Result<(), DirtyLogError> {
        // SAFETY: an ioctl on the VM's fd that takes no argument.
        let ret = unsafe { vmm_sys_util::ioctl::ioctl(&self.vm, KVM_RESET_DIRTY_RINGS) };
        if ret < 0 {
            return Err(DirtyLogError::Kvm {
                what: "reset the dirty rings",
                slot: 0,
                source: vmm_sys_util::errno::Error::last(),
            });
        }
        Ok(())
    }

    /// A sync's harvest of every ring and the pending pages into `into`, then the reset; what
    /// it read from each vCPU's ring, by vCPU id.
    pub(super) fn harvest_rings(
        &self,
        rings: &DirtyRings,
        into: &mut DirtyBitmap,
    ) -> Result<Vec<Harvest>, DirtyLogError> {
        let mut bad = None;
        let per_vcpu = rings.harvest_all(|slot, first, bits| {
            let Some(s) = self.slots.by_number(slot).filter(|s| first < s.pages()) else {
                return;
            };
            let pages = (s.pages() - first).min(64);
            let gpa = s.gpa + first * ferry_guest_abi::PAGE_SIZE;
            if let Err(e) = into.merge_at(gpa, pages, &[bits]) {
                bad.get_or_insert((slot, e));
            }
        });
        self.reset_dirty_rings()?;
        match bad {
            Some((slot, source)) => Err(DirtyLogError::Merge { slot, source }),
            None => Ok(per_vcpu),
        }
    }

    /// For vCPU `vcpu`'s thread when its dirty ring filled: its entries are read into the
    /// pending bitmaps (the next sync takes them) and the rings reset, so it can run.
    /// Returns what it read.
    pub fn harvest_own_ring(&self, vcpu: usize) -> Result<Harvest, DirtyLogError> {
        let Some(rings) = self.dirty_rings() else {
            return Err(RingError::NotEnabled.into());
        };
        let read = rings.harvest_pending(vcpu);
        self.reset_dirty_rings()?;
        Ok(read)
    }
}
