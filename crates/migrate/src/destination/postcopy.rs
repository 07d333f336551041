//! Postcopy on the destination: the guest runs before all of its memory arrived, and a page it
//! touches that is not here yet is fetched from the source while the vCPU waits.
//!
//! Guest RAM is registered with userfaultfd for missing pages when the source switches. From
//! then on each page is in one of three states, and the fault thread acts on a fault by state:
//!
//! - **not needed**: the page is not on the source's discard list, so what precopy left here is
//!   its last version. That includes pages precopy never wrote: the source skipped them as
//!   holes or sent them as zero runs onto holes, so they are holes here and the first touch
//!   faults. The fault thread fills them with `UFFDIO_ZEROPAGE` itself, without asking.
//! - **needed, not installed**: on the discard list (dirty on the source after it was sent, or
//!   never sent), punched out of the backing file when the list arrived, and coming from the
//!   source. A fault asks for it (once: `requested`) on the main connection.
//! - **installed**: a receiver placed it (`UFFDIO_COPY`, or `UFFDIO_ZEROPAGE` for a zero run)
//!   and woke whoever waited; a late fault message only needs a wake.
//!
//! Invariants: a needed page is installed exactly once and only by a receiver, so the fault
//! thread's zero fill can never race with a copy of data; a page not on the list is refused.
//! A listed page may arrive twice (the source sends a requested page again on the preempt
//! connection when its first copy is still behind the background stream): installing is
//! atomic and never overwrites (`UFFDIO_COPY` answers EEXIST), so the first copy wins and the
//! second is dropped; both are the same bytes, since the source's guest no longer runs. No page
//! that was installed is ever written again. If postcopy fails after the guest ran, the userfaultfd is never closed:
//! closing it would let the kernel fill every missing page with zeros behind the guest's back.
//! The vCPUs that wait stay waiting, and the VMM is told to stop the VM.
//!
//! **Over the memory held here** (minor faults; 4 KiB shmem pages, when precopy's pages landed
//! through the guest's mapping): a needed page is not punched out of the file but only out of
//! the guest's mapping (`Ram::unmap_pages`), its file page kept allocated and mapped a second
//! time (`ram/alias.rs`), and the range is registered for minor faults as well. A receiver
//! writes a page's bytes into the file through that alias and `UFFDIO_CONTINUE` maps them for
//! the guest: a copy into allocated memory, where a fill after a punch allocates every page
//! again. Since the file's page exists before it is placed, "atomic and never overwrites" is
//! the engine's to keep here: a page is written by the one copy that claims it (`claimed`),
//! marked `written` once its bytes are in, and mapped by whoever comes next (its receiver, a
//! second copy, or the fault thread for a vCPU that faults on it), never written again. A
//! page not needed that precopy wrote through the file faults as a minor fault and is mapped as
//! it is; a hole faults as before.
//!
//! **The unit is the host page.** Over hugetlbfs, userfaultfd places only whole 2 MiB pages,
//! so everything above happens per huge page of 512 wire pages: the source discards, sends and
//! serves whole huge pages (the destination told it the size in its hello), a fault asks for
//! the huge page around it, a hole not needed is filled with a copy of zeros (hugetlbfs has no
//! `UFFDIO_ZEROPAGE`), and a receiver assembles each huge page from its Pages and ZeroRuns
//! records (`assemble.rs`) before one `UFFDIO_COPY` places it. The page bits stay per 4 KiB
//! page and are set for whole units.

use std::collections::HashMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::outbox::Outbox;
use crate::error::{Internal, MigrateError, ProtocolError, Twice};
use crate::pagebits::PageBits;
use crate::ram::Ram;
use crate::ram::alias::Alias;
use crate::stage_clock::IntakeClock;
use crate::transport::Stream;
use crate::uffd::{CopyOutcome, Faults, Uffd, Wake};
use crate::wire::{self, Header, Latencies, PAGE_SIZE};

pub(crate) mod faults;

/// Runs of pages: `(host address, pages)`.
type Runs = Vec<(usize, usize)>;

