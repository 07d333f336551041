//! A fake VMM for testing ferry's migration engine without `/dev/kvm`: guest RAM in a memfd
//! (so holes and `SEEK_DATA` behave as with a real VMM), writer threads that play the guest,
//! and a software dirty log with KVM's semantics (starts empty, fetch-and-clear).
//!
//! Writers write a page and then mark it; the engine's fetch clears a bit before it copies
//! the page. So a write that races a fetch is either seen by that copy or stays marked for
//! the next pass, exactly the guarantee write-protection gives a real dirty log.
//!
//! [`craft`] builds hand-made protocol bytes for tests that play a broken source;
//! [`loopback`] runs a whole migration between two fake VMs over loopback TCP; [`proxy`] is a
//! TCP proxy a test breaks on purpose. [`stranger`] starts the test binary again as another
//! uid (`nobody`), for the local handover's peer checks.
//! [`fuzz`] is the harness of the fuzz targets in `fuzz/` and of their regression tests.
//! [`conformance`] is the suite a VMM instantiates to check its [`SourceVm`] and
//! [`DestinationVm`](ferry_migrate::DestinationVm) against the contracts the engine relies on;
//! `tests/conformance.rs` runs it on this fake. The fake as a source is here, as a destination
//! in `destination.rs`.

pub mod all_set;
mod balloon;
pub mod conformance;
pub mod craft;
mod destination;
pub mod device_files;
pub mod disk;
pub mod fuzz;
pub mod loopback;
pub mod netns;
pub mod proxy;
pub mod stranger;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use balloon::FakeBalloon;
pub use balloon::HintReport;
use ferry_migrate::bitmap::DirtyBitmap;
use ferry_migrate::ram::RamRegion;
use ferry_migrate::wire::{PAGE_SIZE, SectionId};

/// The fake VM's one kind of device state (the number is the fake VMM's own choice).
pub const FAKE_VCPU: SectionId = SectionId(1);
use ferry_migrate::{PageLanding, Section, SourceVm, VmError};

/// The version of the fake's one section (a vCPU named by a few bytes).
pub const FAKE_STATE_VERSION: u32 = 1;

/// Guest RAM: a memfd mapped shared, split into regions with a gap between them (like RAM
/// around a PC's MMIO hole).
#[derive(Debug)]
struct FakeRam {
    fd: OwnedFd,
    base: usize,
    size: u64,
    regions: Vec<RamRegion>,
}

// SAFETY: the mapping is plain shared memory; all access goes through raw pointers with
// page-granular, atomics-ordered protocols documented where used.
unsafe impl Send for FakeRam {}
// SAFETY: as above.
unsafe impl Sync for FakeRam {}

impl FakeRam {
    fn new(size: u64, regions: usize) -> FakeRam {
        assert!(size.is_multiple_of(PAGE_SIZE * regions as u64));
        // SAFETY: memfd_create with a valid name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"ferry-fake-ram".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fd is new and owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own fd.
        let resized = unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) };
        assert_eq!(resized, 0);
        // SAFETY: a fresh shared mapping of the whole file; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let per = size / regions as u64;
        let regions = (0..regions as u64)
            .map(|i| RamRegion {
                // A 1 GiB gap after every region, so addresses are not simply offsets.
                gpa: i * (per + (1 << 30)),
                size: per,
                host_addr: base as usize + (i * per) as usize,
                fd: fd.as_raw_fd(),
                file_offset: i * per,
            })
            .collect();
        FakeRam {
            fd,
            base: base as usize,
            size,
            regions,
        }
    }

    /// The host address of guest page `index` (counting pages across regions).
    fn page_ptr(&self, index: u64) -> *mut u64 {
        (self.base + (index * PAGE_SIZE) as usize) as *mut u64
    }

    /// The region holding the `pages` pages from `gpa` and the first one's page index
    /// (counting across regions), or why there is none.
    fn locate(&self, operation: &'static str, gpa: u64, pages: u64) -> Result<u64, VmError> {
        let fail = |message: String| VmError::failed(operation, message);
        let (i, r) = self
            .regions
            .iter()
            .enumerate()
            .find(|(_, r)| gpa >= r.gpa && gpa < r.gpa + r.size)
            .ok_or_else(|| fail(format!("{gpa:#x} is not RAM")))?;
        let first = (gpa - r.gpa) / PAGE_SIZE;
        if pages > r.size / PAGE_SIZE - first {
            return Err(fail(format!(
                "{pages} pages at {gpa:#x} run past the end of their region"
            )));
        }
        Ok(i as u64 * (r.size / PAGE_SIZE) + first)
    }

    fn pages(&self) -> u64 {
        self.size / PAGE_SIZE
    }

    /// A copy of all of guest RAM.
    fn contents(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.size as usize];
        // SAFETY: reads the whole mapping; callers only do so with writers paused.
        unsafe { std::ptr::copy_nonoverlapping(self.base as *const u8, v.as_mut_ptr(), v.len()) };
        v
    }
}

