//! Restores from a snapshot file into a [`DestinationVm`]: the destination's half with a file
//! as its origin. Everything checksummed is checked before it is used: the header, the
//! configuration, the device state, the hot set and the page CRC table when the file opens,
//! and each page against its CRC as it is read.
//!
//! - **Eager** ([`Loading::Eager`]): reader threads read the file's data runs (holes are zero
//!   pages, which fresh guest RAM already is) into guest RAM, then the state is loaded and the
//!   guest resumes.
//! - **Lazy** ([`Loading::Lazy`]): guest RAM is registered with userfaultfd, the state is
//!   loaded and the guest resumes at once; a fault thread serves each page the guest touches
//!   from the file (with the rest of its hot run when it is in the hot set: the guest touches
//!   those next), and loader threads place the rest, the hot set first. Once every data
//!   run is placed the userfaultfd is closed: what is still missing then is a hole, which
//!   reads as zeros.
//! - **Mapped** ([`Loading::Mapped`]): nothing of RAM is read. The VMM maps the file's RAM
//!   area copy-on-write in place of its own ([`DestinationVm::map_file`]), the state is loaded
//!   and the guest resumes; its pages come from the page cache on first touch, shared by
//!   every VM mapped from the file. Its pages are not checked against their CRCs (`map.rs`).
//!
//! Invariants: nothing of the file reaches guest RAM before its CRC matched (but for a mapped
//! restore, which says so); the guest never
//! resumes before every section was loaded. A page that fails its CRC while the guest runs
//! (lazy) fails the loader, and the VMM stops the guest ([`LazyLoad::wait`] says why): its
//! memory is incomplete. So does a read of the file that has not returned within
//! [`RestoreParams::read_deadline`] (storage that hangs): the guest is stopped with the cause
//! instead of its vCPUs waiting on the storage for ever, silently; the blocked threads are let
//! go, and end when their reads return.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::error::SnapshotError;
use super::format::Limits;
use super::read::Reader;
use super::state;
use crate::error::{ConfigError, Internal, MigrateError};
use crate::pagebits::PageBits;
use crate::ram::Ram;
use crate::uffd::{CopyOutcome, Fault, Faults, Uffd, Wake};
use crate::vm::DestinationVm;
use crate::wire::{self, PAGE_SIZE};

/// Pages per read: 2 MiB.
const RUN_PAGES: u64 = wire::MAX_PAGES_PER_RECORD as u64;
/// How long the fault thread waits for a fault before it looks at whether to stop.
const FAULT_POLL: Duration = Duration::from_millis(5);
/// The default [`RestoreParams::read_deadline`]: 30 s, thousands of times a healthy disk's
/// slowest 2 MiB read, and about what a guest's own storage stack waits before it gives up on
/// a request (Linux's SCSI command timeout is 30 s).
pub const DEFAULT_READ_DEADLINE: Duration = Duration::from_secs(30);
/// How often a lazy restore's waiter looks for an overdue read.
const WATCH_POLL: Duration = Duration::from_millis(20);

/// When guest RAM is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Loading {
    /// All of it before the guest resumes.
    Eager,
    /// On demand and in the background after the guest resumed.
    Lazy,
    /// Never: guest RAM is the file, mapped copy-on-write ([`DestinationVm::map_file`]).
    Mapped,
}

/// How to restore.
#[derive(Clone, Copy, Debug)]
pub struct RestoreParams {
    pub loading: Loading,
    /// Reader threads (eager).
    pub readers: u16,
    /// The VM's vCPU count: a snapshot of another count is refused.
    pub vcpus: u32,
    /// Lazy: load the hot set first (off only to measure what it saves).
    pub hot_first: bool,
    /// Lazy: a read of the file that has not returned after this long stops the guest with
    /// the cause ([`DEFAULT_READ_DEADLINE`]).
    pub read_deadline: Duration,
    /// For tests: every read of the file sleeps this long first, standing for storage that
    /// hangs (there is no portable way to make a real file's reads hang).
    #[doc(hidden)]
    pub read_delay: Option<Duration>,
}