/// How long the fault thread waits for faults before it looks at its stop flag.
const FAULT_POLL: Duration = Duration::from_millis(20);

/// Where a page request's time goes on the destination, beside its whole latency (fault to page
/// in place): the fault thread's part (fault read to request written), and for a record that
/// brings a page a vCPU waits for, its install (the copies, after the record was read) and the
/// wakes. The rest is the source's turnaround (`PostcopyStats::source_turnaround`) and the
/// wire and queues between.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stages {
    pub ask: Latencies,
    pub install: Latencies,
    pub wake: Latencies,
}

/// The destination's postcopy state, shared by the session, the receivers and the fault thread.
#[derive(Debug)]
pub(crate) struct Postcopy {
    ram: Ram,
    uffd: Uffd,
    /// The host page in bytes (4 KiB, or 2 MiB on hugetlbfs): what one fault asks for and
    /// one copy places.
    unit: u64,
    /// A unit of zeros for filling huge holes (hugetlbfs has no zeropage), made at first use.
    zeros: std::sync::OnceLock<Vec<u8>>,
    /// Pages on the discard list: each must arrive once.
    needed: PageBits,
    installed: PageBits,
    /// Over memory this side holds (minor faults): the file's second mapping that received
    /// pages are written through before `UFFDIO_CONTINUE` maps them; `None`: missing faults
    /// and `UFFDIO_COPY`, the pages punched out of the file at the discard.
    alias: Option<Alias>,
    /// With the alias, pages a receiver took to write (once: a second copy of a page must
    /// never be written into the file after the first was mapped for the guest), and those
    /// whose bytes are in the file (which anyone may then map).
    claimed: PageBits,
    written: PageBits,
    /// Pages asked for (a page is asked for once).
    requested: PageBits,
    /// Needed pages not installed yet.
    remaining: AtomicU64,
    /// The write side of the main connection: page requests, and the session's Resumed and
    /// Done, all through this lock so that records never interleave.
    out: Outbox,
    /// When the first fault on each requested page came (by page index), for the latencies.
    first_fault: Mutex<HashMap<u64, Instant>>,
    latencies: Mutex<Latencies>,
    /// The stages of a request's way on this side (`Stages`).
    stages: Mutex<Stages>,
    /// Signalled when `remaining` reaches zero or the fault thread fails.
    all_in: (Mutex<()>, Condvar),
    failure: Mutex<Option<Arc<MigrateError>>>,
    stop: AtomicBool,
    /// Faults on pages that were not needed, filled with zeros here.
    zero_fills: AtomicU64,
    /// Recovery was granted: a request that cannot be written (the main connection broke)
    /// waits for the recovery, which asks again for every requested page still missing.
    recoverable: bool,
    /// Fault messages read.
    faults: AtomicU64,
    /// Where the receivers' time goes from the switch on (`stage_clock.rs`).
    pub(crate) intake: IntakeClock,
}

impl Postcopy {
    /// Opens a userfaultfd and registers all of `ram` for missing pages (and minor faults too,
    /// `over_held` when the kernel has them: the module doc); `out` is a handle to the main
    /// connection for writing.
    pub(crate) fn new(
        ram: Ram,
        out: Box<dyn Stream>,
        recoverable: bool,
        over_held: bool,
    ) -> Result<Postcopy, MigrateError> {
        let uffd = Uffd::new()?;
        let pages = ram.size() / PAGE_SIZE;
        let unit = ram.host_page_size().ok_or(Internal::MixedHostPages)?;
        let alias = (over_held && unit == PAGE_SIZE && uffd.features().minor_shmem)
            .then(|| Alias::new(&ram))
            .and_then(|a| {
                a.inspect_err(|e| tracing::debug!("postcopy falls back to missing faults: {e}"))
                    .ok()
            });
        ram.register_uffd(
            &uffd,
            match alias {
                Some(_) => Faults::MissingAndMinor,
                None => Faults::Missing,
            },
        )?;
        Ok(Postcopy {
            ram,
            uffd,
            unit,
            zeros: std::sync::OnceLock::new(),
            needed: PageBits::new(pages),
            installed: PageBits::new(pages),
            alias,
            claimed: PageBits::new(pages),
            written: PageBits::new(pages),
            requested: PageBits::new(pages),
            remaining: AtomicU64::new(0),
            out: Outbox(Mutex::new(out)),
            first_fault: Mutex::new(HashMap::new()),
            latencies: Mutex::new(Latencies::default()),
            stages: Mutex::default(),
            all_in: (Mutex::new(()), Condvar::new()),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            zero_fills: AtomicU64::new(0),
            recoverable,
            faults: AtomicU64::new(0),
            intake: IntakeClock::default(),
        })
    }

