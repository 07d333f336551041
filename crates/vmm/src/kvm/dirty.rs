//! KVM's dirty log: `KVM_MEM_LOG_DIRTY_PAGES` on the RAM slots that hold populated memory,
//! with `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` so that fetching the log does not re-protect
//! memory, and `KVM_CLEAR_DIRTY_LOG` (declared here; kvm-ioctls lacks it) to re-protect exactly
//! the pages a fetch reported, in bounded chunks.
//!
//! **The log starts without stalling the guest.** Turning logging on the old way
//! ([`LogStart::WriteProtect`]) write-protects every page a slot maps in one ioctl, under
//! KVM's MMU lock: with 4 GiB mapped, tens of milliseconds in which a vCPU that touches memory
//! waits (issue 52). Where KVM offers it, and without the dirty ring, the log starts with
//! `KVM_DIRTY_LOG_INITIALLY_SET` instead ([`LogStart::AllSet`]): turning logging on protects
//! nothing and KVM's bitmap of the slot starts all set. A page whose bit is still set from
//! that start is *unarmed*: not write-protected, so a write to it is not logged, and the slot
//! remembers it (`log_state.rs`). Pass 1 arms memory a slice at a time just before it looks
//! for populated pages in it and reads them ([`KvmVm::arm_dirty_log`]: clear the slice's
//! unarmed bits, which write-protects those pages, as QEMU clears its log in chunks as it
//! sends): a write before the arm is read by pass 1, one after it is logged. The next fetch
//! arms whatever is still unarmed (slices pass 1 found empty, or a VMM that never armed) and
//! then reports every populated page among it, as for a slot that just started logging (see
//! the holes below): what it cannot tell was written, it reports. A bit of an armed page is a
//! write; a bit of an unarmed page is never reported as one, so the all-set start never
//! makes a never-populated page travel. Arming clears only bits that are still unarmed, so a
//! logged write is never cleared unreported, however often a range is armed.
//! `FERRY_DIRTY_LOG_START=write-protect` selects the old way (for benches that measure both).
//! Measured on the 8 GiB guest with 4 GiB populated (docs/benchmarks.md, "The dirty log's
//! start"): the start took 2.6-5.4 ms against 62-72 ms (medians), an arm 0.7 ms; what is left
//! of the start is one memslot update per slot (an SRCU grace period for this thread, a kick
//! for each vCPU), and the guest then pays its first write to each armed page as a fault.
//!
//! **Cost follows populated memory.** A slot whose range of the guest RAM memfd is a hole
//! holds no page anyone wrote, so its log is not turned on and not fetched: a 512 GiB guest
//! that touched 256 MiB logs one or two slots of 1 GiB, and a fetch copies their 32 KiB
//! bitmaps, not 16 MiB. One `SEEK_DATA` tells how many such slots to skip at once.
//!
//! **How a hole stays correct.** A guest (or VMM) write to a hole populates it in the memfd
//! (RAM is `MAP_SHARED` on it; the balloon gives no page back while a migration tracks). So at
//! every fetch, a slot not yet logged is looked at again: if it has data now, its log is
//! turned on (and, started all set, armed whole) first and then every populated page in it is
//! reported dirty. A write before the log was on (or armed) went to a page populated by then
//! (reported); a write after it is in the log (a later fetch). Reporting a page that was only
//! read (a read populates shmem too) costs one zero page on the wire, never a wrong one.
//!
//! **With the dirty ring** (`ring.rs`), slots turn logging on and off the same way, but a
//! fetch harvests the vCPUs' rings instead of each logging slot's bitmap. The ring has no
//! bitmap to start set: KVM pushes a page on the first write after write-protection, so the
//! log starts the old way, write-protecting each slot as it turns on.
//!
//! Slots are found by guest address in the VM's [`super::SlotTable`], and a slot's log is
//! merged into the engine's bitmap at the slot's guest address: nothing here assumes that slot
//! `i` is the `i`-th RAM region of anyone's list.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use ferry_migrate::bitmap::DirtyBitmap;
use ferry_migrate::ram::{RamError, next_data_in_file, next_data_offset};
use ferry_migrate::wire::PAGE_SIZE;
use kvm_bindings::{
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVMIO, kvm_clear_dirty_log,
    kvm_clear_dirty_log__bindgen_ty_1, kvm_enable_cap,
};
#[allow(unused_imports)] // used inside ioctl_iowr_nr!'s expansion
use vmm_sys_util::ioctl_ioc_nr;
use vmm_sys_util::ioctl_iowr_nr;

