//! Guest RAM: one memfd, mapped shared and sparse, laid out around the 32-bit MMIO hole.
//!
//! The memfd is the single owner of guest memory. It is sized with `ftruncate` (no pages are
//! allocated until touched) and mapped `MAP_SHARED | MAP_NORESERVE`, so a 64 GiB guest that
//! touches 256 MiB costs about 256 MiB of host memory, and a migration can later find
//! never-touched ranges with `SEEK_DATA`/`SEEK_HOLE` on the same fd. RAM below the hole is at
//! file offset = guest address; RAM above it continues at 4 GiB, at file offset
//! [`MMIO_HOLE_START`], so the file has no hole of its own.
//!
//! **Every write the VMM makes to guest memory is recorded, by construction.** KVM's dirty log
//! sees only the guest's writes; a device or loader writing guest memory behind a migration's
//! back would leave the destination with a stale page and no error. So there is no untracked
//! way to write: guest memory is a vm-memory [`GuestMemoryMmap`] whose regions carry a
//! [`WriteBitmap`] (vm-memory's `Bitmap` trait, implemented in `writes.rs`), and every write
//! vm-memory performs, through
//! [`GuestRam::write`], the [`Bytes`] methods of [`GuestRam::memory`] (which linux-loader uses)
//! or a `VolatileSlice` taken from it, sets the page's bit after the bytes land. Reading stays
//! free. The only ways around the bitmap are raw host pointers (`as_ptr`, `get_host_address`),
//! which cannot be written through without an `unsafe` block of one's own.
//!
//! Why vm-memory's bitmap rather than a tracked writer of our own: the loaders need a
//! `GuestMemory` to write boot data into, so a view would have to be handed out anyway, and a
//! view that records is the only one that cannot be misused; vm-memory already marks after the
//! copy, which is the order the migration needs (the engine clears a bit and then copies the
//! page, so a write that races the copy stays marked for the next pass). The cost: one bit per
//! 4 KiB page, always allocated (2 MiB for a 64 GiB guest, 16 MiB at the 512 GiB maximum), and
//! two atomic ORs per write (page bits, then a summary bit per 64 pages); taking the writes
//! walks the summary (1/64 of the bits) and only the page words it names, so a dirty sync
//! costs what the VMM wrote, not the size of RAM.
//!
//! The bitmap always records; a migration reads it only between [`GuestRam::track_writes`]
//! on and off, and turning tracking on forgets earlier writes (pass 1 reads every populated
//! page after tracking starts, so it sees them).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

use ferry_migrate::pagebits::TakenWords;

use crate::writes::WriteBitmap;

pub mod adopt;
pub mod mapped;

/// Guest memory as vm-memory sees it, every region with its write bitmap.
pub type TrackedMemory = GuestMemoryMmap<WriteBitmap>;

/// Start of the 32-bit MMIO hole: 1 GiB below 4 GiB for 32-bit BARs, the IOAPIC and LAPIC
/// windows (0xfec0_0000, 0xfee0_0000) and the firmware flash, as PC firmware leaves it.
pub const MMIO_HOLE_START: u64 = 3 << 30;
/// End of the hole, where RAM resumes.
pub const MMIO_HOLE_END: u64 = 4 << 30;
/// Smallest guest: the built-in guest's image, its tables and a useful working set fit.
pub const MIN_MEMORY: u64 = 64 << 20;
/// Highest guest address ferry maps: half of x86-64's 47-bit user address space, 64 TiB. Guest
/// RAM is one mapping in the VMM process, and `ferry demo` maps a source's and a
/// destination's in one process.
pub const MAPPABLE_TOP: u64 = 1 << 46;
/// Largest guest RAM ferry maps on any host (`crate::limit` has the bound of this host and
/// guest, which may be lower).
pub const MAX_MEMORY: u64 = MAPPABLE_TOP - (MMIO_HOLE_END - MMIO_HOLE_START);
/// Granule of guest memory sizes: the 2 MiB pages the guest maps RAM with.
pub const MEMORY_GRANULE: u64 = 2 << 20;