/// What a restore took.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RestoreStats {
    /// Opening the file and checking its metadata and every CRC but the pages'.
    pub open_ms: f64,
    /// Eager: reading guest RAM in; mapped: mapping it (0 for a lazy restore).
    pub ram_ms: f64,
    pub state_load_ms: f64,
    pub resume_ms: f64,
    /// From the call to the guest running.
    pub to_running_ms: f64,
    /// Eager: bytes of page data read (holes are not read).
    pub bytes_read: u64,
    pub memory_bytes: u64,
}

/// What a lazy restore's loading took, once all of RAM is in place.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LazyStats {
    /// From the guest's resume to the last data run placed.
    pub load_ms: f64,
    pub bytes_read: u64,
    /// Pages the guest touched before the loader had placed them, served from the file.
    pub demand_faults: u64,
    /// Pages of the hot set.
    pub hot_pages: u64,
    /// Mean time from reading a fault to the page placed.
    pub fault_mean_us: f64,
}

/// A restore whose guest runs.
#[derive(Debug)]
pub struct Restored {
    pub stats: RestoreStats,
    /// The background load of a lazy restore.
    pub lazy: Option<LazyLoad>,
}

/// A lazy restore's loading in the background.
#[derive(Debug)]
pub struct LazyLoad {
    shared: Arc<Lazy>,
    loader: JoinHandle<Result<(), MigrateError>>,
    faults: JoinHandle<Result<(), MigrateError>>,
    resumed: Instant,
}

impl LazyLoad {
    /// Whether all of RAM is in place.
    pub fn is_done(&self) -> bool {
        self.loader.is_finished()
    }

    /// Stops the loading of a guest that will not run (its resume failed).
    fn cancel(self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = (join(self.loader), join(self.faults));
    }

    /// Waits until all of RAM is in place, then closes the userfaultfd. On an error the
    /// guest's memory is incomplete: `abandon` is called with it while the userfaultfd is
    /// still open, and must stop the guest (a vCPU waiting on a page is then interrupted,
    /// where closing the userfaultfd first would hand it a page of zeros). A read that
    /// outlives the deadline is such an error; the threads blocked in it are let go.
    pub fn wait(self, abandon: impl FnOnce(&MigrateError)) -> Result<LazyStats, MigrateError> {
        if let Err(e) = self.shared.watch(&self.loader) {
            self.shared.stop.store(true, Ordering::Release);
            abandon(&e);
            return Err(e);
        }
        let loaded = join(self.loader);
        let load_ms = ms(self.resumed.elapsed());
        self.shared.stop.store(true, Ordering::Release);
        if let Err(e) = self.shared.watch(&self.faults) {
            abandon(&e);
            return Err(e);
        }
        let served = join(self.faults);
        if let Err(e) = loaded.and(served) {
            abandon(&e);
            return Err(e);
        }
        let s = &self.shared;
        let faults = s.faults.load(Ordering::Relaxed);
        Ok(LazyStats {
            load_ms,
            bytes_read: s.bytes.load(Ordering::Relaxed),
            demand_faults: faults,
            hot_pages: s.hot_pages,
            fault_mean_us: s.fault_ns.load(Ordering::Relaxed) as f64 / 1e3 / faults.max(1) as f64,
        })
    }
}

impl Lazy {
    /// Waits until `thread` finished, or fails once a read of the file is overdue.
    fn watch(&self, thread: &JoinHandle<Result<(), MigrateError>>) -> Result<(), MigrateError> {
        let s = self;
        while !thread.is_finished() {
            if let Some((gpa, waited)) = s.in_flight.overdue(s.read_deadline) {
                return Err(SnapshotError::ReadStalled {
                    path: s.reader.path().to_owned(),
                    gpa,
                    waited,
                }
                .into());
            }
            std::thread::sleep(WATCH_POLL);
        }
        Ok(())
    }
}

/// The reads of the file under way, each with its page and when it started.
#[derive(Debug, Default)]
struct InFlight {
    next: AtomicU64,
    reads: Mutex<HashMap<u64, (Instant, u64)>>,
}