impl Drop for FakeRam {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `new`; nothing uses it any more.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.size as usize) };
        let _ = &self.fd;
    }
}

#[derive(Debug)]
struct Shared {
    ram: FakeRam,
    /// Writers hold it shared while writing and marking a page; pause takes it exclusively.
    gate: RwLock<()>,
    paused: AtomicBool,
    stop: AtomicBool,
    logging: AtomicBool,
    dirty: Vec<AtomicU64>,
    writes: AtomicU64,
    /// Auto-converge's throttle, percent: each writer sleeps that share of its time.
    throttle: AtomicU8,
    /// Free pages and free page hints (absent unless a test attaches it).
    balloon: FakeBalloon,
    /// Pages the balloon's driver writes at the start of every round of hints (its buffers,
    /// the used ring), as a real driver does: the last pages of RAM.
    round_writes: AtomicU64,
    /// Pages written at every dirty sync while the guest runs (see [`FakeVm::writes_per_sync`]),
    /// and the syncs that wrote them so far.
    sync_writes: AtomicU64,
    syncs: AtomicU64,
}

impl Shared {
    fn mark(&self, index: u64) {
        if self.logging.load(Ordering::Acquire) {
            self.dirty[(index / 64) as usize].fetch_or(1 << (index % 64), Ordering::AcqRel);
        }
    }
}

/// How the fake guest writes.
#[derive(Clone, Copy, Debug)]
pub struct Writers {
    pub threads: usize,
    pub seed: u64,
    /// Percent of writes that store zeros over the whole page.
    pub zero_percent: u8,
    /// Pause between writes, per thread (`ZERO` = flat out).
    pub interval: Duration,
}

/// The fake VM.
#[derive(Debug)]
pub struct FakeVm {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// The device state it reports (source) or loaded (destination).
    pub state: Vec<Section>,
    pub resumed: bool,
    /// How a migration into this VM lands its pages (the engine tests run both).
    pub landing: PageLanding,
    /// Why a postcopy migration gave this destination up after it resumed, if it did.
    pub abandoned: Option<String>,
    /// A device with large state (`disk.rs`), when a test adds one.
    pub disk: Option<Arc<disk::FakeDisk>>,
    /// Devices' open files, which a local handover may pass (`device_files.rs`).
    pub devices: device_files::DeviceFiles,
}

impl FakeVm {
    /// `size` bytes of RAM in `regions` equal regions, all holes.
    pub fn new(size: u64, regions: usize) -> FakeVm {
        let ram = FakeRam::new(size, regions);
        let words = ram.pages().div_ceil(64) as usize;
        FakeVm {
            shared: Arc::new(Shared {
                ram,
                gate: RwLock::new(()),
                paused: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                logging: AtomicBool::new(false),
                dirty: (0..words).map(|_| AtomicU64::new(0)).collect(),
                writes: AtomicU64::new(0),
                throttle: AtomicU8::new(0),
                balloon: FakeBalloon::new(size / PAGE_SIZE),
                round_writes: AtomicU64::new(0),
                sync_writes: AtomicU64::new(0),
                syncs: AtomicU64::new(0),
            }),
            threads: Vec::new(),
            // Two instances of one section kind, as a VM with two vCPUs has: every migration
            // test then checks that the engine keeps instances apart.
            state: (0..2)
                .map(|instance| Section {
                    id: FAKE_VCPU,
                    instance,
                    version: FAKE_STATE_VERSION,
                    data: format!("fake vcpu {instance}").into_bytes(),
                })
                .collect(),
            resumed: false,
            // The fake's RAM is sparse, which is what `File` is for.
            landing: PageLanding::File,
            abandoned: None,
            disk: None,
            devices: Default::default(),
        }
    }

