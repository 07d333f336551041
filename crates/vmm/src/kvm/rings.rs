//! The vCPUs' dirty rings as mapped memory: reading a ring's new entries, marking them for
//! reset, the pages vCPU threads read from full rings until a sync takes them, and each vCPU's
//! count of what it dirtied. `ring.rs` is KVM's side (enabling, mapping, resetting, and what a
//! sync does with them); its module doc has the two harvesters and the invariant.

use std::os::fd::RawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use ferry_migrate::pagebits::PageBits;
use kvm_bindings::{KVM_DIRTY_LOG_PAGE_OFFSET, kvm_dirty_gfn};

/// `KVM_DIRTY_GFN_F_DIRTY`: KVM filled the entry.
const F_DIRTY: u32 = 1;
/// `KVM_DIRTY_GFN_F_RESET`: the VMM read it; the next reset re-protects its page.
const F_RESET: u32 = 2;

/// One vCPU's ring.
#[derive(Debug)]
struct Ring {
    entries: *mut kvm_dirty_gfn,
    /// The next entry to read, and when the ring was last harvested.
    cursor: Mutex<Cursor>,
    /// Pages harvested from this ring while a slot logged: what this vCPU dirtied (a page
    /// dirtied again after a reset re-protected it counts again).
    dirtied: AtomicU64,
}

/// Where a ring's reading stands.
#[derive(Debug, Default)]
struct Cursor {
    next: u32,
    /// When the ring was last harvested (`None`: not since the log started).
    harvested: Option<Instant>,
}

/// What one harvest of a vCPU's ring read: its entries, and when the ring was harvested
/// before (`None`: not since the log started), so that the pages are known to have been
/// dirtied between the two. Both are taken under the ring's lock, so harvests of one ring
/// (by its vCPU's thread and by a sync) follow each other in this order too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Harvest {
    pub pages: u64,
    pub since: Option<Instant>,
}

// SAFETY: the mapping is the vCPU's ring, shared with KVM for the VM's life; entries are read
// under `cursor`'s lock and their flags only through atomics (see `read`).
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

/// The VM's rings, one per vCPU, by vCPU id.
#[derive(Debug)]
pub struct DirtyRings {
    size: u32,
    rings: Vec<Ring>,
    /// The pages vCPU threads read from their full rings since the last sync, a bitmap per
    /// memory slot (by slot number): a page a writer dirties again after each reset is kept
    /// once, and a sync takes them at the cost of what is set.
    pending: Vec<PageBits>,
    /// Whether a migration's log is on (entries harvested are kept).
    logging: AtomicBool,
    /// Whether the rings are KVM's mappings (unmapped on drop); not in unit tests.
    mapped: bool,
}