impl InFlight {
    /// Records a read of the page at `gpa` until the returned guard drops.
    fn enter(&self, gpa: u64) -> Reading<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.reads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, (Instant::now(), gpa));
        Reading { of: self, id }
    }

    /// The oldest read under way for longer than `deadline`: its page and how long so far.
    fn overdue(&self, deadline: Duration) -> Option<(u64, Duration)> {
        let reads = self.reads.lock().unwrap_or_else(PoisonError::into_inner);
        reads
            .values()
            .map(|&(t, gpa)| (gpa, t.elapsed()))
            .filter(|&(_, waited)| waited > deadline)
            .max_by_key(|&(_, waited)| waited)
    }
}

/// A read under way; ends when dropped.
struct Reading<'a> {
    of: &'a InFlight,
    id: u64,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.of
            .reads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

fn join(t: JoinHandle<Result<(), MigrateError>>) -> Result<(), MigrateError> {
    t.join().unwrap_or_else(|_| {
        Err(Internal::Panicked {
            thread: "the snapshot loader",
        }
        .into())
    })
}

/// Restores the snapshot at `path` into `vm` and resumes the guest. On an error nothing runs:
/// the VM is left as it was made, and may be thrown away.
pub fn restore(
    vm: &mut dyn DestinationVm,
    path: &Path,
    params: &RestoreParams,
) -> Result<Restored, MigrateError> {
    let started = Instant::now();
    let ram = Ram::new(vm.ram())?;
    // A file of more RAM than this VM's is refused from its header, before its areas are read.
    let limits = Limits {
        max_memory: ram.size(),
    };
    let reader = Arc::new(Reader::open_with(path, &limits)?);
    check_fits(&reader, &ram, params.vcpus)?;
    if !reader.config().is_empty() {
        vm.check_config(reader.config())?;
    }
    let opened = started.elapsed();
    let sections = state::decode(reader.state())?;
    let runs = match params.loading {
        Loading::Mapped => Vec::new(),
        Loading::Eager | Loading::Lazy => reader.data_runs(RUN_PAGES)?,
    };
    tracing::debug!(
        "snapshot opened and checked in {:.1} ms, its data runs found in {:.1} ms",
        ms(opened),
        ms(started.elapsed() - opened)
    );
    let mut stats = RestoreStats {
        open_ms: ms(started.elapsed()),
        memory_bytes: ram.size(),
        ..RestoreStats::default()
    };
    let mut lazy = match params.loading {
        Loading::Eager => {
            let t = Instant::now();
            stats.bytes_read = load_eagerly(&reader, &ram, &runs, params.readers)?;
            stats.ram_ms = ms(t.elapsed());
            None
        }
        Loading::Lazy => Some(Lazy::start(reader, ram, runs, params)?),
        Loading::Mapped => {
            let t = Instant::now();
            let regions = super::map::file_regions(reader.header(), reader.path())?;
            vm.map_file(reader.file().as_fd(), &regions)?;
            stats.ram_ms = ms(t.elapsed());
            None
        }
    };
    let t = Instant::now();
    let loaded = vm.load_state(&sections);
    let t2 = Instant::now();
    let resumed = loaded.and_then(|()| vm.resume());
    if let Err(e) = resumed {
        if let Some(lazy) = lazy {
            lazy.cancel();
        }
        return Err(e.into());
    }
    let now = Instant::now();
    stats.state_load_ms = ms(t2 - t);
    stats.resume_ms = ms(now - t2);
    stats.to_running_ms = ms(now - started);
    if let Some(lazy) = &mut lazy {
        lazy.resumed = now;
    }
    Ok(Restored { stats, lazy })
}

/// Refuses a snapshot whose RAM layout or vCPU count differs from the VM's.
fn check_fits(reader: &Reader, ram: &Ram, vcpus: u32) -> Result<(), MigrateError> {
    let h = reader.header();
    let file: Vec<(u64, u64)> = h.regions.iter().map(|r| (r.gpa, r.size)).collect();
    let here = ram.layout();
    if file != here {
        return Err(ConfigError::SnapshotRam {
            file: h.memory_size(),
            file_regions: file.len(),
            here: ram.size(),
            here_regions: here.len(),
        }
        .into());
    }
    if h.vcpus != vcpus {
        return Err(ConfigError::SnapshotVcpus {
            file: h.vcpus,
            here: vcpus,
        }
        .into());
    }
    Ok(())
}