/// Why guest RAM could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("--memory {} is below the minimum of 64M; give the VM at least 64M", Size(*size))]
    TooSmall { size: u64 },
    #[error("--memory {} is above the most this VM may have here, {}: {why}; lower --memory, or ask for the most with --memory max", Size(*size), Size(*max))]
    TooLarge { size: u64, max: u64, why: String },
    #[error("--memory {} is not a multiple of 2M; round it, e.g. to {}M", Size(*size), size.div_ceil(MEMORY_GRANULE) * 2)]
    Unaligned { size: u64 },
    #[error(
        "not enough free 2 MiB huge pages for {} of guest RAM: reserve {} more first (as root: sysctl vm.nr_hugepages=<the current value + that>), or run without --hugepages",
        Size(*size),
        size / (2 << 20)
    )]
    HugePages { size: u64 },
    #[error("cannot create the guest RAM memfd: {source}")]
    Memfd {
        #[source]
        source: std::io::Error,
    },
    #[error("cannot size the guest RAM memfd to {size} bytes: {source}")]
    Resize {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map {size} bytes of guest RAM at {gpa:#x}: {source}")]
    Map {
        gpa: u64,
        size: u64,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("guest RAM region at {gpa:#x} could not be registered")]
    Region { gpa: u64 },
    #[error("guest memory access of {len} bytes at {gpa:#x} failed: {source}")]
    Access {
        gpa: u64,
        len: usize,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

pub use ferry_migrate::ram::Size;

/// One contiguous range of guest RAM and where it lives on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRegion {
    pub gpa: u64,
    pub size: u64,
    /// Offset of this region in the memfd.
    pub file_offset: u64,
    /// Host virtual address of the mapping.
    pub host_addr: u64,
}

/// The RAM layout for `size` bytes: (guest address, size, file offset) per region.
pub fn layout(size: u64) -> Vec<(u64, u64, u64)> {
    let low = size.min(MMIO_HOLE_START);
    let mut regions = vec![(0, low, 0)];
    if size > low {
        regions.push((MMIO_HOLE_END, size - low, low));
    }
    regions
}

/// Checks a requested memory size before anything is allocated.
pub fn validate_size(size: u64) -> Result<(), MemoryError> {
    if size < MIN_MEMORY {
        return Err(MemoryError::TooSmall { size });
    }
    if size > MAX_MEMORY {
        return Err(MemoryError::TooLarge {
            size,
            max: MAX_MEMORY,
            why: format!(
                "ferry maps at most {} of guest addresses",
                Size(MAPPABLE_TOP)
            ),
        });
    }
    if !size.is_multiple_of(MEMORY_GRANULE) {
        return Err(MemoryError::Unaligned { size });
    }
    Ok(())
}

/// The pages the VMM wrote in one RAM region since the last take: `(w, bits)` in `words` says
/// that bit `i` of `bits` is the page at `gpa + (64 * w + i) * PAGE_SIZE`; the region has
/// `pages` pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteLog {
    pub gpa: u64,
    pub pages: u64,
    pub words: TakenWords,
}

impl WriteLog {
    /// Each taken word as `(gpa, pages, bits)`: the guest address of its first page, how many
    /// pages of the region it covers (64, or fewer at the region's end) and its bits.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let page = ferry_guest_abi::PAGE_SIZE;
        self.words.iter().map(move |&(w, bits)| {
            let first = w as u64 * 64;
            (self.gpa + first * page, (self.pages - first).min(64), bits)
        })
    }

    /// The guest addresses of the written pages, in order.
    pub fn written(&self) -> impl Iterator<Item = u64> + '_ {
        let page = ferry_guest_abi::PAGE_SIZE;
        self.runs().flat_map(move |(gpa, _, bits)| {
            (0..64)
                .filter(move |b| bits & (1 << b) != 0)
                .map(move |b| gpa + b * page)
        })
    }
}

/// Guest RAM backed by one memfd.
#[derive(Debug)]
pub struct GuestRam {
    memfd: File,
    size: u64,
    regions: Vec<RamRegion>,
    /// Every region's bitmap records the VMM's writes (see the module doc).
    memory: TrackedMemory,
    /// Whether a migration tracks dirty pages: [`GuestRam::take_writes`] reports only then.
    tracking: AtomicBool,
    /// Whether [`GuestRam::prealloc`] populated every page (a destination lands pages
    /// differently in populated RAM).
    populated: AtomicBool,
    /// Bytes the population under way populated so far ([`GuestRam::populated_bytes`]).
    populated_bytes: AtomicU64,
    pages: HostPages,
    /// The snapshot file RAM is mapped from, after a mapped restore (`memory/mapped.rs`).
    mapped: std::sync::OnceLock<Mapped>,
}