impl DirtyRings {
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
            for r in &self.rings {
                r.dirtied.store(0, Ordering::Relaxed);
                r.cursor.lock().unwrap().harvested = None;
            }
        }
        self.logging.store(on, Ordering::Release);
    }

    /// Reads the new entries of vCPU `vcpu`'s ring into the pending bitmaps and counts them;
    /// its thread calls this on `KVM_EXIT_DIRTY_RING_FULL`, then resets the rings. Returns the
    /// pages read.
    pub fn harvest_pending(&self, vcpu: usize) -> Harvest {
        let Some(ring) = self.rings.get(vcpu) else {
            return Harvest::default();
        };
        let keep = self.logging.load(Ordering::Acquire);
        let mut cursor = ring.cursor.lock().unwrap();
        let h = self.read(ring, &mut cursor, |slot, page| {
            if keep
                && let Some(bits) = self.pending.get(slot as usize)
                && page < bits.len()
            {
                bits.set(page);
            }
        });
        if keep {
            ring.dirtied.fetch_add(h.pages, Ordering::Relaxed);
        }
        h
    }

    /// Every ring's new entries, then the pending pages, to `mark` as `(slot, first page,
    /// bits)`: bit `i` of `bits` is page `first + i` of the slot (an entry is one bit, a
    /// pending word up to 64). Returns the entries this sync read from each vCPU's ring (by
    /// vCPU id), not counting the pending pages its own thread read (and counted) before. The
    /// caller resets the rings afterwards.
    pub(super) fn harvest_all(&self, mut mark: impl FnMut(u32, u64, u64)) -> Vec<Harvest> {
        let keep = self.logging.load(Ordering::Acquire);
        let mut per_vcpu = Vec::with_capacity(self.rings.len());
        for ring in &self.rings {
            let mut cursor = ring.cursor.lock().unwrap();
            let h = self.read(ring, &mut cursor, |slot, page| {
                if keep {
                    mark(slot, page, 1);
                }
            });
            if keep {
                ring.dirtied.fetch_add(h.pages, Ordering::Relaxed);
            }
            per_vcpu.push(h);
        }
        for (slot, bits) in self.pending.iter().enumerate() {
            for (w, word) in bits.take() {
                if keep {
                    mark(slot as u32, w as u64 * 64, word);
                }
            }
        }
        per_vcpu
    }

    /// Drops every ring's new entries and pending pages (the caller resets the rings).
    pub(super) fn discard_all(&self) {
        for ring in &self.rings {
            let mut cursor = ring.cursor.lock().unwrap();
            self.read(ring, &mut cursor, |_, _| {});
        }
        self.pending.iter().for_each(PageBits::clear_all);
    }

    /// Reads the dirty entries of `ring` from the cursor on, marking each for reset, and calls
    /// `page` with each entry's slot id and page; returns how many it read and since when.
    fn read(&self, ring: &Ring, cursor: &mut Cursor, mut page: impl FnMut(u32, u64)) -> Harvest {
        let next = &mut cursor.next;
        let mut n = 0;
        loop {
            // The entry is memory KVM writes too: it is reached through raw pointers only,
            // never a reference. SAFETY: the ring maps `size` entries for the VM's life, and the
            // index is taken modulo `size` (a power of two).
            let entry = unsafe { ring.entries.add((*next & (self.size - 1)) as usize) };
            // SAFETY: the flags word is a u32 of that mapping, only ever touched through an
            // atomic of the same size and alignment (acquire to read, release to write, as the
            // ring's ABI asks).
            let flags = unsafe { AtomicU32::from_ptr(&raw mut (*entry).flags) };
            if flags.load(Ordering::Acquire) & F_DIRTY == 0 {
                let since = cursor.harvested.replace(Instant::now());
                return Harvest { pages: n, since };
            }
            // SAFETY: KVM filled the entry before it set F_DIRTY (seen above with acquire), and
            // does not touch it again until the VMM sets F_RESET and resets the ring.
            let (slot, offset) = unsafe {
                (
                    (&raw const (*entry).slot).read_volatile(),
                    (&raw const (*entry).offset).read_volatile(),
                )
            };
            // Marked for reset before `page` publishes it (a vCPU thread's pending bit): a sync
            // that takes the page then also sees the mark, so its reset re-protects the page
            // before the sync sends it, and a write after the send is a new entry.
            flags.store(F_RESET, Ordering::Release);
            // Slot id: address space in the high 16 bits (always 0 here), slot in the low.
            page(slot & 0xffff, offset);
            *next = next.wrapping_add(1);
            n += 1;
        }
    }
}

impl DirtyRings {
    /// Maps the rings of `size` entries KVM keeps for the vCPUs `vcpus` (their fds, by id),
    /// with a pending bitmap for each memory slot of `slot_pages` pages (by slot number).
    pub fn map(vcpus: &[RawFd], size: u32, slot_pages: &[u64]) -> std::io::Result<DirtyRings> {
        let bytes = size as usize * std::mem::size_of::<kvm_dirty_gfn>();
        let page = 4096 as libc::off_t;
        let mut rings = Vec::with_capacity(vcpus.len());
        for &fd in vcpus {
            // SAFETY: maps the ring KVM keeps for the vCPU `fd` names, at the offset KVM
            // documents, shared; it is unmapped only when the rings drop, with the KvmVm that
            // every reader goes through.
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
            pending: slot_pages.iter().map(|&p| PageBits::new(p)).collect(),
            logging: AtomicBool::new(false),
            mapped: true,
        })
    }
}