use super::log_state::{self, LogStart, SlotLog};
use super::{KvmError, KvmVm, MemorySlot};

ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// Pages re-protected per `KVM_CLEAR_DIRTY_LOG`: 16 Ki pages (64 MiB), a bitmap of 256 words;
/// write-protecting that many entries takes about a millisecond, so no call is long.
const CLEAR_CHUNK_PAGES: u64 = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error(
        "this KVM lacks KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 (Linux 5.8+), which ferry's dirty tracking needs"
    )]
    Unsupported,
    #[error("dirty log {what} failed on slot {slot}: {source}")]
    Kvm {
        what: &'static str,
        slot: u32,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("turning dirty logging {} failed: {source}", if *on { "on" } else { "off" })]
    Logging {
        on: bool,
        #[source]
        source: KvmError,
    },
    #[error("looking for populated memory in slot {slot}: {source}")]
    Populated {
        slot: u32,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("the dirty log of slot {slot} does not fit the migration's RAM: {source}")]
    Merge {
        slot: u32,
        #[source]
        source: RamError,
    },
}

/// Why the dirty ring (`ring.rs`) cannot be used, with the fix. Declared here, beside the
/// error that carries it, because `ring.rs` returns [`DirtyLogError`]: this file naming a type
/// of that one would close a circle.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error(
        "--dirty-ring {entries}: a ring holds a power of two of entries from {fewest} to {most} (e.g. 4096)"
    )]
    Entries {
        entries: u32,
        fewest: u32,
        most: u32,
    },
    #[error(
        "this KVM offers no dirty ring (KVM_CAP_DIRTY_LOG_RING, Linux 5.11+); run without --dirty-ring to use the dirty bitmap"
    )]
    Unsupported,
    #[error(
        "--dirty-ring {entries}: this KVM allows at most {most} entries per vCPU; give a smaller power of two"
    )]
    TooLarge { entries: u32, most: u64 },
    #[error("cannot map a vCPU's dirty ring: {source}")]
    Map {
        #[source]
        source: std::io::Error,
    },
    #[error(
        "a dirty-ring exit on a VM without the ring: KVM reported a full ring ferry never enabled, a bug to report"
    )]
    NotEnabled,
}