/// Reads every data run into guest RAM on `readers` threads; returns the bytes read.
fn load_eagerly(
    reader: &Reader,
    ram: &Ram,
    runs: &[(u64, u64)],
    readers: u16,
) -> Result<u64, MigrateError> {
    let never = AtomicBool::new(false);
    let state = || {
        (
            vec![0u8; (RUN_PAGES * PAGE_SIZE) as usize],
            Vec::with_capacity(RUN_PAGES as usize),
        )
    };
    on_threads(
        readers.max(1).into(),
        runs,
        &never,
        state,
        |(buf, gpas), (gpa, pages)| {
            let data = &mut buf[..(pages * PAGE_SIZE) as usize];
            reader.read_pages(gpa, data)?;
            gpas.clear();
            gpas.extend((0..pages).map(|k| gpa + k * PAGE_SIZE));
            ram.write_pages(gpas, data)
                .map_err(|e| MigrateError::io("writing the snapshot's pages into guest RAM", e))
        },
    )?;
    Ok(runs.iter().map(|r| r.1 * PAGE_SIZE).sum())
}

/// Runs `work` over `runs` on `threads` threads, each taking the next run with a `state` of its
/// own (its buffers), until the runs are done, one failed (the others finish the run in hand),
/// or `stop` is set; returns the first failure.
fn on_threads<S>(
    threads: usize,
    runs: &[(u64, u64)],
    stop: &AtomicBool,
    state: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, (u64, u64)) -> Result<(), MigrateError> + Sync,
) -> Result<(), MigrateError> {
    let next = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let worker = || -> Result<(), MigrateError> {
        let mut own = state();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed) as usize;
            if i >= runs.len() || failed.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if let Err(e) = work(&mut own, runs[i]) {
                failed.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(worker)).collect();
        workers.into_iter().try_for_each(|w| {
            w.join().unwrap_or_else(|_| {
                Err(Internal::Panicked {
                    thread: "a snapshot reader",
                }
                .into())
            })
        })
    })
}

/// What a lazy restore's threads share.
#[derive(Debug)]
struct Lazy {
    reader: Arc<Reader>,
    ram: Ram,
    uffd: Uffd,
    /// Pages placed, by the loader or the fault thread.
    placed: PageBits,
    stop: AtomicBool,
    bytes: AtomicU64,
    faults: AtomicU64,
    fault_ns: AtomicU64,
    hot_pages: u64,
    /// The hot set's runs by address: a fault inside one places the whole run.
    hot_by_address: Vec<(u64, u64)>,
    /// Threads the loader places pages with.
    loaders: usize,
    /// The reads of the file under way, watched by [`LazyLoad::wait`].
    in_flight: InFlight,
    read_deadline: Duration,
    read_delay: Option<Duration>,
}

impl Lazy {
    /// Registers `ram` with a userfaultfd and starts the fault thread and the loader (which
    /// loads the hot set first when `hot_first`, then every data run).
    fn start(
        reader: Arc<Reader>,
        ram: Ram,
        runs: Vec<(u64, u64)>,
        params: &RestoreParams,
    ) -> Result<LazyLoad, MigrateError> {
        if ram.host_page_size() != Some(PAGE_SIZE) {
            return Err(ConfigError::LazyHugePages.into());
        }
        let uffd = Uffd::new()?;
        if !uffd.features().missing_shmem {
            return Err(ConfigError::LazyUnsupported.into());
        }
        ram.register_uffd(&uffd, Faults::Missing)?;
        let hot: Vec<(u64, u64)> = if params.hot_first {
            reader.hot().to_vec()
        } else {
            Vec::new()
        };
        let mut hot_by_address = hot.clone();
        hot_by_address.sort_unstable();
        let shared = Arc::new(Lazy {
            placed: PageBits::new(ram.size() / PAGE_SIZE),
            hot_pages: hot.iter().map(|r| r.1).sum(),
            hot_by_address,
            loaders: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
            reader,
            ram,
            uffd,
            stop: AtomicBool::new(false),
            bytes: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            fault_ns: AtomicU64::new(0),
            in_flight: InFlight::default(),
            read_deadline: params.read_deadline,
            read_delay: params.read_delay,
        });
        let s = shared.clone();
        let faults = std::thread::Builder::new()
            .name("restore-faults".into())
            .spawn(move || s.serve_faults())
            .map_err(|e| MigrateError::io("starting the restore's fault thread", e))?;
        let s = shared.clone();
        let loader = std::thread::Builder::new()
            .name("restore-loader".into())
            .spawn(move || s.load(&hot.into_iter().chain(runs).collect::<Vec<_>>()))
            .map_err(|e| MigrateError::io("starting the restore's loader", e))?;
        Ok(LazyLoad {
            shared,
            loader,
            faults,
            resumed: Instant::now(),
        })
    }