    /// Puts `pages` pages from `gpa` on the discard list and drops what this side holds of
    /// them. Called by the session before the guest resumes.
    pub(crate) fn discard(&self, gpa: u64, pages: u64) -> Result<(), MigrateError> {
        self.ram.check_run(gpa, pages)?;
        if !gpa.is_multiple_of(self.unit) || !(pages * PAGE_SIZE).is_multiple_of(self.unit) {
            return Err(ProtocolError::DiscardMisaligned {
                gpa,
                pages,
                unit_kib: self.unit >> 10,
            }
            .into());
        }
        for k in 0..pages {
            let i = self.ram.page_index(gpa + k * PAGE_SIZE)?;
            if self.needed.set(i) {
                return Err(ProtocolError::PageTwice {
                    gpa: gpa + k * PAGE_SIZE,
                    twice: Twice::Discarded,
                }
                .into());
            }
        }
        self.remaining.fetch_add(pages, Ordering::AcqRel);
        // The guest does not run and no receiver writes (they wait at the postcopy gate).
        let io = |e| MigrateError::io("discarding stale pages", e);
        match &self.alias {
            // The file keeps its pages, allocated: only the guest's view of them goes, and the
            // alias maps them for the copies to come.
            Some(alias) => {
                self.ram.unmap_pages(gpa, pages).map_err(io)?;
                alias.populate(gpa, pages).map_err(io)
            }
            None => self.ram.punch(gpa, pages).map_err(io),
        }
    }

    /// Wire pages per host page (1, or 512 on 2 MiB hugetlbfs pages).
    pub(crate) fn unit_pages(&self) -> u64 {
        self.unit / PAGE_SIZE
    }

    /// Places the whole host page at `gpa` (a unit's start; every page checked to be needed)
    /// from `data`, one unit of bytes, and wakes its waiters. A unit already there (its other
    /// copy won) is left as it is.
    pub(crate) fn place_unit(&self, gpa: u64, data: &[u8]) -> Result<(), MigrateError> {
        let host = self.ram.page(gpa)?;
        placed(
            self.uffd
                .copy_pages(host, data, self.unit as usize, Wake::Now),
        )?;
        let first = self.ram.page_index(gpa)?;
        for i in first..first + self.unit_pages() {
            self.installed(i);
        }
        Ok(())
    }

    /// [`Postcopy::place_unit`] of zeros.
    pub(crate) fn place_zero_unit(&self, gpa: u64) -> Result<(), MigrateError> {
        self.place_unit(gpa, self.zeros())
    }

    fn zeros(&self) -> &[u8] {
        self.zeros.get_or_init(|| vec![0; self.unit as usize])
    }

    /// Fills the hole at `host` (a unit's start) with zeros.
    fn zero_fill(&self, host: usize) -> Result<(), MigrateError> {
        placed(if self.unit == PAGE_SIZE {
            self.uffd.zeropage(host, PAGE_SIZE as usize, Wake::Now)
        } else {
            self.uffd
                .copy_pages(host, self.zeros(), self.unit as usize, Wake::Now)
        })
    }

    /// Needed pages still missing.
    pub(crate) fn remaining(&self) -> u64 {
        self.remaining.load(Ordering::Acquire)
    }

    /// Writes a record on the main connection.
    pub(crate) fn write(&self, header: &Header, payload: &[u8]) -> Result<(), MigrateError> {
        self.out.write(header, payload)
    }

