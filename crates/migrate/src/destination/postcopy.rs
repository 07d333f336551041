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
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Internal, MigrateError, ProtocolError, Twice};
use crate::pagebits::PageBits;
use crate::ram::Ram;
use crate::transport::Stream;
use crate::uffd::{CopyOutcome, Fault, Uffd, Wake};
use crate::wire::{self, Header, Kind, Latencies, PAGE_SIZE};

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
}

impl Postcopy {
    /// Opens a userfaultfd and registers all of `ram` for missing pages; `out` is a handle to
    /// the main connection for writing.
    pub(crate) fn new(
        ram: Ram,
        out: Box<dyn Stream>,
        recoverable: bool,
    ) -> Result<Postcopy, MigrateError> {
        let uffd = Uffd::new()?;
        ram.register_missing(&uffd)?;
        let pages = ram.size() / PAGE_SIZE;
        let unit = ram.host_page_size().ok_or(Internal::MixedHostPages)?;
        Ok(Postcopy {
            ram,
            uffd,
            unit,
            zeros: std::sync::OnceLock::new(),
            needed: PageBits::new(pages),
            installed: PageBits::new(pages),
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
        self.ram
            .punch(gpa, pages)
            .map_err(|e| MigrateError::io("discarding stale pages", e))
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
        let len = gpas.len() * PAGE_SIZE as usize;
        if buffer.len() < len {
            buffer.resize(len, 0);
        }
        stream
            .read_exact(&mut buffer[..len])
            .map_err(|e| MigrateError::io("receiving postcopy pages", e))?;
        // A record that brings a page a vCPU waits for times its install and its wakes.
        let read = indices
            .iter()
            .any(|&i| self.requested.get(i) && !self.installed.get(i))
            .then(Instant::now);
        // One copy per run of adjacent pages (they are adjacent in the record too), each
        // without waking; then one wake per run.
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (k, &gpa) in gpas.iter().enumerate() {
            let host = self.ram.page(gpa)?;
            match runs.last_mut() {
                Some((start, first, n))
                    if *start + *n * PAGE_SIZE as usize == host && *first + *n == k =>
                {
                    *n += 1
                }
                _ => runs.push((host, k, 1)),
            }
        }
        let page = PAGE_SIZE as usize;
        for &(host, first, n) in &runs {
            let data = &buffer[first * page..(first + n) * page];
            placed(self.uffd.copy(host, data, Wake::Later))?;
        }
        let copied = Instant::now();
        for &(host, _, n) in &runs {
            self.wake(host, n)?;
        }
        if let Some(read) = read {
            let mut s = self.stages.lock().unwrap();
            s.install.add((copied - read).as_micros() as u64);
            s.wake.add(copied.elapsed().as_micros() as u64);
        }
        for i in indices {
            self.installed(i);
        }
        Ok(())
    }

    /// Installs a zero run (checked to be one RAM region by the receiver): every page must be
    /// needed.
    pub(crate) fn install_zero(&self, gpa: u64, pages: u64) -> Result<(), MigrateError> {
        let indices = (0..pages)
            .map(|k| self.needed_index(gpa + k * PAGE_SIZE))
            .collect::<Result<Vec<u64>, MigrateError>>()?;
        let host = self.ram.page(gpa)?;
        placed(
            self.uffd
                .zeropage(host, (pages * PAGE_SIZE) as usize, Wake::Now),
        )?;
        for i in indices {
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

    /// Handles one fault by the state of its host page (see the module doc); returns the
    /// start of a unit to ask for.
    fn on_fault(&self, f: &Fault) -> Result<Option<(u64, Instant)>, MigrateError> {
        // Units are aligned in guest and host address alike (regions start on one).
        let host = f.addr & !(self.unit as usize - 1);
        let Some(gpa) = self.ram.gpa_of_host(host) else {
            return Err(Internal::FaultOutsideRam { addr: f.addr }.into());
        };
        let i = self.ram.page_index(gpa)?;
        if !self.needed.get(i) {
            self.zero_fills.fetch_add(1, Ordering::Relaxed);
            self.zero_fill(host)?;
            return Ok(None);
        }
        if self.installed.get(i) {
            self.wake_bytes(host, self.unit as usize)?;
            return Ok(None);
        }
        if self.requested.set(i) {
            return Ok(None);
        }
        let now = Instant::now();
        self.first_fault.lock().unwrap().insert(i, now);
        // Installed between the two looks: the copy woke the waiter already, and the source
        // ignores a request for a page it sent.
        Ok(Some((gpa, now)))
    }

    /// The fault thread's loop: read faults, answer or ask, until stopped.
    fn run_faults(&self) -> Result<(), MigrateError> {
        let mut faults = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            faults.clear();
            self.uffd.read_faults(&mut faults, FAULT_POLL)?;
            self.faults
                .fetch_add(faults.len() as u64, Ordering::Relaxed);
            let mut ask: Vec<(u64, u64)> = Vec::new();
            let mut since = Vec::new();
            for f in &faults {
                if let Some((gpa, at)) = self.on_fault(f)? {
                    ask.push((gpa, self.unit_pages()));
                    since.push(at);
                }
            }
            for chunk in ask.chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize) {
                let asked = self.write(
                    &Header::runs(Kind::PageRequest, chunk.len() as u32),
                    &wire::encode_runs(chunk),
                );
                match asked {
                    // Paused: the recovery asks again for every requested page still missing.
                    Err(e) if self.recoverable => {
                        tracing::debug!("a page request waits for the recovery: {e}");
                        break;
                    }
                    r => r?,
                }
            }
            if !ask.is_empty() {
                let mut s = self.stages.lock().unwrap();
                for at in since {
                    s.ask.add(at.elapsed().as_micros() as u64);
                }
            }
        }
        Ok(())
    }
}

/// A fill's outcome. A page already there is kept (userfaultfd never overwrites): for a listed
/// page it is the other copy of a page sent twice; for a hole, a page someone placed first.
fn placed(r: Result<CopyOutcome, crate::uffd::UffdError>) -> Result<(), MigrateError> {
    r.map(|_| ()).map_err(MigrateError::from)
}

/// The fault thread of a postcopy phase.
#[derive(Debug)]
pub(crate) struct FaultThread {
    pc: Arc<Postcopy>,
    thread: Option<JoinHandle<()>>,
}

impl FaultThread {
    pub(crate) fn start(pc: Arc<Postcopy>) -> Result<FaultThread, MigrateError> {
        let shared = pc.clone();
        let thread = std::thread::Builder::new()
            .name("postcopy-faults".into())
            .spawn(move || {
                if let Err(e) = shared.run_faults() {
                    *shared.failure.lock().unwrap() = Some(Arc::new(e));
                    let _guard = shared.all_in.0.lock().unwrap();
                    shared.all_in.1.notify_all();
                }
            })
            .map_err(|e| MigrateError::io("starting the postcopy fault thread", e))?;
        Ok(FaultThread {
            pc,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(mut self) {
        self.pc.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where receivers wait for postcopy to begin: they read the postcopy marker on their channel
/// before the session has registered guest RAM, and install nothing until it has.
#[derive(Debug, Default)]
pub(crate) struct PostcopyGate {
    open: Mutex<Option<Arc<Postcopy>>>,
    cv: Condvar,
}

impl PostcopyGate {
    pub(crate) fn open(&self, pc: Arc<Postcopy>) {
        *self.open.lock().unwrap() = Some(pc);
        self.cv.notify_all();
    }

    /// The postcopy state once the session opened the gate; `None` after `timeout`.
    pub(crate) fn wait(&self, timeout: Duration) -> Option<Arc<Postcopy>> {
        let deadline = Instant::now() + timeout;
        let mut open = self.open.lock().unwrap();
        loop {
            if let Some(pc) = open.as_ref() {
                return Some(pc.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            open = self.cv.wait_timeout(open, deadline - now).unwrap().0;
        }
    }
}

/// The main connection's write side, shared by the fault thread (page requests) and the
/// session (Done, a recovery's first records). One lock orders every write, and a recovery
/// swaps the connection under it only after its first records are written, so no page request
/// can overtake them on the new connection.
#[derive(Debug)]
struct Outbox(Mutex<Box<dyn Stream>>);

impl Outbox {
    fn write(&self, header: &Header, payload: &[u8]) -> Result<(), MigrateError> {
        write_sealed(self.0.lock().unwrap().as_mut(), header, payload)
    }

    fn replace_after(
        &self,
        mut out: Box<dyn Stream>,
        first: &[(Header, Vec<u8>)],
    ) -> Result<(), MigrateError> {
        let mut current = self.0.lock().unwrap();
        for (header, payload) in first {
            write_sealed(out.as_mut(), header, payload)?;
        }
        *current = out;
        Ok(())
    }
}

/// Writes one record, its header sealed over its payload, and flushes.
fn write_sealed(out: &mut dyn Stream, header: &Header, payload: &[u8]) -> Result<(), MigrateError> {
    out.write_all(&header.seal(payload).encode())
        .and_then(|()| out.write_all(payload))
        .and_then(|()| out.flush())
        .map_err(|e| MigrateError::io("writing to the source", e))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::Outbox;
    use crate::wire::{self, HEADER_SIZE, Header, Kind};

    /// Reads records (header kinds) off `s` until it ends.
    fn kinds(mut s: UnixStream) -> Vec<Kind> {
        let mut out = Vec::new();
        let mut h = [0u8; HEADER_SIZE];
        while s.read_exact(&mut h).is_ok() {
            let header = Header::decode(&h).expect("a valid header");
            let mut payload = vec![0u8; header.len as usize];
            s.read_exact(&mut payload).unwrap();
            out.push(header.kind);
        }
        out
    }

    #[test]
    fn a_request_written_while_a_recovery_swaps_connections_comes_after_its_first_records() {
        for _ in 0..50 {
            let (old, mut old_peer) = UnixStream::pair().unwrap();
            // The broken connection's other end keeps reading, so no write blocks on it.
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while matches!(old_peer.read(&mut b), Ok(n) if n > 0) {}
            });
            let outbox = Arc::new(Outbox(Mutex::new(Box::new(old))));
            let stop = Arc::new(AtomicBool::new(false));
            // A fault thread that writes requests as fast as it can, through the swap.
            let writer = {
                let (outbox, stop) = (outbox.clone(), stop.clone());
                std::thread::spawn(move || {
                    let run = wire::encode_runs(&[(0x1000, 1)]);
                    while !stop.load(Ordering::Relaxed) {
                        let _ = outbox.write(&Header::runs(Kind::PageRequest, 1), &run);
                    }
                })
            };
            let (new, new_peer) = UnixStream::pair().unwrap();
            let reading = std::thread::spawn(move || kinds(new_peer));
            let missing = wire::encode_runs(&[(0x2000, 4)]);
            outbox
                .replace_after(
                    Box::new(new),
                    &[
                        (Header::runs(Kind::Missing, 1), missing),
                        (Header::new(Kind::Resume, 0, 0), Vec::new()),
                    ],
                )
                .unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1));
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            // Dropping the outbox closes the new connection's write side.
            drop(outbox);
            let seen = reading.join().unwrap();
            assert_eq!(
                seen[..2],
                [Kind::Missing, Kind::Resume],
                "{:?}",
                &seen[..4.min(seen.len())]
            );
            assert!(seen[2..].iter().all(|k| *k == Kind::PageRequest));
        }
    }
}
