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
//! re-protects the pages harvested.
//!
//! **Two harvesters.** The migration thread harvests every ring at a sync. A vCPU whose ring
//! fills exits to the VMM (`KVM_EXIT_DIRTY_RING_FULL`) and may not run again until entries are
//! reset, so its own thread harvests its ring then, into the ring's pending list, which the
//! next sync takes. A ring's fetch index is behind a lock, so the two never read one entry
//! twice; entries are marked for reset only once read, and the reset stops at the first
//! entry not marked, so a reset from either thread is safe while the other harvests.
//!
//! Invariant: entries harvested while no slot logs (a sync's leftovers after the log was
//! stopped) are dropped, so that a VM that is not migrating keeps nothing.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use ferry_migrate::bitmap::DirtyBitmap;
use kvm_bindings::{
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_DIRTY_LOG_PAGE_OFFSET,
    kvm_dirty_gfn, kvm_enable_cap,
};

use super::dirty::DirtyLogError;
use super::{KvmVm, SlotTable};

/// `KVM_DIRTY_GFN_F_DIRTY`: KVM filled the entry.
const F_DIRTY: u32 = 1;
/// `KVM_DIRTY_GFN_F_RESET`: the VMM read it; the next reset re-protects its page.
const F_RESET: u32 = 2;
/// `KVM_RESET_DIRTY_RINGS`: `_IO(KVMIO, 0xc7)` (kvm-ioctls lacks it).
const KVM_RESET_DIRTY_RINGS: libc::c_ulong = 0xAEC7;

/// Fewest entries a ring may have: one page of them.
pub const MIN_RING_ENTRIES: u32 = 256;
/// Most entries a ring may have (KVM's `KVM_DIRTY_RING_MAX_ENTRIES`).
pub const MAX_RING_ENTRIES: u32 = 65536;

/// Why a ring size cannot be used, with the fix.
pub fn check_entries(entries: u32) -> Result<(), String> {
    if !entries.is_power_of_two() || !(MIN_RING_ENTRIES..=MAX_RING_ENTRIES).contains(&entries) {
        return Err(format!(
            "--dirty-ring {entries}: a ring holds a power of two of entries from {MIN_RING_ENTRIES} to {MAX_RING_ENTRIES} (e.g. 4096)"
        ));
    }
    Ok(())
}

/// One vCPU's ring.
#[derive(Debug)]
pub struct Ring {
    entries: *mut kvm_dirty_gfn,
    /// The next entry to read, and the pages a vCPU-side harvest read (guest addresses).
    cursor: Mutex<Cursor>,
    /// Pages harvested from this ring while a slot logged: what this vCPU dirtied.
    dirtied: AtomicU64,
}

#[derive(Debug, Default)]
struct Cursor {
    next: u32,
    pending: Vec<u64>,
}

// SAFETY: the mapping is the vCPU's ring, shared with KVM for the VM's life; entries are read
// under `cursor`'s lock and their flags only through atomics (see `harvest_into`).
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

/// The VM's rings, one per vCPU, by vCPU id.
#[derive(Debug)]
pub struct DirtyRings {
    size: u32,
    rings: Vec<Ring>,
    /// Whether a migration's log is on (entries harvested are kept).
    logging: AtomicBool,
}

impl DirtyRings {
    pub fn entries(&self) -> u32 {
        self.size
    }

    /// Pages each vCPU dirtied while a log was on, by vCPU id.
    pub fn dirtied(&self) -> Vec<u64> {
        self.rings
            .iter()
            .map(|r| r.dirtied.load(Ordering::Relaxed))
            .collect()
    }

    /// Keeps entries from now on, or drops them; turned on, the per-vCPU counts restart.
    pub(super) fn set_logging(&self, on: bool) {
        if on {
            self.rings
                .iter()
                .for_each(|r| r.dirtied.store(0, Ordering::Relaxed));
        }
        self.logging.store(on, Ordering::Release);
    }

    /// Reads the new entries of vCPU `vcpu`'s ring into its pending list and counts them;
    /// its thread calls this on `KVM_EXIT_DIRTY_RING_FULL`, then [`KvmVm::reset_dirty_rings`].
    /// Returns the pages read.
    pub fn harvest_pending(&self, vm: &KvmVm, vcpu: usize) -> u64 {
        let Some(ring) = self.rings.get(vcpu) else {
            return 0;
        };
        let keep = self.logging.load(Ordering::Acquire);
        let mut cursor = ring.cursor.lock().unwrap();
        let Cursor { next, pending } = &mut *cursor;
        let n = self.read(ring, next, |slot, page| {
            if keep && let Some(gpa) = gpa_of(&vm.slots, slot, page) {
                pending.push(gpa);
            }
        });
        if keep {
            ring.dirtied.fetch_add(n, Ordering::Relaxed);
        }
        n
    }

