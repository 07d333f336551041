//! The snapshot file as a migration's [`Target`]: writer threads copy each batch of pages out of
//! guest memory and write it where the pages belong in the file ([`Writer::write_pages`]), so a
//! dirty pass overwrites pages in place and the file stays bounded by RAM. A file agrees to
//! precopy alone, acknowledges nothing (a pass ends once the writers wrote all of it) and is
//! ended by [`Keeper::keep`] with the device state, after the guest resumed.
//!
//! Before the pause ([`Target::before_pause`]) the target touches buffers for about twice the
//! dirty pages left, up to its staging limit, and from then on the writers copy batches into
//! them instead of writing: the final pass costs the guest a copy into memory, not a trip to
//! the file system (whose writes slow to the disk's rate once the page cache holds enough
//! dirty data). `keep`, with the guest running again, writes them. Past the limit the writers
//! write the rest of the final pass during the pause, as in the passes before: a guest that
//! dirties more than the limit costs a longer pause, never more memory than the limit.
//!
//! The target also records, per dirty pass, the runs of pages it was handed: the hot set
//! (`hot.rs`) is made of them.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::error::SnapshotError;
use super::file::{PageBuf, Writer};
use super::{hot, state};
use crate::control::Control;
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

/// Longest an abandoned snapshot waits for its writers to stop: a writer blocked in a write to
/// a hung file system is left to end when its write returns (it holds its own copy of the
/// pages, never guest memory, and nothing waits for it), so that a cancel or a failure frees
/// the migration's slot and the guest at once. 250 ms: many times a healthy disk's slowest
/// write of one 2 MiB batch (a writer merely slower than that is let go as harmlessly), and
/// a cancel still ends well within a second.
const ABANDON_WAIT: Duration = Duration::from_millis(250);

/// What becomes of the guest once its snapshot is complete ([`SaveParams::after`]).
///
/// [`SaveParams::after`]: super::SaveParams::after
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AfterSave {
    /// It runs on: a checkpoint.
    #[default]
    Resume,
    /// It stays paused: a save before shutdown.
    Stop,
}

/// A snapshot file being written by a migration session.
pub(crate) struct FileTarget<'c> {
    /// The session's control: a cancel reaches a target waiting on its writers (a full queue,
    /// a pass end) within [`POLL`].
    control: &'c Control,
    shared: Arc<Shared>,
    /// The file; taken by `keep` to finish it.
    writer: Option<Arc<Writer>>,
    queues: Vec<SyncSender<Vec<u64>>>,
    threads: Vec<JoinHandle<()>>,
    /// The writer the next batch goes to (round-robin).
    next: usize,
    /// The pass whose batches come in now (1-based).
    pass: u32,
    /// A page of each 2 MiB chunk each dirty pass (2 on) was handed, as runs of one page,
    /// oldest pass first: what the hot set is made of.
    history: Vec<Vec<(u64, u64)>>,
    /// Whether the guest runs on once the state is saved.
    after: AfterSave,
    /// Most bytes of buffers made for the final pass.
    staging_limit: u64,
}

/// What the session and the writer threads share.
struct Shared {
    ram: Ram,
    /// Pages written with data, and found zero.
    written: AtomicU64,
    zeros: AtomicU64,
    /// Pages handed over and not written (or staged) yet.
    pending: AtomicU64,
    /// Buffers for the final pass, touched ahead; taken while staging (none is made then).
    pool: Mutex<Vec<PageBuf>>,
    /// Bytes of the buffers made for the final pass.
    staged_bytes: AtomicU64,
    /// Final-pass pages written to the file because no buffer was left.
    written_in_pause: AtomicU64,
    /// The final pass's batches, copied and not written yet.
    staged: Mutex<Vec<(Vec<u64>, PageBuf)>>,
    staging: AtomicBool,
    /// A writer failed; its error is in `error`.
    failed: AtomicBool,
    error: Mutex<Option<SnapshotError>>,
}

impl<'c> FileTarget<'c> {
    /// Starts `writers` threads writing `ram`'s pages into `writer`'s file; its final pass
    /// staged in at most `staging_limit` bytes of buffers.
    pub(crate) fn start(
        ram: Ram,
        writer: Writer,
        writers: u16,
        after: AfterSave,
        staging_limit: u64,
        control: &'c Control,
    ) -> Result<FileTarget<'c>, MigrateError> {
        let shared = Arc::new(Shared {
            ram,
            written: AtomicU64::new(0),
            zeros: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
            staged_bytes: AtomicU64::new(0),
            written_in_pause: AtomicU64::new(0),
            staged: Mutex::new(Vec::new()),
            staging: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        });
        let writer = Arc::new(writer);
        let mut target = FileTarget {
            control,
            shared,
            writer: Some(writer),
            queues: Vec::new(),
            threads: Vec::new(),
            next: 0,
            pass: 1,
            history: Vec::new(),
            after,
            staging_limit,
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
            self.wait_a_little()?;
        }
        self.shared.check()
    }

    /// One wait on the writers: fails at once if one failed or the snapshot was cancelled.
    fn wait_a_little(&self) -> Result<(), MigrateError> {
        self.shared.check()?;
        if self.control.cancelled() {
            return Err(MigrateError::Cancelled);
        }
        std::thread::sleep(POLL);
        Ok(())
    }

    /// Closes the writers' queues and waits for them at most [`ABANDON_WAIT`].
    fn let_go(&mut self) {
        self.queues.clear();
        let deadline = std::time::Instant::now() + ABANDON_WAIT;
        while self.threads.iter().any(|t| !t.is_finished()) && std::time::Instant::now() < deadline
        {
            std::thread::sleep(POLL);
        }
        let (done, blocked): (Vec<_>, Vec<_>) =
            self.threads.drain(..).partition(|t| t.is_finished());
        if !blocked.is_empty() {
            tracing::warn!(
                "{} snapshot writer(s) still blocked in the file system after {ABANDON_WAIT:?}: left to end when their writes return; the partial file goes then",
                blocked.len()
            );
        }
        for t in done {
            if t.join().is_err() {
                self.shared.fail(SnapshotError::WriterPanicked);
            }
        }
    }
}