impl KvmVm {
    /// Turns on manual protection (fetching the log does not re-protect; clearing does), and
    /// with [`LogStart::AllSet`] the all-set start where KVM reports it (else the log starts
    /// the old way, said in the log); done once, at VM creation, before any dirty ring.
    pub fn enable_manual_dirty_protect(&mut self, start: LogStart) -> Result<(), DirtyLogError> {
        let supported = self
            .vm
            .check_extension_raw(u64::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2))
            as u32;
        let needed = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE;
        if supported & needed != needed {
            return Err(DirtyLogError::Unsupported);
        }
        let start = match start {
            LogStart::AllSet if supported & KVM_DIRTY_LOG_INITIALLY_SET == 0 => {
                tracing::info!(
                    "this KVM cannot start a dirty log all set (KVM_DIRTY_LOG_INITIALLY_SET, Linux 5.8+): starting one write-protects the guest's memory at once"
                );
                LogStart::WriteProtect
            }
            start => start,
        };
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            ..Default::default()
        };
        cap.args[0] = u64::from(match start {
            LogStart::WriteProtect => needed,
            LogStart::AllSet => needed | KVM_DIRTY_LOG_INITIALLY_SET,
        });
        self.vm
            .enable_cap(&cap)
            .map_err(|source| DirtyLogError::Kvm {
                what: "enable",
                slot: 0,
                source,
            })?;
        self.logging.get_mut().unwrap().start = start;
        Ok(())
    }

    /// How this VM's dirty log starts.
    pub fn dirty_log_start(&self) -> LogStart {
        self.logging.lock().unwrap().start
    }

    /// Starts dirty logging on every slot that holds populated memory in `memfd` (guest
    /// RAM's); the others are looked at again by each fetch. Returns the slots logged. Started
    /// all set, nothing is write-protected yet: see [`KvmVm::arm_dirty_log`].
    pub fn start_dirty_log(&self, memfd: &File) -> Result<usize, DirtyLogError> {
        let mut logging = self.logging.lock().unwrap();
        if let Some(rings) = self.dirty_rings() {
            // Whatever an earlier log left in the rings is not this one's.
            rings.discard_all();
            self.reset_dirty_rings()?;
            rings.set_logging(true);
        }
        let mut skip = Populated::default();
        let (started, mut longest) = (Instant::now(), Duration::ZERO);
        for (i, s) in self.slots.slots().iter().enumerate() {
            if skip.has_data(memfd, s)? {
                let t = Instant::now();
                self.set_slot_logging(s, true)?;
                longest = longest.max(t.elapsed());
                logging.slots[i] = logging.turned_on(s.pages());
            }
        }
        tracing::debug!(
            "dirty log started ({:?}) on {} slots in {:.2} ms, the longest slot {:.2} ms",
            logging.start,
            logging.count_on(),
            ms(started.elapsed()),
            ms(longest)
        );
        Ok(logging.count_on())
    }

    /// Arms the guest range `[gpa, gpa + len)`: its pages still unarmed since the log started
    /// all set are write-protected (their bits cleared in KVM), so a write from now on is
    /// logged. Pass 1 calls it before it looks at the range. Nothing to do for a slot that
    /// does not log (its log starts armed, see the module doc) or a log started empty.
    pub fn arm_dirty_log(&self, gpa: u64, len: u64) -> Result<(), DirtyLogError> {
        let mut logging = self.logging.lock().unwrap();
        let t = Instant::now();
        for (i, s) in self.slots.slots().iter().enumerate() {
            let (from, to) = (gpa.max(s.gpa), (gpa + len).min(s.gpa + s.size));
            let SlotLog::On { unarmed } = &mut logging.slots[i] else {
                continue;
            };
            if from >= to || unarmed.is_empty() {
                continue;
            }
            let page = |a: u64| (a - s.gpa) / PAGE_SIZE;
            let (first, words) = log_state::bits_in(unarmed, page(from), page(to));
            self.clear_dirty_log(s.slot, s.pages(), first as u64 * 64, &words)?;
            log_state::clear_bits(unarmed, first, &words);
        }
        tracing::trace!("armed {gpa:#x}+{len:#x} in {:.3} ms", ms(t.elapsed()));
        Ok(())
    }

    /// Turns dirty logging off on every slot that logs.
    pub fn stop_dirty_log(&self) -> Result<(), DirtyLogError> {
        let mut logging = self.logging.lock().unwrap();
        for (i, s) in self.slots.slots().iter().enumerate() {
            if logging.slots[i].is_on() {
                self.set_slot_logging(s, false)?;
                logging.slots[i] = SlotLog::Off;
            }
        }
        if let Some(rings) = self.dirty_rings() {
            rings.set_logging(false);
            rings.discard_all();
            self.reset_dirty_rings()?;
        }
        Ok(())
    }

    /// Fetch-and-clear of KVM's log: ORs every logging slot's dirty bits into `into` at the
    /// slot's guest address and re-protects the pages it reported; a slot's pages still
    /// unarmed are armed and its populated ones among them reported. A slot that did not log
    /// and now holds populated memory starts logging, and all its populated pages are
    /// reported (see the module doc). With the dirty ring, returns what this fetch read from
    /// each vCPU's ring, by vCPU id (empty with the bitmap).
    pub fn fetch_dirty_log(
        &self,
        memfd: &File,
        into: &mut DirtyBitmap,
    ) -> Result<Vec<super::rings::Harvest>, DirtyLogError> {
        let mut logging = self.logging.lock().unwrap();
        let rings = self.dirty_rings();
        let per_vcpu = match rings {
            Some(rings) => self.harvest_rings(rings, into)?,
            None => Vec::new(),
        };
        let mut skip = Populated::default();
        let t = Instant::now();
        for (i, s) in self.slots.slots().iter().enumerate() {
            if let SlotLog::On { unarmed } = &mut logging.slots[i] {
                if rings.is_none() {
                    self.fetch_slot(memfd, s, unarmed, into)?;
                }
            } else if skip.has_data(memfd, s)? {
                self.set_slot_logging(s, true)?;
                // Marked as logging only once its pages are reported: a fetch that failed
                // half way looks at the slot again (and reports its pages) the next time.
                match logging.turned_on(s.pages()) {
                    SlotLog::On { mut unarmed } if !unarmed.is_empty() => {
                        self.fetch_slot(memfd, s, &mut unarmed, into)?;
                    }
                    _ => report_populated(memfd, s, 0, s.pages(), into)?,
                }
                logging.slots[i] = SlotLog::On {
                    unarmed: Vec::new(),
                };
            }
        }
        tracing::trace!("dirty log fetched in {:.3} ms", ms(t.elapsed()));
        Ok(per_vcpu)
    }

    /// Re-registers `slot` with dirty logging on or off. On, it write-protects what the slot
    /// maps and its log starts empty, or (started all set) it protects nothing and its log
    /// starts with every page set.
    fn set_slot_logging(&self, s: &MemorySlot, on: bool) -> Result<(), DirtyLogError> {
        let flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        // SAFETY: the same live mapping the slot was created with; only the flags change.
        unsafe { self.vm.set_user_memory_region(s.region(flags)) }.map_err(|source| {
            DirtyLogError::Logging {
                on,
                source: KvmError::MemorySlot {
                    gpa: s.gpa,
                    size: s.size,
                    source,
                },
            }
        })
    }

    /// One slot's log: fetched, its armed pages' bits merged at its guest address and
    /// re-protected; then what is still `unarmed` armed, and the populated pages among it
    /// reported (after the arm: a write before it populated the page, one after is logged).
    fn fetch_slot(
        &self,
        memfd: &File,
        s: &MemorySlot,
        unarmed: &mut Vec<u64>,
        into: &mut DirtyBitmap,
    ) -> Result<(), DirtyLogError> {
        let mut words = self
            .vm
            .get_dirty_log(s.slot, s.size as usize)
            .map_err(|source| DirtyLogError::Kvm {
                what: "fetch",
                slot: s.slot,
                source,
            })?;
        // An unarmed page's bit is the log's start, not a write.
        log_state::clear_bits(&mut words, 0, unarmed);
        into.merge_at(s.gpa, s.pages(), &words)
            .map_err(|source| DirtyLogError::Merge {
                slot: s.slot,
                source,
            })?;
        self.clear_dirty_log(s.slot, s.pages(), 0, &words)?;
        if unarmed.is_empty() {
            return Ok(());
        }
        self.clear_dirty_log(s.slot, s.pages(), 0, unarmed)?;
        for (from, to) in log_state::runs(unarmed) {
            report_populated(memfd, s, from, to, into)?;
        }
        unarmed.clear();
        Ok(())
    }

    /// Re-protects the pages of slot `slot` (of `pages` pages) set in `bits`, bit `i` being
    /// page `first + i` of the slot (`first` a multiple of 64, as KVM wants it), in chunks of
    /// [`CLEAR_CHUNK_PAGES`], skipping chunks with no bit set.
    fn clear_dirty_log(
        &self,
        slot: u32,
        pages: u64,
        first: u64,
        bits: &[u64],
    ) -> Result<(), DirtyLogError> {
        let end = (first + bits.len() as u64 * 64).min(pages);
        let mut at = first;
        while at < end {
            let n = (end - at).min(CLEAR_CHUNK_PAGES);
            let words = &bits[((at - first) / 64) as usize..(at - first + n).div_ceil(64) as usize];
            if words.iter().any(|&w| w != 0) {
                let arg = kvm_clear_dirty_log {
                    slot,
                    num_pages: n as u32,
                    first_page: at,
                    __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
                        dirty_bitmap: words.as_ptr() as *mut libc::c_void,
                    },
                };
                // SAFETY: KVM reads `num_pages` bits from `dirty_bitmap`, which points at
                // `words`, a live slice of at least that many bits; the call writes nothing.
                let ret = unsafe {
                    vmm_sys_util::ioctl::ioctl_with_ref(&self.vm, KVM_CLEAR_DIRTY_LOG(), &arg)
                };
                if ret < 0 {
                    return Err(DirtyLogError::Kvm {
                        what: "clear",
                        slot,
                        source: vmm_sys_util::errno::Error::last(),
                    });
                }
            }
            at += n;
        }
        Ok(())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Walks slots asking whether each holds populated memory, with one `SEEK_DATA` for a whole
