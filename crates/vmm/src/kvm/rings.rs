//! The vCPUs' dirty rings as mapped memory: reading a ring's new entries, marking them for
//! reset, and each vCPU's count of what it dirtied (`ring.rs` is KVM's side: enabling,
//! mapping, resetting, and what a sync does with them; its module doc has the two harvesters
//! and the invariant).

use std::os::fd::RawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use kvm_bindings::{KVM_DIRTY_LOG_PAGE_OFFSET, kvm_dirty_gfn};

/// `KVM_DIRTY_GFN_F_DIRTY`: KVM filled the entry.
const F_DIRTY: u32 = 1;
/// `KVM_DIRTY_GFN_F_RESET`: the VMM read it; the next reset re-protects its page.
const F_RESET: u32 = 2;

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

    /// Reads the new entries of vCPU `vcpu`'s ring into its pending list (guest addresses,
    /// through `to_gpa`) and counts them; its thread calls this on `KVM_EXIT_DIRTY_RING_FULL`,
    /// then resets the rings. Returns the pages read.
    pub fn harvest_pending(&self, vcpu: usize, to_gpa: impl Fn(u32, u64) -> Option<u64>) -> u64 {
        let Some(ring) = self.rings.get(vcpu) else {
            return 0;
        };
        let keep = self.logging.load(Ordering::Acquire);
        let mut cursor = ring.cursor.lock().unwrap();
        let Cursor { next, pending } = &mut *cursor;
        let n = self.read(ring, next, |slot, page| {
            if keep && let Some(gpa) = to_gpa(slot, page) {
                pending.push(gpa);
            }
        });
        if keep {
            ring.dirtied.fetch_add(n, Ordering::Relaxed);
        }
        n
    }

    /// Every ring's new entries and pending pages to `mark` (guest addresses, through
    /// `to_gpa`); returns the pages each vCPU dirtied since the last sync (by vCPU id). The
    /// caller resets the rings afterwards.
    pub(super) fn harvest_all(
        &self,
        to_gpa: impl Fn(u32, u64) -> Option<u64>,
        mut mark: impl FnMut(u64),
    ) -> Vec<u64> {
        let keep = self.logging.load(Ordering::Acquire);
        let mut per_vcpu = Vec::with_capacity(self.rings.len());
        for ring in &self.rings {
            let mut cursor = ring.cursor.lock().unwrap();
            let Cursor { next, pending } = &mut *cursor;
            let from_vcpu = pending.len() as u64;
            if keep {
                pending.drain(..).for_each(&mut mark);
            } else {
                pending.clear();
            }
            let n = self.read(ring, next, |slot, page| {
                if keep && let Some(gpa) = to_gpa(slot, page) {
                    mark(gpa);
                }
            });
            if keep {
                ring.dirtied.fetch_add(n, Ordering::Relaxed);
            }
            per_vcpu.push(n + from_vcpu);
        }
        per_vcpu
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

impl DirtyRings {
    /// Maps the rings of `size` entries KVM keeps for the vCPUs `vcpus` (their fds, by id).
    pub fn map(vcpus: &[RawFd], size: u32) -> std::io::Result<DirtyRings> {
        let bytes = size as usize * std::mem::size_of::<kvm_dirty_gfn>();
        let page = 4096 as libc::off_t;
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
                return Err(std::io::Error::last_os_error());
            }
            rings.push(Ring {
                entries: entries.cast(),
                cursor: Mutex::new(Cursor::default()),
                dirtied: AtomicU64::new(0),
            });
        }
        Ok(DirtyRings {
            size,
            rings,
            logging: AtomicBool::new(false),
        })
    }
}