/// The snapshot file behind a mapped VM's RAM (`memory/mapped.rs`): open read-only for as
/// long as the VM lives, and each of the VM's regions' place in it, in region order.
#[derive(Debug)]
struct Mapped {
    file: File,
    regions: Vec<ferry_migrate::FileRegion>,
}

/// The host pages guest RAM is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostPages {
    /// 4 KiB pages of a memfd, allocated as the guest touches them.
    #[default]
    Small,
    /// 2 MiB hugetlbfs pages (`ferry run --hugepages`), reserved up front.
    Huge2M,
}

pub use crate::hugepages::HugePagePool;

impl GuestRam {
    /// Creates `size` bytes of sparse guest RAM in 4 KiB pages.
    pub fn new(size: u64) -> Result<GuestRam, MemoryError> {
        GuestRam::with_pages(size, HostPages::Small)
    }

    /// Creates `size` bytes of guest RAM backed by `pages`. Huge pages come from the host's
    /// hugetlbfs pool (`/proc/sys/vm/nr_hugepages`), reserved in full when RAM is mapped (so
    /// a short pool is an error here, not a crash when the guest touches its memory), and
    /// cannot be written through the memfd (a destination lands pages through the mapping).
    pub fn with_pages(size: u64, pages: HostPages) -> Result<GuestRam, MemoryError> {
        validate_size(size)?;
        let memfd = create_memfd(pages).map_err(|source| MemoryError::Memfd { source })?;
        memfd
            .set_len(size)
            .map_err(|source| MemoryError::Resize { size, source })?;
        seal_size(&memfd).map_err(|source| MemoryError::Resize { size, source })?;
        let flags = match pages {
            HostPages::Small => libc::MAP_SHARED | libc::MAP_NORESERVE,
            HostPages::Huge2M => libc::MAP_SHARED,
        };
        let mut regions = Vec::new();
        let mut mapped = Vec::new();
        for (gpa, len, file_offset) in layout(size) {
            let fd = memfd
                .try_clone()
                .map_err(|source| MemoryError::Memfd { source })?;
            let bitmap = WriteBitmap::new(len as usize);
            let map: MmapRegion<WriteBitmap> =
                MmapRegionBuilder::new_with_bitmap(len as usize, bitmap)
                    .with_file_offset(FileOffset::new(fd, file_offset))
                    .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                    .with_mmap_flags(flags)
                    .build()
                    .map_err(|source| match pages {
                        HostPages::Huge2M => MemoryError::HugePages { size },
                        HostPages::Small => MemoryError::Map {
                            gpa,
                            size: len,
                            source,
                        },
                    })?;
            regions.push(RamRegion {
                gpa,
                size: len,
                file_offset,
                host_addr: map.as_ptr() as u64,
            });
            mapped.push(
                GuestRegionMmap::new(map, GuestAddress(gpa)).ok_or(MemoryError::Region { gpa })?,
            );
        }
        let memory =
            TrackedMemory::from_regions(mapped).map_err(|_| MemoryError::Region { gpa: 0 })?;
        Ok(GuestRam {
            memfd,
            size,
            regions,
            memory,
            tracking: AtomicBool::new(false),
            populated: AtomicBool::new(false),
            populated_bytes: AtomicU64::new(0),
            pages,
            mapped: std::sync::OnceLock::new(),
        })
    }