impl Drop for DirtyRings {
    fn drop(&mut self) {
        if !self.mapped {
            return;
        }
        let bytes = self.size as usize * std::mem::size_of::<kvm_dirty_gfn>();
        for ring in &self.rings {
            // SAFETY: each ring was mapped with this length in `map` and is unmapped once,
            // here, when nothing can read it any more (the rings are dropped with the KvmVm).
            // The mapping holds the vCPU's file, so without this the kernel's VM would live on.
            unsafe { libc::munmap(ring.entries.cast(), bytes) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rings over `buffers` (each `size` entries) instead of KVM's mappings, one slot of 1024
    /// pages.
    fn rings_over(buffers: &mut [Vec<kvm_dirty_gfn>], size: u32) -> DirtyRings {
        DirtyRings {
            size,
            rings: buffers
                .iter_mut()
                .map(|b| Ring {
                    entries: b.as_mut_ptr(),
                    cursor: Mutex::new(Cursor::default()),
                    dirtied: AtomicU64::new(0),
                })
                .collect(),
            pending: vec![PageBits::new(1024)],
            logging: AtomicBool::new(true),
            mapped: false,
        }
    }

    /// KVM's part: fills entry `i` of `ring` with `page` of slot 0.
    fn push(ring: &mut [kvm_dirty_gfn], i: usize, page: u64) {
        ring[i].slot = 0;
        ring[i].offset = page;
        ring[i].flags = F_DIRTY;
    }

    /// The pages `harvest_all` marks, in order.
    fn harvest(rings: &DirtyRings) -> (Vec<u64>, Vec<u64>) {
        let mut marked = Vec::new();
        let per_vcpu = rings.harvest_all(|slot, first, bits| {
            assert_eq!(slot, 0);
            marked.extend((0..64).filter(|i| bits >> i & 1 == 1).map(|i| first + i));
        });
        marked.sort();
        (per_vcpu.iter().map(|h| h.pages).collect(), marked)
    }

    #[test]
    fn each_entry_is_read_once_marked_for_reset_and_charged_to_its_vcpu_once() {
        let mut buffers = vec![vec![kvm_dirty_gfn::default(); 8]; 2];
        for (i, page) in [3, 9, 4, 9].into_iter().enumerate() {
            push(&mut buffers[0], i, page);
        }
        push(&mut buffers[1], 0, 700);
        let rings = rings_over(&mut buffers, 8);
        // vCPU 0's ring filled: its thread reads its 4 entries (page 9 twice, dirtied again
        // after a reset) into the pending bitmap.
        let own = rings.harvest_pending(0);
        assert_eq!(own.pages, 4);
        assert_eq!(
            own.since, None,
            "the ring's first harvest since the log started"
        );
        // A sync takes them, once each, and vCPU 1's entry, but charges vCPU 0 for none of
        // them again; its harvest of vCPU 0's ring counts from the vCPU's own.
        let mut marked = Vec::new();
        let per_vcpu = rings.harvest_all(|_, first, bits| {
            marked.extend((0..64).filter(|i| bits >> i & 1 == 1).map(|i| first + i));
        });
        marked.sort();
        assert_eq!(marked, [3, 4, 9, 700]);
        assert_eq!(per_vcpu[0].pages, 0);
        assert!(per_vcpu[0].since.is_some());
        assert_eq!(
            per_vcpu[1],
            Harvest {
                pages: 1,
                since: None
            }
        );
        assert_eq!(rings.dirtied(), [4, 1]);
        // Every entry read is marked for KVM's reset; nothing is read twice.
        let flags: Vec<u32> = buffers[0][..5].iter().map(|e| e.flags).collect();
        assert_eq!(flags, [F_RESET, F_RESET, F_RESET, F_RESET, 0]);
        assert_eq!(harvest(&rings), (vec![0, 0], vec![]));
    }

    #[test]
    fn the_cursor_wraps_and_entries_read_while_no_log_is_on_are_dropped() {
        let mut buffers = vec![vec![kvm_dirty_gfn::default(); 4]];
        let rings = rings_over(&mut buffers, 4);
        // Six pages through a ring of four: KVM reuses entries after a reset clears them.
        for round in 0..3u64 {
            for i in 0..2 {
                let at = ((round * 2 + i) % 4) as usize;
                buffers[0][at].flags = 0;
                push(&mut buffers[0], at, round * 2 + i);
            }
            let (_, marked) = harvest(&rings);
            assert_eq!(marked, [round * 2, round * 2 + 1], "round {round}");
        }
        // A page past the slot's end is dropped, not kept.
        buffers[0][2].flags = 0;
        push(&mut buffers[0], 2, 5000);
        assert_eq!(rings.harvest_pending(0).pages, 1);
        assert_eq!(harvest(&rings).1, Vec::<u64>::new());
        rings.set_logging(false);
        buffers[0][3].flags = 0;
        push(&mut buffers[0], 3, 50);
        assert_eq!(
            rings.harvest_pending(0).pages,
            1,
            "read, so KVM can reset it"
        );
        assert_eq!(harvest(&rings).1, Vec::<u64>::new(), "kept with no log on");
        assert_eq!(rings.dirtied(), [7]);
    }
}