    /// A recovery's new main connection replaces the broken one for requests and Done, once
    /// `first` (its Missing list and Resume) is written on it.
    pub(crate) fn replace_out_after(
        &self,
        out: Box<dyn Stream>,
        first: &[(Header, Vec<u8>)],
    ) -> Result<(), MigrateError> {
        self.out.replace_after(out, first)
    }

    /// Runs of listed pages not installed yet (at most [`wire::MAX_ZERO_RUN_PAGES`] each):
    /// what a recovery tells the source it still lacks.
    pub(crate) fn missing_runs(&self) -> Vec<(u64, u64)> {
        self.runs_not_installed(&self.needed)
    }

    /// Runs of requested pages not installed yet: asked for again after a recovery, since the
    /// request may have been lost with the connection.
    pub(crate) fn pending_requests(&self) -> Vec<(u64, u64)> {
        self.runs_not_installed(&self.requested)
    }

    /// Runs of pages (by guest address, within one region, at most
    /// [`wire::MAX_ZERO_RUN_PAGES`] each) set in `listed` and not installed. Walks the pages
    /// `listed` has set (through its summary), not all of RAM: a recovery of a large guest
    /// costs what it still lacks.
    fn runs_not_installed(&self, listed: &PageBits) -> Vec<(u64, u64)> {
        // (first page index, pages, guest address) of each region, in index order.
        let mut first = 0;
        let regions: Vec<(u64, u64, u64)> = self
            .ram
            .regions()
            .iter()
            .map(|r| {
                let pages = r.size / PAGE_SIZE;
                first += pages;
                (first - pages, pages, r.gpa)
            })
            .collect();
        let (mut runs, mut open) = (Vec::new(), None::<(usize, u64, u64)>);
        let mut region = 0;
        listed.for_each_set(|i| {
            if self.installed.get(i) {
                return;
            }
            while region < regions.len() && i >= regions[region].0 + regions[region].1 {
                region += 1;
            }
            let Some(&(first, _, gpa)) = regions.get(region) else {
                return;
            };
            let gpa = gpa + (i - first) * PAGE_SIZE;
            match &mut open {
                Some((r, start, n))
                    if *r == region
                        && *start + *n * PAGE_SIZE == gpa
                        && *n < wire::MAX_ZERO_RUN_PAGES =>
                {
                    *n += 1
                }
                _ => {
                    runs.extend(open.map(|(_, start, n)| (start, n)));
                    open = Some((region, gpa, 1));
                }
            }
        });
        runs.extend(open.map(|(_, start, n)| (start, n)));
        runs
    }

    /// Reads the data of a Pages record whose addresses `gpas` the receiver checked and claimed,
    /// and installs each page; a page not on the discard list is refused.
    pub(crate) fn install_pages(
        &self,
        stream: &mut dyn Read,
        gpas: &[u64],
        buffer: &mut Vec<u8>,
    ) -> Result<(), MigrateError> {
        let indices = gpas
            .iter()
            .map(|&gpa| self.needed_index(gpa))
            .collect::<Result<Vec<u64>, MigrateError>>()?;
        // A record that brings a page a vCPU waits for times its install and its wakes.
        let awaited = indices
            .iter()
            .any(|&i| self.requested.get(i) && !self.installed.get(i));
        let reading = Instant::now();
        let (runs, mine, read) = match &self.alias {
            Some(alias) => {
                // Claimed before the read, which lands the claimed pages in the file itself.
                let claims: Vec<bool> = indices.iter().map(|&i| !self.claimed.set(i)).collect();
                if let Err(e) = alias.read_pages(stream, gpas, &claims, buffer) {
                    // None of them was written: a later copy (a recovery's) claims them again.
                    for (&i, _) in indices.iter().zip(&claims).filter(|(_, c)| **c) {
                        self.claimed.clear(i);
                    }
                    return Err(MigrateError::io("receiving postcopy pages", e));
                }
                let read = Instant::now();
                self.intake.read.add(read - reading, 0);
                for (&i, _) in indices.iter().zip(&claims).filter(|(_, c)| **c) {
                    self.written.set(i);
                }
                let (runs, mapped) = self.map_written(gpas, &indices)?;
                (runs, mapped, read)
            }
            None => {
                let len = gpas.len() * PAGE_SIZE as usize;
                if buffer.len() < len {
                    buffer.resize(len, 0);
                }
                stream
                    .read_exact(&mut buffer[..len])
                    .map_err(|e| MigrateError::io("receiving postcopy pages", e))?;
                let read = Instant::now();
                self.intake.read.add(read - reading, 0);
                // One copy per run of adjacent pages (adjacent in the record too, whose
                // addresses increase), each without waking.
                let page = PAGE_SIZE as usize;
                let mut runs = Runs::new();
                for &gpa in gpas {
                    extend_runs(&mut runs, self.ram.page(gpa)?);
                }
                let mut first = 0;
                for &(host, n) in &runs {
                    let data = &buffer[first * page..(first + n) * page];
                    placed(self.uffd.copy(host, data, Wake::Later))?;
                    first += n;
                }
                (runs, indices, read)
            }
        };
        let installing = read;
        let read = awaited.then_some(read);
        let copied = Instant::now();
        self.intake.install.add(copied - installing, 0);
        // One wake per run.
        for &(host, n) in &runs {
            self.wake(host, n)?;
        }
        self.intake.wake.since(copied);
        if let Some(read) = read {
            let mut s = self.stages.lock().unwrap();
            s.install.add((copied - read).as_micros() as u64);
            s.wake.add(copied.elapsed().as_micros() as u64);
        }
        for i in mine {
            self.installed(i);
        }
        Ok(())
    }

