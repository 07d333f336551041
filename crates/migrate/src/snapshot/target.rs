//! The snapshot file as a migration's [`Target`]: writer threads copy each batch of pages out of
//! guest memory and write it where the pages belong in the file ([`Writer::write_pages`]), so a
//! dirty pass overwrites pages in place and the file stays bounded by RAM. A file agrees to
//! precopy alone, acknowledges nothing (a pass ends once the writers wrote all of it) and is
//! ended by [`Keeper::keep`] with the device state, after the guest resumed.
//!
//! Before the pause ([`Target::before_pause`]) the target touches buffers for about twice the
//! dirty pages left, and from then on the writers copy batches into them instead of writing:
//! the final pass costs the guest a copy into memory, not a trip to the file system (whose
//! writes slow to the disk's rate once the page cache holds enough dirty data). `keep`, with
//! the guest running again, writes them.
//!
//! The target also records, per dirty pass, the runs of pages it was handed: the hot set
//! (`hot.rs`) is made of them.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::file::{PageBuf, SnapshotError, Writer};
use super::{hot, state};
use crate::error::{Internal, MigrateError};
use crate::ram::Ram;
use crate::source::agreement::Agreement;
use crate::source::target::{Keeper, Target};
use crate::stats::MigrationStats;
use crate::vm::Section;
use crate::wire::{self, PAGE_SIZE};

/// Pages per batch the session hands over at most: 2 MiB, a migration's largest record.
pub(crate) const BATCH_PAGES: usize = wire::MAX_PAGES_PER_RECORD as usize;
/// Batches queued per writer.
const QUEUE_DEPTH: usize = 4;
/// How often a pass end looks at whether the writers are done.
const POLL: Duration = Duration::from_micros(200);

/// A snapshot file being written by a migration session.
pub(crate) struct FileTarget {
    shared: Arc<Shared>,
    /// The file; taken by `keep` to finish it.
    writer: Option<Arc<Writer>>,
    queues: Vec<SyncSender<Vec<u64>>>,
    threads: Vec<JoinHandle<()>>,
    /// The writer the next batch goes to (round-robin).
    next: usize,
    /// The pass whose batches come in now (1-based).
    pass: u32,
    /// The runs of pages each dirty pass (2 on) was handed, oldest first.
    history: Vec<Vec<(u64, u64)>>,
    /// Leave the guest paused once the state is saved.
    stop: bool,
}

/// What the session and the writer threads share.
struct Shared {
    ram: Ram,
    /// Pages written with data, and found zero.
    written: AtomicU64,
    zeros: AtomicU64,
    /// Pages handed over and not written (or staged) yet.
    pending: AtomicU64,
    /// Buffers for the final pass, touched ahead; taken while staging.
    pool: Mutex<Vec<PageBuf>>,
    /// The final pass's batches, copied and not written yet.
    staged: Mutex<Vec<(Vec<u64>, PageBuf)>>,
    staging: AtomicBool,
    /// A writer failed; its error is in `error`.
    failed: AtomicBool,
    error: Mutex<Option<SnapshotError>>,
}

impl FileTarget {
    /// Starts `writers` threads writing `ram`'s pages into `writer`'s file.
    pub(crate) fn start(
        ram: Ram,
        writer: Writer,
        writers: u16,
        stop: bool,
    ) -> Result<FileTarget, MigrateError> {
        let shared = Arc::new(Shared {
            ram,
            written: AtomicU64::new(0),
            zeros: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
            staged: Mutex::new(Vec::new()),
            staging: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        });
        let writer = Arc::new(writer);
        let mut target = FileTarget {
            shared,
            writer: Some(writer),
            queues: Vec::new(),
            threads: Vec::new(),
            next: 0,
            pass: 1,
            history: Vec::new(),
            stop,
        };
        for i in 0..writers {
            let (tx, rx) = sync_channel::<Vec<u64>>(QUEUE_DEPTH);
            let shared = target.shared.clone();
            let writer = target.writer.clone().expect("just made");
            let thread = std::thread::Builder::new()
                .name(format!("snapshot-writer-{i}"))
                .spawn(move || shared.write_batches(&writer, rx))
                .map_err(|e| MigrateError::io("starting the snapshot's writers", e))?;
            target.queues.push(tx);
            target.threads.push(thread);
        }
        Ok(target)
    }

    /// Closes the writers' queues and waits for them.
    fn join(&mut self) {
        self.queues.clear();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                self.shared.fail(SnapshotError::WriterPanicked);
            }
        }
    }

    /// Waits until the writers have written (or staged) everything handed to them.
    fn drain(&self) -> Result<(), MigrateError> {
        while self.shared.pending.load(Ordering::Acquire) > 0 {
            self.shared.check()?;
            std::thread::sleep(POLL);
        }
        self.shared.check()
    }
}

impl Keeper for FileTarget {
    fn stops(&self) -> bool {
        self.stop
    }

    /// Writes the staged pages, then the device state, the hot set and the CRC table, and
    /// makes the file complete.
    fn keep(&mut self, sections: &[Section]) -> Result<(), MigrateError> {
        self.join();
        self.shared.check()?;
        let staged = std::mem::take(
            &mut *self
                .shared
                .staged
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let writer = self.writer.take().expect("kept once");
        for (gpas, data) in staged {
            writer.write_pages(&gpas, &data.bytes()[..gpas.len() * PAGE_SIZE as usize])?;
        }
        let mut history = std::mem::take(&mut self.history);
        history.reverse();
        let ram = &self.shared.ram;
        let max_runs = ram.size().div_ceil(PAGE_SIZE) as usize;
        let hot = hot::hot_set(&history, &ram.layout(), max_runs);
        let writer = Arc::try_unwrap(writer).map_err(|_| Internal::Panicked {
            thread: "a snapshot writer",
        })?;
        writer.finish(&state::encode(sections), &hot)?;
        Ok(())
    }
}

impl Target for FileTarget {
    fn agreement(&self) -> Agreement {
        Agreement::NONE
    }