impl Keeper for FileTarget<'_> {
    fn stops(&self) -> bool {
        self.after == AfterSave::Stop
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
        let layout = ram.layout();
        let hot = hot::hot_set(&history, &layout, hot::max_hot_runs(&layout) as usize);
        let writer = Arc::try_unwrap(writer).map_err(|_| Internal::Panicked {
            thread: "a snapshot writer",
        })?;
        writer.finish(&state::encode(sections), &hot)?;
        Ok(())
    }
}

impl Target for FileTarget<'_> {
    fn agreement(&self) -> Agreement {
        Agreement::NONE
    }

    fn queue_pages(&mut self, gpas: Vec<u64>) -> Result<(), MigrateError> {
        self.shared.check()?;
        if gpas.is_empty() {
            return Ok(());
        }
        if self.pass >= 2 {
            // The hot set counts 2 MiB chunks, so a pass keeps a page of each chunk it
            // wrote, once per stretch in that chunk (the walk is in address order): 16 bytes
            // per 2 MiB per pass at most, where a run per page kept 16 bytes per dirty page.
            let runs = self.history.last_mut().expect("a dirty pass has its list");
            for &gpa in &gpas {
                match runs.last() {
                    Some(&(seen, _)) if seen / hot::CHUNK == gpa / hot::CHUNK => {}
                    _ => runs.push((gpa, 1)),
                }
            }
        }
        self.shared
            .pending
            .fetch_add(gpas.len() as u64, Ordering::AcqRel);
        let at = self.next % self.queues.len();
        self.next += 1;
        // Not a blocking send: a writer blocked in a hung file system must not keep a cancel
        // from the session.
        let mut gpas = gpas;
        loop {
            match self.queues[at].try_send(gpas) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(back)) => {
                    gpas = back;
                    self.wait_a_little()?;
                }
                Err(TrySendError::Disconnected(_)) => {
                    self.shared.check()?;
                    return Err(MigrateError::Channel(
                        "a snapshot writer ended early".into(),
                    ));
                }
            }
        }
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
        let batch_bytes = BATCH_PAGES as u64 * PAGE_SIZE;
        let buffers = (dirty_pages * 2)
            .div_ceil(BATCH_PAGES as u64)
            .min(self.staging_limit / batch_bytes);
        self.shared.stage(buffers as usize);
    }

    fn close_pages(&mut self, stats: &mut MigrationStats) -> Result<(), MigrateError> {
        self.drain()?;
        let s = &self.shared;
        stats.pages_normal = s.written.load(Ordering::Relaxed);
        stats.pages_zero = s.zeros.load(Ordering::Relaxed);
        stats.staged_bytes = s.staged_bytes.load(Ordering::Relaxed);
        stats.final_pages_written_in_pause = s.written_in_pause.load(Ordering::Relaxed);
        Ok(())
    }

    fn abandon(&mut self) {
        self.shared.failed.store(true, Ordering::Release);
        self.let_go();
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
        // While staging, a buffer of the pool if one is left; else (past the staging limit)
        // the writer's own, written now.
        let final_pass = self.staging.load(Ordering::Acquire);
        let pooled = match final_pass {
            true => self
                .pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop(),
            false => None,
        };
        let staging = pooled.is_some();
        if final_pass && !staging {
            self.written_in_pause
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
        let mut copy = pooled.unwrap_or_else(|| std::mem::replace(buf, PageBuf::new(0)));
        // A copy, so that the CRC recorded is the CRC of what was written even while the
        // guest writes the page (it is dirty then, and a later pass writes it again).
        let at = batch.len() * PAGE_SIZE as usize;
        if self
            .ram
            .copy_pages(batch, &mut copy.bytes_mut()[..at])
            .is_err()
        {
            if !staging {
                *buf = copy;
            }
            return Err(SnapshotError::OutsideRam { gpa: batch[0] });
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

    /// From now on the writers copy batches into memory instead of writing them, while
    /// buffers last; `buffers` of a batch each are made and touched first.
    fn stage(&self, buffers: usize) {
        self.staged_bytes.store(
            (buffers * BATCH_PAGES) as u64 * PAGE_SIZE,
            Ordering::Relaxed,
        );
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