    /// Every ring's new entries and pending pages into `into`; returns the pages each vCPU
    /// dirtied since the last sync (by vCPU id). The caller resets the rings afterwards.
    fn harvest_all(
        &self,
        slots: &SlotTable,
        into: &mut DirtyBitmap,
    ) -> Result<Vec<u64>, DirtyLogError> {
        let keep = self.logging.load(Ordering::Acquire);
        let mut per_vcpu = Vec::with_capacity(self.rings.len());
        let mut bad = None;
        for ring in &self.rings {
            let mut cursor = ring.cursor.lock().unwrap();
            let Cursor { next, pending } = &mut *cursor;
            let mut mark = |gpa: u64| {
                if let Err(e) = into.merge_at(gpa, 1, &[1]) {
                    bad.get_or_insert(e);
                }
            };
            let from_vcpu = pending.len() as u64;
            if keep {
                pending.drain(..).for_each(&mut mark);
            } else {
                pending.clear();
            }
            let n = self.read(ring, next, |slot, page| {
                if keep && let Some(gpa) = gpa_of(slots, slot, page) {
                    mark(gpa);
                }
            });
            if keep {
                ring.dirtied.fetch_add(n, Ordering::Relaxed);
            }
            per_vcpu.push(n + from_vcpu);
        }
        match bad {
            Some(source) => Err(DirtyLogError::Merge { slot: 0, source }),
            None => Ok(per_vcpu),
        }
    }

    /// Drops every ring's new entries and pending pages (the caller resets the rings).
    pub(super) fn discard_all(&self) {
        for ring in &self.rings {
            let mut cursor = ring.cursor.lock().unwrap();
            let Cursor { next, pending } = &mut *cursor;
            pending.clear();
            self.read(ring, next, |_, _| {});
        }
    }

    /// Reads the dirty entries of `ring` from `*next` on, marking each for reset, and calls
    /// `page` with each entry's slot id and page; returns how many it read.
    fn read(&self, ring: &Ring, next: &mut u32, mut page: impl FnMut(u32, u64)) -> u64 {
        let mut n = 0;
        loop {
            // SAFETY: the ring maps `size` entries for the VM's life, and the index is taken
            // modulo `size` (a power of two).
            let entry = unsafe { &*ring.entries.add((*next & (self.size - 1)) as usize) };
            // SAFETY: the flags word is a u32 of the shared mapping that KVM reads and writes
            // too; it is only ever touched through an atomic of the same size and alignment
            // (acquire to read, release to write, as the ring's ABI asks).
            let flags = unsafe { &*(&raw const entry.flags).cast::<AtomicU32>() };
            if flags.load(Ordering::Acquire) & F_DIRTY == 0 {
                return n;
            }
            // Slot id: address space in the high 16 bits (always 0 here), slot in the low.
            page(entry.slot & 0xffff, entry.offset);
            flags.store(F_RESET, Ordering::Release);
            *next = next.wrapping_add(1);
            n += 1;
        }
    }
}

/// The guest address of page `page` of slot number `slot`, if that slot is RAM.
fn gpa_of(slots: &SlotTable, slot: u32, page: u64) -> Option<u64> {
    let s = slots.by_number(slot)?;
    (page < s.pages()).then(|| s.gpa + page * ferry_guest_abi::PAGE_SIZE)
}

impl KvmVm {
    /// Enables the dirty ring with `entries` entries per vCPU; must come before any vCPU is
    /// created. Prefers the acquire/release flavour where KVM offers it.
    pub fn enable_dirty_ring(&mut self, entries: u32) -> Result<(), DirtyLogError> {
        check_entries(entries).map_err(DirtyLogError::Ring)?;
        let bytes = u64::from(entries) * std::mem::size_of::<kvm_dirty_gfn>() as u64;
        let offered = |cap: u32| self.vm.check_extension_raw(u64::from(cap)).max(0) as u64;
        let Some(cap) = [KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_DIRTY_LOG_RING]
            .into_iter()
            .find(|&c| offered(c) > 0)
        else {
            return Err(DirtyLogError::Ring(
                "this KVM offers no dirty ring (KVM_CAP_DIRTY_LOG_RING, Linux 5.11+); run without --dirty-ring to use the dirty bitmap".into(),
            ));
        };
        if bytes > offered(cap) {
            return Err(DirtyLogError::Ring(format!(
                "--dirty-ring {entries}: this KVM allows at most {} entries per vCPU",
                offered(cap) / std::mem::size_of::<kvm_dirty_gfn>() as u64
            )));
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
        let bytes = size as usize * std::mem::size_of::<kvm_dirty_gfn>();
        let page = ferry_guest_abi::PAGE_SIZE as libc::off_t;
        let mut rings = Vec::with_capacity(vcpus.len());
        for &fd in vcpus {
            // SAFETY: maps the ring KVM keeps for the vCPU `fd` names, at the offset KVM
            // documents, shared; the mapping is never unmapped while the VM lives (the rings
            // live in the KvmVm, which the VM's threads share until the process ends).
            let entries = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    libc::off_t::from(KVM_DIRTY_LOG_PAGE_OFFSET as u16) * page,
                )
            };
            if entries == libc::MAP_FAILED {
                return Err(DirtyLogError::Ring(format!(
                    "cannot map a vCPU's dirty ring: {}",
                    std::io::Error::last_os_error()
                )));
            }
            rings.push(Ring {
                entries: entries.cast(),
                cursor: Mutex::new(Cursor::default()),
                dirtied: AtomicU64::new(0),
            });
        }
        let _ = self.rings.set(DirtyRings {
            size,
            rings,
            logging: AtomicBool::new(false),
        });
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

    /// A sync's harvest of every ring into `into`, then the reset; the pages each vCPU
    /// dirtied since the last one, by vCPU id.
    pub(super) fn harvest_rings(
        &self,
        rings: &DirtyRings,
        into: &mut DirtyBitmap,
    ) -> Result<Vec<u64>, DirtyLogError> {
        let per_vcpu = rings.harvest_all(&self.slots, into)?;
        self.reset_dirty_rings()?;
        Ok(per_vcpu)
    }
}