    /// Over held memory: writes each page of `gpas` (`data`, a page each; zeros if `None`)
    /// that this copy claims into the file, and maps every run of pages that are written,
    /// those another copy wrote included (mapping twice is harmless), without waking. Returns
    /// the runs `(host, pages)` and the indices of the pages now mapped.
    ///
    /// A page is written by the one copy that claims it, and marked written once its bytes are
    /// in: a second copy never writes into a page the guest may already see, and does not
    /// wait for the first copy's mapping either (nor does a fault, `on_fault`).
    fn write_into(
        &self,
        alias: &Alias,
        gpas: &[u64],
        indices: &[u64],
        data: Option<&[u8]>,
    ) -> Result<(Runs, Vec<u64>), MigrateError> {
        let page = PAGE_SIZE as usize;
        for (k, (&gpa, &i)) in gpas.iter().zip(indices).enumerate() {
            if !self.claimed.set(i) {
                match data {
                    Some(d) => alias.write(gpa, &d[k * page..(k + 1) * page])?,
                    None => alias.zero(gpa, 1)?,
                }
                self.written.set(i);
            }
        }
        self.map_written(gpas, indices)
    }

    /// Over held memory: maps every run of the pages of `gpas` whose bytes are in the file
    /// (`written`; a page another copy claimed and still writes is left to it, which maps it
    /// right after), without waking. Returns the runs `(host, pages)` and the indices of the
    /// pages now mapped (mapping twice is harmless).
    fn map_written(&self, gpas: &[u64], indices: &[u64]) -> Result<(Runs, Vec<u64>), MigrateError> {
        let mut runs = Runs::new();
        let mut mapped = Vec::with_capacity(indices.len());
        for (&gpa, &i) in gpas.iter().zip(indices) {
            if self.written.get(i) {
                mapped.push(i);
                extend_runs(&mut runs, self.ram.page(gpa)?);
            }
        }
        for &(host, n) in &runs {
            placed(
                self.uffd
                    .continue_range(host, n * PAGE_SIZE as usize, Wake::Later),
            )?;
        }
        Ok((runs, mapped))
    }