    fn queue_pages(&mut self, gpas: Vec<u64>) -> Result<(), MigrateError> {
        self.shared.check()?;
        if gpas.is_empty() {
            return Ok(());
        }
        if self.pass >= 2 {
            let runs = self.history.last_mut().expect("a dirty pass has its list");
            for &gpa in &gpas {
                match runs.last_mut() {
                    Some((start, n)) if *start + *n * PAGE_SIZE == gpa => *n += 1,
                    _ => runs.push((gpa, 1)),
                }
            }
        }
        self.shared
            .pending
            .fetch_add(gpas.len() as u64, Ordering::AcqRel);
        let queue = &self.queues[self.next % self.queues.len()];
        self.next += 1;
        if queue.send(gpas).is_err() {
            self.shared.check()?;
            return Err(MigrateError::Channel(
                "a snapshot writer ended early".into(),
            ));
        }
        Ok(())
    }

    fn end_pass(&mut self, pass: u32) -> Result<(), MigrateError> {
        self.drain()?;
        self.pass = pass + 1;
        self.history.push(Vec::new());
        Ok(())
    }

    fn pending_pages(&self) -> u64 {
        self.shared.pending.load(Ordering::Acquire)
    }

    /// Page data written (a zero page is a hole: nothing written).
    fn bytes_written(&self) -> u64 {
        self.shared.written.load(Ordering::Relaxed) * PAGE_SIZE
    }

    fn before_pause(&mut self, dirty_pages: u64) {
        self.shared.stage(dirty_pages * 2);
    }

    fn close_pages(&mut self, stats: &mut MigrationStats) -> Result<(), MigrateError> {
        self.drain()?;
        stats.pages_normal = self.shared.written.load(Ordering::Relaxed);
        stats.pages_zero = self.shared.zeros.load(Ordering::Relaxed);
        Ok(())
    }

    fn abandon(&mut self) {
        self.shared.failed.store(true, Ordering::Release);
        self.join();
    }
}

impl Shared {
    /// A writer thread: each batch copied out of guest memory and written (or staged). After
    /// a failure it only counts what it is handed, so that pass ends see it.
    fn write_batches(&self, writer: &Writer, batches: Receiver<Vec<u64>>) {
        let mut buf = PageBuf::new(BATCH_PAGES);
        for batch in batches {
            if !self.failed.load(Ordering::Acquire)
                && let Err(e) = self.write_batch(writer, &batch, &mut buf)
            {
                self.fail(e);
            }
            self.pending.fetch_sub(batch.len() as u64, Ordering::AcqRel);
        }
    }

    fn write_batch(
        &self,
        writer: &Writer,
        batch: &[u64],
        buf: &mut PageBuf,
    ) -> Result<(), SnapshotError> {
        // A copy, so that the CRC recorded is the CRC of what was written even while the
        // guest writes the page (it is dirty then, and a later pass writes it again).
        let slices = self
            .ram
            .page_slices(batch)
            .map_err(|_| SnapshotError::OutsideRam { gpa: batch[0] })?;
        let staging = self.staging.load(Ordering::Acquire);
        let mut copy = match staging {
            true => self
                .pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop()
                .unwrap_or_else(|| PageBuf::new(BATCH_PAGES)),
            false => std::mem::replace(buf, PageBuf::new(0)),
        };
        let mut at = 0;
        let bytes = copy.bytes_mut();
        for s in &slices {
            bytes[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        }
        if staging {
            let zeros = copy.bytes()[..at]
                .chunks_exact(PAGE_SIZE as usize)
                .filter(|p| crate::zero::is_zero(p))
                .count() as u64;
            self.count(batch.len() as u64, zeros);
            self.staged
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((batch.to_vec(), copy));
            return Ok(());
        }
        let written = writer.write_pages(batch, &copy.bytes()[..at]);
        *buf = copy;
        self.count(batch.len() as u64, written?);
        Ok(())
    }

    fn count(&self, pages: u64, zeros: u64) {
        self.zeros.fetch_add(zeros, Ordering::Relaxed);
        self.written.fetch_add(pages - zeros, Ordering::Relaxed);
    }

    /// From now on the writers copy batches into memory instead of writing them; buffers
    /// for about `pages` pages are made and touched first.
    fn stage(&self, pages: u64) {
        let buffers = pages.div_ceil(BATCH_PAGES as u64) as usize;
        let mut pool = Vec::with_capacity(buffers);
        for _ in 0..buffers {
            let mut b = PageBuf::new(BATCH_PAGES);
            // Fault every page in (a zeroed allocation may be mapped lazily).
            b.touch();
            pool.push(b);
        }
        *self.pool.lock().unwrap_or_else(PoisonError::into_inner) = pool;
        self.staging.store(true, Ordering::Release);
    }

    /// Records the first failure.
    fn fail(&self, e: SnapshotError) {
        let mut first = self.error.lock().unwrap_or_else(PoisonError::into_inner);
        if first.is_none() {
            *first = Some(e);
        }
        self.failed.store(true, Ordering::Release);
    }

    /// The first writer's error, if one failed.
    fn check(&self) -> Result<(), MigrateError> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let e = self
            .error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        Err(e.map_or_else(
            || MigrateError::Channel("a snapshot writer failed".into()),
            MigrateError::from,
        ))
    }
}