    /// The host pages backing guest RAM.
    pub fn host_pages(&self) -> HostPages {
        self.pages
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// The vm-memory view, for loaders and devices. Writes through it are tracked like
    /// [`GuestRam::write`]'s: its regions carry the write bitmap.
    pub fn memory(&self) -> &TrackedMemory {
        &self.memory
    }

    /// The memfd that owns guest RAM.
    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// Host memory the guest's RAM occupies now: the memfd's allocated blocks.
    pub fn allocated_bytes(&self) -> std::io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.memfd.metadata()?.blocks() * 512)
    }

    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.memory
            .read_slice(buf, GuestAddress(gpa))
            .map_err(|source| MemoryError::Access {
                gpa,
                len: buf.len(),
                source,
            })
    }

    /// Writes guest memory from the VMM side; the pages are recorded (see the module doc).
    pub fn write(&self, gpa: u64, buf: &[u8]) -> Result<(), MemoryError> {
        self.memory
            .write_slice(buf, GuestAddress(gpa))
            .map_err(|source| MemoryError::Access {
                gpa,
                len: buf.len(),
                source,
            })
    }

    /// Returns `len` bytes of guest RAM at `gpa` (page aligned, inside one region) to the host:
    /// they read as zero afterwards and occupy no memory until touched again (mapped from a
    /// snapshot, those the file has data for hold zeros: `memory/mapped.rs`).
    pub fn punch_hole(&self, gpa: u64, len: u64) -> std::io::Result<()> {
        let index = self
            .regions
            .iter()
            .position(|r| gpa >= r.gpa && gpa + len <= r.gpa + r.size)
            .ok_or_else(|| {
                std::io::Error::other(format!("{len} bytes at {gpa:#x} are not in one RAM region"))
            })?;
        if let Some(m) = self.mapped.get() {
            return self.discard_mapped(m, index, gpa, len);
        }
        let r = &self.regions[index];
        // SAFETY: fallocate on our own memfd over a range inside this region; the mapping then
        // reads zeros there, which is the point.
        let ret = unsafe {
            libc::fallocate(
                self.memfd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                (r.file_offset + gpa - r.gpa) as libc::off_t,
                len as libc::off_t,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Populates every page of guest RAM ahead of need (QEMU's `-mem-prealloc`): a migration
    /// destination then copies incoming pages into memory that is already there instead of
    /// paying the first-touch cost per page inside the migration. `threads` threads share the
    /// work in `PREALLOC_CHUNK` pieces. Returns how long it took. The guest's RAM is no longer
    /// sparse afterwards: it occupies its full size on the host.
    pub fn prealloc(&self, threads: usize) -> std::io::Result<std::time::Duration> {
        let all: Vec<(u64, u64)> = self.regions.iter().map(|r| (r.gpa, r.size)).collect();
        let took = self.populate_ranges(&all, threads)?;
        self.populated.store(true, Ordering::Release);
        Ok(took)
    }

    /// Populates the guest ranges `(gpa, len)` (page aligned, each inside one region) as
    /// [`GuestRam::prealloc`] does, on `threads` threads; RAM still counts as sparse afterwards.
    /// Returns how long it took.
    pub fn populate_ranges(
        &self,
        ranges: &[(u64, u64)],
        threads: usize,
    ) -> std::io::Result<std::time::Duration> {
        let started = std::time::Instant::now();
        let mut chunks = Vec::new();
        for &(gpa, len) in ranges {
            let r = self
                .regions
                .iter()
                .find(|r| gpa >= r.gpa && gpa + len <= r.gpa + r.size)
                .ok_or_else(|| {
                    std::io::Error::other(format!(
                        "{len} bytes at {gpa:#x} are not in one RAM region"
                    ))
                })?;
            let host = r.host_addr + (gpa - r.gpa);
            chunks.extend(
                (0..len)
                    .step_by(PREALLOC_CHUNK as usize)
                    .map(|off| (host + off, PREALLOC_CHUNK.min(len - off))),
            );
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        self.populated_bytes.store(0, Ordering::Relaxed);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    scope.spawn(|| -> std::io::Result<()> {
                        while let Some(&(addr, len)) =
                            chunks.get(next.fetch_add(1, Ordering::Relaxed))
                        {
                            populate(addr, len)?;
                            self.populated_bytes.fetch_add(len, Ordering::Relaxed);
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("a prealloc thread panicked"))
        })?;
        Ok(started.elapsed())
    }

    /// Bytes the population under way (or the last one) has populated so far: the progress
    /// of [`GuestRam::prealloc`] for the control API.
    pub fn populated_bytes(&self) -> u64 {
        self.populated_bytes.load(Ordering::Relaxed)
    }

    /// The populated ranges of guest RAM as `(gpa, len)`, found with `SEEK_DATA`/`SEEK_HOLE`
    /// on the memfd: what a source could announce so that a destination populates exactly
    /// those ranges ahead of the data.
    pub fn data_extents(&self) -> std::io::Result<Vec<(u64, u64)>> {
        let mut extents = Vec::new();
        for r in &self.regions {
            let end = r.file_offset + r.size;
            let mut at = r.file_offset;
            while let Some((from, to)) =
                ferry_migrate::ram::next_data_in_file(self.memfd.as_raw_fd(), at, end)?
            {
                extents.push((r.gpa + from - r.file_offset, to - from));
                at = to;
            }
        }
        Ok(extents)
    }

    /// Whether [`GuestRam::prealloc`] populated all of RAM.
    pub fn is_populated(&self) -> bool {
        self.populated.load(Ordering::Acquire)
    }

    /// Starts or stops reporting the VMM's own writes to a migration. Starting forgets what
    /// was written before, as the dirty log starts empty (pass 1 reads every populated page
    /// after tracking starts).
    pub fn track_writes(&self, on: bool) {
        if on {
            for region in self.memory.iter() {
                bitmap(region).take();
            }
        }
        self.tracking.store(on, Ordering::Release);
    }

    /// Fetch-and-clear of the VMM's writes since the last call, one log per RAM region (none
    /// when not tracking). A write that lands during the take is either in this take or the
    /// next (see `writes.rs`), and a write's bit is set after its bytes are in memory. Costs
    /// what was written: the take walks a summary of 1/64 of the bits.
    pub fn take_writes(&self) -> Vec<WriteLog> {
        if !self.tracking.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.memory
            .iter()
            .map(|region| WriteLog {
                gpa: region.start_addr().0,
                pages: region.len() / ferry_guest_abi::PAGE_SIZE,
                words: bitmap(region).take(),
            })
            .collect()
    }
}

/// A piece of preallocation work: 64 MiB is ~16,000 pages (tens of ms at the 2-3 µs a first
/// touch costs), small enough that threads finish together and large enough that handing out
/// chunks costs nothing.
const PREALLOC_CHUNK: u64 = 64 << 20;

/// Allocates and maps `len` bytes of guest RAM at host address `addr` as if written, without
/// changing a byte (`MADV_POPULATE_WRITE`, Linux 5.14).
///
/// Why this and not `fallocate` of the memfd: measured on the project's machine for 1 GiB
/// (one thread), `fallocate` costs 1.6 µs a page but a copy into the page afterwards still
/// costs 2.6 µs (the mapping faults); `MADV_POPULATE_WRITE` costs 3.8 µs a page and a copy
/// afterwards 0.45 µs, against 4.0 µs for a copy into untouched memory. Only populating the
/// mapping takes the first-touch cost out of the migration.
fn populate(addr: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: `addr..addr + len` lies inside one of GuestRam's live, writable mappings (the
    // caller iterates its regions); MADV_POPULATE_WRITE only faults pages in and writes no data.
    let ret = unsafe {
        libc::madvise(
            addr as *mut libc::c_void,
            len as usize,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if ret != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The write bitmap of one vm-memory region (the mapping's own, not the trait's slice view).
fn bitmap(region: &GuestRegionMmap<WriteBitmap>) -> &WriteBitmap {
    let map: &MmapRegion<WriteBitmap> = region;
    map.bitmap()
}

/// Seals guest RAM's memfd against shrinking (`F_SEAL_SHRINK`; punching holes stays
/// allowed): a process that maps it, as a local handover's destination does, can then trust its
/// size, and no one holding it can make the mapping fault (SIGBUS) by truncating it.
fn seal_size(memfd: &File) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this function borrows; F_ADD_SEALS takes an int.
    let r = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `file` is sealed against shrinking.
pub(crate) fn size_sealed(file: &File) -> bool {
    // SAFETY: fcntl on a descriptor this function borrows; F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}

fn create_memfd(pages: HostPages) -> std::io::Result<File> {
    // Sealable, so that guest RAM can be sealed against shrinking once sized (`seal_size`).
    let flags = match pages {
        HostPages::Small => libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        HostPages::Huge2M => {
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB
        }
    };
    // SAFETY: memfd_create takes a NUL-terminated name and flags and returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"ferry-guest-ram".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a freshly created descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    debug_assert!(owned.as_raw_fd() >= 0);
    Ok(File::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// The pages [`GuestRam::take_writes`] reports, in address order.
    fn written(ram: &GuestRam) -> Vec<u64> {
        ram.take_writes()
            .iter()
            .flat_map(WriteLog::written)
            .collect()
    }

    #[test]
    fn small_guest_is_one_region() {
        assert_eq!(layout(2 * GIB), vec![(0, 2 * GIB, 0)]);
        assert_eq!(layout(3 * GIB), vec![(0, 3 * GIB, 0)]);
    }

    #[test]
    fn large_guest_continues_above_the_hole() {
        assert_eq!(
            layout(8 * GIB),
            vec![(0, 3 * GIB, 0), (4 * GIB, 5 * GIB, 3 * GIB)]
        );
    }

    #[test]
    fn sizes_are_validated() {
        assert!(matches!(
            validate_size(32 << 20),
            Err(MemoryError::TooSmall { .. })
        ));
        assert!(matches!(
            validate_size(MAX_MEMORY + MEMORY_GRANULE),
            Err(MemoryError::TooLarge { .. })
        ));
        assert!(matches!(
            validate_size((64 << 20) + 4096),
            Err(MemoryError::Unaligned { .. })
        ));
        assert!(validate_size(64 << 20).is_ok());
        let msg = validate_size(100 << 20 | 1 << 20).unwrap_err().to_string();
        assert!(
            msg.contains("multiple of 2M") && msg.contains("102M"),
            "{msg}"
        );
    }

    #[test]
    fn ram_is_sparse_until_touched_and_reads_back() {
        let ram = GuestRam::new(8 * GIB).unwrap();
        assert_eq!(ram.regions().len(), 2);
        assert!(ram.allocated_bytes().unwrap() < (1 << 20));
        ram.write(5 * GIB, b"above the hole").unwrap();
        ram.write(4096, b"low").unwrap();
        let mut buf = [0u8; 14];
        ram.read(5 * GIB, &mut buf).unwrap();
        assert_eq!(&buf, b"above the hole");
        let allocated = ram.allocated_bytes().unwrap();
        assert!((8192..(1 << 20)).contains(&allocated), "{allocated}");
        assert!(written(&ram).is_empty(), "not tracking");
        ram.track_writes(true);
        ram.write(5 * GIB + 4000, &[1; 200]).unwrap();
        assert_eq!(written(&ram), vec![5 * GIB, 5 * GIB + 4096]);
        assert!(written(&ram).is_empty());
        assert!(
            ram.read(3 * GIB + 4096, &mut buf).is_err(),
            "the MMIO hole is not RAM"
        );
    }

    /// Item 7 of the seams issue: a write through the vm-memory view (as a loader or a device
    /// makes it) is recorded like one through `GuestRam::write`, and starting to track forgets
    /// the writes made before.
    #[test]
    fn prealloc_populates_every_page_and_keeps_contents() {
        let ram = GuestRam::new(MIN_MEMORY).unwrap();
        ram.write(0x5000, b"kept").unwrap();
        assert!(ram.allocated_bytes().unwrap() < MIN_MEMORY / 2);
        ram.prealloc(2).unwrap();
        assert_eq!(ram.allocated_bytes().unwrap(), MIN_MEMORY);
        let mut b = [0u8; 4];
        ram.read(0x5000, &mut b).unwrap();
        assert_eq!(&b, b"kept");
    }

    #[test]
    fn writes_through_the_vm_memory_view_are_tracked() {
        let ram = GuestRam::new(64 << 20).unwrap();
        ram.memory()
            .write_obj(0x1234_5678u32, GuestAddress(0x3000))
            .unwrap();
        ram.track_writes(true);
        assert!(
            written(&ram).is_empty(),
            "writes before tracking are forgotten"
        );
        ram.memory()
            .write_obj(0xdead_beefu32, GuestAddress(0x7ffe))
            .unwrap();
        ram.memory()
            .get_slice(GuestAddress(0x20000), 1)
            .unwrap()
            .write_obj(7u8, 0)
            .unwrap();
        assert_eq!(written(&ram), vec![0x7000, 0x8000, 0x20000]);
        let logs = ram.take_writes();
        assert_eq!(logs.len(), 1, "one log per region");
        assert_eq!((logs[0].gpa, logs[0].pages), (0, (64 << 20) / 4096));
        ram.track_writes(false);
        ram.write(0x5000, &[1]).unwrap();
        assert!(ram.take_writes().is_empty(), "not tracking");
    }
}