    /// Installs a zero run (checked to be one RAM region by the receiver): every page must be
    /// needed.
    pub(crate) fn install_zero(&self, gpa: u64, pages: u64) -> Result<(), MigrateError> {
        let indices = (0..pages)
            .map(|k| self.needed_index(gpa + k * PAGE_SIZE))
            .collect::<Result<Vec<u64>, MigrateError>>()?;
        let Some(alias) = &self.alias else {
            let host = self.ram.page(gpa)?;
            placed(
                self.uffd
                    .zeropage(host, (pages * PAGE_SIZE) as usize, Wake::Now),
            )?;
            for i in indices {
                self.installed(i);
            }
            return Ok(());
        };
        let gpas: Vec<u64> = (0..pages).map(|k| gpa + k * PAGE_SIZE).collect();
        let (runs, mapped) = self.write_into(alias, &gpas, &indices, None)?;
        for &(host, n) in &runs {
            self.wake(host, n)?;
        }
        for i in mapped {
            self.installed(i);
        }
        Ok(())
    }

    /// The page index of `gpa`, which must be RAM and on the discard list.
    pub(crate) fn needed_index(&self, gpa: u64) -> Result<u64, MigrateError> {
        let i = self.ram.page_index(gpa)?;
        if self.needed.get(i) {
            Ok(i)
        } else {
            Err(ProtocolError::NotDiscarded { gpa }.into())
        }
    }

    fn wake(&self, host: usize, pages: usize) -> Result<(), MigrateError> {
        self.wake_bytes(host, pages * PAGE_SIZE as usize)
    }

    fn wake_bytes(&self, host: usize, len: usize) -> Result<(), MigrateError> {
        Ok(self.uffd.wake(host, len)?)
    }

    /// Marks page `i` installed: its latency if a vCPU waited, and the count. A second copy
    /// of a page (it found the page there) changes nothing.
    fn installed(&self, i: u64) {
        if self.installed.set(i) {
            return;
        }
        if self.requested.get(i)
            && let Some(t) = self.first_fault.lock().unwrap().remove(&i)
        {
            self.latencies
                .lock()
                .unwrap()
                .add(t.elapsed().as_micros() as u64);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = self.all_in.0.lock().unwrap();
            self.all_in.1.notify_all();
        }
    }

    /// Waits until every needed page is installed, the fault thread failed, or `timeout`.
    pub(crate) fn wait_all_in(&self, timeout: Duration) -> Result<(), MigrateError> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.all_in.0.lock().unwrap();
        loop {
            if let Some(f) = self.failure.lock().unwrap().clone() {
                return Err(MigrateError::FaultThread(f));
            }
            let left = self.remaining();
            if left == 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ProtocolError::PagesNeverArrived { left, timeout }.into());
            }
            guard = self
                .all_in
                .1
                .wait_timeout(guard, (deadline - now).min(Duration::from_millis(100)))
                .unwrap()
                .0;
        }
    }

    /// The request latencies so far.
    pub(crate) fn latencies(&self) -> Latencies {
        *self.latencies.lock().unwrap()
    }

    /// The stages of the requests so far, on this side.
    pub(crate) fn stages(&self) -> Stages {
        *self.stages.lock().unwrap()
    }

    pub(crate) fn zero_fills(&self) -> u64 {
        self.zero_fills.load(Ordering::Relaxed)
    }

    /// Whether postcopy runs over the memory this side holds (minor faults).
    pub(crate) fn over_held(&self) -> bool {
        self.alias.is_some()
    }

    pub(crate) fn faults(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// Every page is here: faults go back to the kernel (a page the guest never touched is a
    /// plain hole again).
    pub(crate) fn finish(&self) -> Result<(), MigrateError> {
        for r in self.ram.regions() {
            self.uffd.unregister(r.host_addr, r.size as usize)?;
        }
        Ok(())
    }
}

/// Adds the page at `host` to `runs`: to the last run if it follows it, else as a new one.
fn extend_runs(runs: &mut Runs, host: usize) {
    match runs.last_mut() {
        Some((start, n)) if *start + *n * PAGE_SIZE as usize == host => *n += 1,
        _ => runs.push((host, 1)),
    }
}

/// A fill's outcome. A page already there is kept (userfaultfd never overwrites): for a listed
/// page it is the other copy of a page sent twice; for a hole, a page someone placed first.
fn placed(r: Result<CopyOutcome, crate::uffd::UffdError>) -> Result<(), MigrateError> {
    r.map(|_| ()).map_err(MigrateError::from)
}