/// run of empty slots in file order: the answer says where the next data is, and every slot
/// that ends before it is empty. A slot before the last one asked about (slots out of file
/// order) starts the knowledge afresh.
#[derive(Debug, Default)]
struct Populated {
    /// No data in the memfd from `from` to this offset.
    empty_until: u64,
    /// The file has no data at all from `from` on.
    none_after: bool,
    /// Where the last question started.
    from: u64,
}

impl Populated {
    fn has_data(&mut self, memfd: &File, s: &MemorySlot) -> Result<bool, DirtyLogError> {
        if s.file_offset < self.from {
            *self = Populated::default();
        }
        self.from = s.file_offset;
        let end = s.file_offset + s.size;
        if self.none_after || end <= self.empty_until {
            return Ok(false);
        }
        let from = s.file_offset.max(self.empty_until);
        match next_data_offset(memfd.as_raw_fd(), from).map_err(looking(s))? {
            Some(data) if data < end => Ok(true),
            Some(data) => {
                self.empty_until = data;
                Ok(false)
            }
            None => {
                self.none_after = true;
                Ok(false)
            }
        }
    }
}

/// Marks every populated page of slot `s` from its page `from` to its page `to` in `into`.
fn report_populated(
    memfd: &File,
    s: &MemorySlot,
    from: u64,
    to: u64,
    into: &mut DirtyBitmap,
) -> Result<(), DirtyLogError> {
    let end = s.file_offset + to * PAGE_SIZE;
    let mut at = s.file_offset + from * PAGE_SIZE;
    while let Some((data, hole)) =
        next_data_in_file(memfd.as_raw_fd(), at, end).map_err(looking(s))?
    {
        into.set_range(s.gpa + (data - s.file_offset), hole.min(end) - data);
        at = hole;
    }
    Ok(())
}

/// The error of a failed look for populated memory in slot `s`.
fn looking(s: &MemorySlot) -> impl FnOnce(std::io::Error) -> DirtyLogError {
    let slot = s.slot;
    move |source| DirtyLogError::Populated { slot, source }
}