    /// Places every run of `runs` that is not placed yet, roughly in order, on
    /// [`Lazy::loaders`] threads.
    fn load(&self, runs: &[(u64, u64)]) -> Result<(), MigrateError> {
        let buf = || vec![0u8; (RUN_PAGES * PAGE_SIZE) as usize];
        on_threads(self.loaders, runs, &self.stop, buf, |buf, (gpa, pages)| {
            self.place_missing(gpa, pages, buf)
        })
    }

    /// Places what is missing of the `pages` pages from `gpa`, in runs of missing pages.
    fn place_missing(&self, gpa: u64, pages: u64, buf: &mut [u8]) -> Result<(), MigrateError> {
        let mut k = 0;
        while k < pages {
            let index = self.ram.page_index(gpa + k * PAGE_SIZE)?;
            if self.placed.get(index) {
                k += 1;
                continue;
            }
            let mut n = 1;
            while k + n < pages && n < RUN_PAGES && !self.placed.get(index + n) {
                n += 1;
            }
            self.place(gpa + k * PAGE_SIZE, n, buf)?;
            k += n;
        }
        Ok(())
    }

    /// The hot run that holds `gpa`, if any.
    fn hot_run_of(&self, gpa: u64) -> Option<(u64, u64)> {
        let i = self.hot_by_address.partition_point(|r| r.0 <= gpa);
        let run = *self.hot_by_address.get(i.checked_sub(1)?)?;
        (gpa < run.0 + run.1 * PAGE_SIZE).then_some(run)
    }

    /// Reads `pages` pages from `gpa` (checked) and places them, waking whoever waits on them.
    fn place(&self, gpa: u64, pages: u64, buf: &mut [u8]) -> Result<(), MigrateError> {
        let data = &mut buf[..(pages * PAGE_SIZE) as usize];
        {
            let _reading = self.in_flight.enter(gpa);
            if let Some(delay) = self.read_delay {
                std::thread::sleep(delay);
            }
            self.reader.read_pages(gpa, data)?;
        }
        let host = self.ram.page(gpa)?;
        let copied = match self.uffd.copy(host, data, Wake::Now)? {
            CopyOutcome::Copied => data.len(),
            CopyOutcome::AlreadyThere => 0,
            CopyOutcome::Partly { copied } => copied,
        };
        let index = self.ram.page_index(gpa)?;
        for i in index..index + pages {
            self.placed.set(i);
        }
        self.bytes.fetch_add(copied as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Serves the guest's faults from the file until told to stop: the page first (its
    /// thread goes on at once), then the rest of its hot run, if it is in one.
    fn serve_faults(&self) -> Result<(), MigrateError> {
        let mut faults: Vec<Fault> = Vec::new();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        let mut run = vec![0u8; (RUN_PAGES * PAGE_SIZE) as usize];
        while !self.stop.load(Ordering::Acquire) {
            faults.clear();
            self.uffd.read_faults(&mut faults, FAULT_POLL)?;
            for f in &faults {
                let t = Instant::now();
                let gpa = self
                    .ram
                    .gpa_of_host(f.addr)
                    .ok_or(Internal::FaultOutsideRam { addr: f.addr })?;
                self.place(gpa, 1, &mut page)?;
                self.faults.fetch_add(1, Ordering::Relaxed);
                self.fault_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                if let Some((start, pages)) = self.hot_run_of(gpa) {
                    self.place_missing(start, pages, &mut run)?;
                }
            }
        }
        Ok(())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