    /// Adds a disk of `bytes` ([`disk::FakeDisk`]): its state goes as iterative state.
    pub fn add_disk(&mut self, bytes: u64) -> Arc<disk::FakeDisk> {
        let d = Arc::new(disk::FakeDisk::new(bytes));
        self.disk = Some(d.clone());
        d
    }

    /// Starts a thread that rewrites a block of the disk every `interval` while the guest
    /// runs (holding the gate, so a pause waits for a write in flight).
    pub fn start_disk_writer(&mut self, seed: u64, interval: Duration) {
        let (shared, disk) = (self.shared.clone(), self.disk.clone().expect("a disk"));
        self.threads.push(std::thread::spawn(move || {
            let mut x = seed | 1;
            while !shared.stop.load(Ordering::Relaxed) {
                if !shared.paused.load(Ordering::Acquire) {
                    let _g = shared.gate.read().unwrap();
                    if !shared.paused.load(Ordering::Acquire) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        disk.write((x % disk.block_count() as u64) as usize, x);
                    }
                }
                std::thread::sleep(interval);
            }
        }));
    }

    /// On a destination: starts writer threads that wait until a migration resumes this VM
    /// (postcopy: they then write pages that may not have arrived yet, and fault), and records
    /// the pages they write ([`FakeVm::pages_written_here`]).
    pub fn start_writers_on_resume(&mut self, w: Writers) {
        self.shared.paused.store(true, Ordering::Release);
        for d in &self.shared.dirty {
            d.store(0, Ordering::Release);
        }
        self.shared.logging.store(true, Ordering::Release);
        self.start_writers(w);
    }

    /// The page indices (counting across regions) written since
    /// [`FakeVm::start_writers_on_resume`].
    pub fn pages_written_here(&self) -> Vec<u64> {
        (0..self.shared.ram.pages())
            .filter(|&i| {
                self.shared.dirty[(i / 64) as usize].load(Ordering::Acquire) & (1 << (i % 64)) != 0
            })
            .collect()
    }

    /// After a postcopy migration from `src` (paused) into this VM: stops this VM's writers and
    /// checks every page its guest did not write against `src`'s last version; returns how
    /// many pages were compared, and panics naming the first that differs.
    pub fn assert_holds_the_last_version_of(&mut self, src: &FakeVm) -> usize {
        self.stop_writers();
        let page = PAGE_SIZE as usize;
        let written_here = self.pages_written_here();
        let (a, b) = (src.contents(), self.contents());
        let mut written = vec![false; a.len() / page];
        for &i in &written_here {
            written[i as usize] = true;
        }
        assert!(!written_here.is_empty(), "the destination's guest ran");
        let mut compared = 0;
        for (i, here) in written.iter().enumerate() {
            if *here {
                continue;
            }
            let range = i * page..(i + 1) * page;
            assert!(
                a[range.clone()] == b[range],
                "page {i} differs from the source's last version"
            );
            compared += 1;
        }
        compared
    }

    /// Stops the writer threads and waits for them.
    pub fn stop_writers(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Populates every `stride`-th page with a recognisable pattern (before any writer runs).
    pub fn fill(&self, stride: u64) {
        for i in (0..self.shared.ram.pages()).step_by(stride as usize) {
            write_page(&self.shared, i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        }
    }

    /// Starts writer threads that play the guest.
    pub fn start_writers(&mut self, w: Writers) {
        for t in 0..w.threads {
            let shared = self.shared.clone();
            self.threads
                .push(std::thread::spawn(move || writer(&shared, w, t as u64)));
        }
    }

    pub fn writes(&self) -> u64 {
        self.shared.writes.load(Ordering::Relaxed)
    }

    pub fn is_paused(&self) -> bool {
        self.shared.paused.load(Ordering::Acquire)
    }

    /// The throttle a migration set, percent.
    pub fn throttle(&self) -> u8 {
        self.shared.throttle.load(Ordering::Relaxed)
    }

    pub fn is_logging(&self) -> bool {
        self.shared.logging.load(Ordering::Acquire)
    }

    /// All of guest RAM (take it while paused, or on a destination).
    pub fn contents(&self) -> Vec<u8> {
        let _g = self.shared.gate.write().unwrap();
        self.shared.ram.contents()
    }

    /// Writes `bytes` at `gpa` as the VMM itself would (a device, a loader) and marks the
    /// pages, whether or not the guest is paused.
    pub fn write(&self, gpa: u64, bytes: &[u8]) -> Result<(), VmError> {
        let page_count = (gpa % PAGE_SIZE + bytes.len() as u64).div_ceil(PAGE_SIZE);
        let first = self
            .shared
            .ram
            .locate("write", gpa / PAGE_SIZE * PAGE_SIZE, page_count)?;
        let host = self.shared.ram.page_ptr(first) as usize + (gpa % PAGE_SIZE) as usize;
        // SAFETY: `locate` checked that the bytes lie inside one region of the mapping; writers
        // may race on a page, which is fine for plain bytes through raw pointers.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host as *mut u8, bytes.len()) };
        for index in first..first + page_count {
            self.shared.mark(index);
        }
        Ok(())
    }

    /// Gives the VM a balloon that hints free pages (without one, hinting is unsupported):
    /// a round's hints arrive at `pages_per_ms`, as a guest's hints trickle in.
    pub fn attach_balloon(&self, pages_per_ms: u64) {
        self.shared.balloon.attach(pages_per_ms);
    }

    /// Makes every round of hints write `pages` pages, as a real driver writes its buffers and
    /// used ring while it reports: the last `pages` pages of RAM, stamped with the round, so
    /// each round dirties them again and a destination must hold the last round's stamp.
    pub fn balloon_writes_per_round(&self, pages: u64) {
        self.shared.round_writes.store(pages, Ordering::Relaxed);
    }

    /// Makes every dirty sync while the guest runs find `pages` pages written since the one
    /// before (a window that moves on each time, stamped with the sync), whether or not the
    /// writer threads got a core meanwhile: a guest that no loaded machine makes look idle.
    pub fn writes_per_sync(&self, pages: u64) {
        self.shared.sync_writes.store(pages, Ordering::Relaxed);
    }

    /// The guest frees `count` pages from page index `first` (counting across regions),
    /// leaving stale content in them as a real guest does (before any writer runs).
    pub fn free_pages(&self, first: u64, count: u64) {
        for i in first..first + count {
            write_page(&self.shared, i, i.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
            self.shared.balloon.free(i);
        }
    }

    /// What the balloon did.
    pub fn hint_report(&self) -> HintReport {
        self.shared.balloon.report()
    }

    /// After a migration from this VM (paused) into `dst`: every page the guest does not hold
    /// free now is equal on both; returns how many were compared, and panics naming the first
    /// that differs. (Free pages may differ: a hinted page is not sent.)
    pub fn assert_in_use_pages_equal(&self, dst: &FakeVm) -> u64 {
        let page = PAGE_SIZE as usize;
        let (a, b) = (self.contents(), dst.contents());
        let mut compared = 0;
        for i in 0..self.shared.ram.pages() {
            if self.shared.balloon.is_free(i) {
                continue;
            }
            let range = i as usize * page..(i as usize + 1) * page;
            assert!(a[range.clone()] == b[range], "in-use page {i} differs");
            compared += 1;
        }
        compared
    }

    /// Host memory the RAM occupies (the memfd's allocated bytes).
    pub fn allocated_bytes(&self) -> u64 {
        let mut st: libc::stat = unsafe_zeroed_stat();
        // SAFETY: fstat on our own fd into a valid stat buffer.
        unsafe { libc::fstat(self.shared.ram.fd.as_raw_fd(), &mut st) };
        st.st_blocks as u64 * 512
    }
}

fn unsafe_zeroed_stat() -> libc::stat {
    // SAFETY: libc::stat is plain old data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

fn write_page(shared: &Shared, index: u64, value: u64) {
    let p = shared.ram.page_ptr(index);
    // SAFETY: `index` is a page of the mapping; writers may race each other on a page, which
    // is fine for plain u64 stores through raw pointers (no references are formed).
    unsafe {
        if value == 0 {
            std::ptr::write_bytes(p as *mut u8, 0, PAGE_SIZE as usize);
        } else {
            p.write_volatile(value);
            p.add(17).write_volatile(!value);
            p.add(511).write_volatile(value.rotate_left(7));
        }
    }
}

fn writer(shared: &Shared, w: Writers, id: u64) {
    let mut x = w.seed ^ (id + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let pages = shared.ram.pages();
    while !shared.stop.load(Ordering::Relaxed) {
        if shared.paused.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        let started = std::time::Instant::now();
        {
            let _g = shared.gate.read().unwrap();
            if shared.paused.load(Ordering::Acquire) {
                continue;
            }
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let index = x % pages;
                let value = if (x >> 40) % 100 < u64::from(w.zero_percent) {
                    0
                } else {
                    x | 1
                };
                // Allocated before it is written, as a guest does: a page being written is
                // never hinted as free.
                shared.balloon.written(index);
                write_page(shared, index, value);
                shared.mark(index);
                shared.writes.fetch_add(1, Ordering::Relaxed);
            }
        }
        if !w.interval.is_zero() {
            std::thread::sleep(w.interval);
        }
        // Throttled as a VMM throttles a vCPU: asleep `percent` of the time.
        let percent = u32::from(shared.throttle.load(Ordering::Relaxed).min(99));
        if percent > 0 {
            std::thread::sleep(started.elapsed() * percent / (100 - percent));
        }
    }
}

impl Drop for FakeVm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// SAFETY: `ram()` describes the memfd mapping owned by `shared`, which lives as long as self.
unsafe impl SourceVm for FakeVm {
    fn ram(&self) -> Vec<RamRegion> {
        self.shared.ram.regions.clone()
    }

    fn device_fds(&self) -> Result<Vec<ferry_migrate::DeviceFd>, VmError> {
        self.devices.passed()
    }

    fn start_dirty_log(&mut self) -> Result<(), VmError> {
        for w in &self.shared.dirty {
            w.store(0, Ordering::Release);
        }
        self.shared.logging.store(true, Ordering::Release);
        Ok(())
    }

    fn fetch_dirty(&mut self, into: &mut DirtyBitmap) -> Result<(), VmError> {
        let n = self.shared.sync_writes.load(Ordering::Relaxed);
        if n > 0 && !self.shared.paused.load(Ordering::Acquire) {
            let pages = self.shared.ram.pages();
            let sync = self.shared.syncs.fetch_add(1, Ordering::Relaxed);
            let _g = self.shared.gate.read().unwrap();
            for k in 0..n.min(pages) {
                let index = (sync * n + k) % pages;
                write_page(&self.shared, index, (sync + 1) << 32 | index | 1);
                self.shared.mark(index);
            }
        }
        let regions = &self.shared.ram.regions;
        let per_words = (regions[0].size / PAGE_SIZE / 64) as usize;
        for (i, r) in regions.iter().enumerate() {
            let words: Vec<u64> = self.shared.dirty[i * per_words..(i + 1) * per_words]
                .iter()
                .map(|w| w.swap(0, Ordering::AcqRel))
                .collect();
            into.merge_at(r.gpa, r.size / PAGE_SIZE, &words)
                .map_err(|e| VmError::failed("fetch_dirty", e))?;
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) {
        self.shared.logging.store(false, Ordering::Release);
    }

    fn pause(&mut self) -> Result<(), VmError> {
        self.shared.paused.store(true, Ordering::Release);
        // Wait for writes in flight: they hold the gate shared until their pages are marked.
        drop(self.shared.gate.write().unwrap());
        Ok(())
    }

    fn resume(&mut self) -> Result<(), VmError> {
        self.shared.paused.store(false, Ordering::Release);
        Ok(())
    }

    fn set_throttle(&mut self, percent: u8) -> Result<(), VmError> {
        self.shared.throttle.store(percent, Ordering::Relaxed);
        Ok(())
    }

    fn save_state(&mut self) -> Result<Vec<Section>, VmError> {
        let mut sections = self.state.clone();
        if let Some(disk) = &self.disk {
            sections.extend(disk.sections()?);
        }
        Ok(sections)
    }

    fn start_state_iteration(&mut self) -> Result<u64, VmError> {
        match &self.disk {
            Some(disk) => Ok(disk.start()),
            None => Err(VmError::Unsupported {
                operation: "iterative device state",
            }),
        }
    }

    fn next_state_chunk(&mut self, max_bytes: usize) -> Result<Option<Section>, VmError> {
        self.disk_or_unsupported()?.next_chunk(max_bytes)
    }

    fn pending_state_bytes(&self) -> Result<u64, VmError> {
        self.disk_or_unsupported()?.pending_bytes()
    }

    fn state_allowance(&mut self, bytes: u64) {
        if let Some(disk) = &self.disk {
            disk.set_allowance(bytes);
        }
    }

    fn end_state_iteration(&mut self) {
        if let Some(disk) = &self.disk {
            disk.end();
        }
    }

    fn start_hints(&mut self) -> Result<(), VmError> {
        let present = self.shared.balloon.start(&self.shared.ram.regions);
        if present {
            let pages = self.shared.ram.pages();
            let round = u64::from(self.shared.balloon.report().rounds);
            for index in pages - self.shared.round_writes.load(Ordering::Relaxed)..pages {
                let _g = self.shared.gate.read().unwrap();
                write_page(&self.shared, index, round << 32 | index | 1);
                self.shared.mark(index);
            }
        }
        balloon_call(present)
    }

    fn stop_hints(&mut self) -> Result<(), VmError> {
        balloon_call(self.shared.balloon.stop())
    }

    fn take_hints(&mut self, into: &mut Vec<(u64, u64)>) -> Result<(), VmError> {
        balloon_call(self.shared.balloon.take(into))
    }

    fn finish_hints(&mut self) -> Result<(), VmError> {
        balloon_call(self.shared.balloon.finish())
    }
}

impl FakeVm {
    /// The disk, or the answer of a VM without one.
    fn disk_or_unsupported(&self) -> Result<&disk::FakeDisk, VmError> {
        self.disk.as_deref().ok_or(VmError::Unsupported {
            operation: "iterative device state",
        })
    }
}

/// A balloon call's answer: unsupported without a balloon, as a VMM without one answers.
fn balloon_call(present: bool) -> Result<(), VmError> {
    match present {
        true => Ok(()),
        false => Err(VmError::Unsupported {
            operation: "free page hinting",
        }),
    }
}

/// Runs `f` while another thread reads `control`'s progress every 5 ms, as a watcher of
/// `GET /migration` would; returns every progress read, with `f`'s result.
pub fn watching<T: Send>(
    control: &ferry_migrate::Control,
    f: impl FnOnce() -> T + Send,
) -> (Vec<ferry_migrate::Progress>, T) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut seen = Vec::new();
            while !done.load(Ordering::Relaxed) {
                seen.push(control.progress());
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        let result = f();
        done.store(true, Ordering::Relaxed);
        (watcher.join().expect("the watcher"), result)
    })
}
