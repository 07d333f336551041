//! A live snapshot: the migration's transfer core (pass 1 over populated memory, dirty passes
//! decided by the same policy, auto-converge, the pause and the final pass) with a file as its
//! target instead of a destination. The pages go to writer threads that copy each batch out of
//! guest memory and write it where the pages belong in the file ([`Writer::write_pages`]), so
//! a dirty pass overwrites pages in place and the file stays bounded by RAM.
//!
//! The final pass, with the guest paused, copies its pages into buffers touched beforehand and
//! the guest resumes before they are written: the pause does not wait for the file system
//! (whose writes slow to the disk's rate once the page cache holds enough dirty data).
//!
//! A file has no peer: nothing to shake hands with, no acknowledgements (what the writers
//! have written is what the file has taken in; every pass ends when they have written it all),
//! no resume to wait for. The file is the agreement: its header names the layout.
//!
//! Invariants:
//! - The guest resumes after a failure or a cancel whatever the phase, and after a success
//!   unless [`SaveParams::stop`]; the throttle is lifted and dirty logging stopped either way.
//! - Nothing that reads as a snapshot exists until the state, the hot set and the CRC table are
//!   on disk (`Writer::finish`); a failed save removes its `.partial` file.

#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::file::{SnapshotError, Writer};
use super::state;
use crate::bitmap::{Cursor, DirtyBitmap};
use crate::control::{Control, Phase};
use crate::error::MigrateError;
use crate::policy::{self, Decision, Observation, Policy};
use crate::ram::Ram;
use crate::stats::{self, MigrationStats, PassStats};
use crate::vm::{Section, SourceVm, VmError};
use crate::wire::{self, PAGE_SIZE};

/// Pages per batch handed to a writer: 2 MiB, a migration's largest record.
const BATCH_PAGES: usize = wire::MAX_PAGES_PER_RECORD as usize;
/// Batches queued per writer.
const QUEUE_DEPTH: usize = 4;
/// How often the end of a pass looks at whether the writers are done.
const POLL: Duration = Duration::from_micros(200);

/// How to save.
#[derive(Clone, Debug)]
pub struct SaveParams {
    /// Threads writing pages into the file at once.
    pub writers: u16,
    /// When to stop iterating and pause (the migration's policy; its bandwidth is the rate
    /// the writers measured).
    pub policy: Policy,
    /// The VM's vCPU count, recorded in the header (a restore refuses a VM with another).
    pub vcpus: u32,
    /// The snapshot's identity, recorded in the header.
    pub uuid: [u8; 16],
    /// Leave the guest paused once the snapshot is complete (a save before shutdown).
    pub stop: bool,
}

impl SaveParams {
    fn check(&self) -> Result<(), MigrateError> {
        if self.writers == 0 || self.writers > wire::MAX_CHANNELS {
            return Err(crate::error::ConfigError::Channels {
                asked: self.writers,
                max: wire::MAX_CHANNELS,
            }
            .into());
        }
        Ok(())
    }
}

/// Saves `vm` into a snapshot at `path` while it runs; returns the statistics, as a migration
/// does (the downtime is the pause the guest saw). See the module doc for what a failure
/// leaves.
pub fn save(
    vm: &mut dyn SourceVm,
    path: &Path,
    params: &SaveParams,
    control: &Control,
) -> Result<MigrationStats, MigrateError> {
    params.check()?;
    let started = Instant::now();
    let cpu_start = stats::thread_cpu_ns();
    control.update(|p| {
        p.phase = Phase::Setup;
        p.settings.downtime_limit_ms = params.policy.downtime_limit.as_millis() as u64;
    });
    let shared = Shared {
        ram: Ram::new(vm.ram())?,
        control,
        written: AtomicU64::new(0),
        zeros: AtomicU64::new(0),
        pending: AtomicU64::new(0),
        pool: Mutex::new(Vec::new()),
        staged: Mutex::new(Vec::new()),
        staging: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
    };
    let mut save = Save {
        shared: &shared,
        params,
        started,
        stats: MigrationStats::default(),
        paused: false,
        throttle: 0,
    };
    let result = save.run(vm, path);
    vm.stop_dirty_log();
    let mut stats = std::mem::take(&mut save.stats);
    if save.throttle > 0 {
        if let Err(e) = vm.set_throttle(0) {
            tracing::warn!("could not lift the guest's throttle: {e}");
        }
        control.update(|p| p.throttle_percent = 0);
    }
    let resume = save.paused && (result.is_err() || !params.stop);
    let resumed = if resume { vm.resume() } else { Ok(()) };
    stats.total_ms = ms(started.elapsed());
    stats.cpu_seconds_source = (stats::thread_cpu_ns() - cpu_start) as f64 / 1e9;
    stats.pages_normal = shared.written.load(Ordering::Relaxed);
    stats.pages_zero = shared.zeros.load(Ordering::Relaxed);
    stats.bytes_sent = stats.pages_normal * PAGE_SIZE;
    stats.bandwidth_mb_s = stats.bytes_sent as f64 / 1e6 / (stats.total_ms / 1e3).max(1e-3);
    let result = result.and_then(|()| resumed.map_err(MigrateError::from));
    let phase = match &result {
        Ok(()) => Phase::Completed,
        Err(MigrateError::Cancelled) => Phase::Cancelled,
        Err(_) => Phase::Failed,
    };
    control.update(|p| {
        p.phase = phase;
        p.error = result.as_ref().err().map(ToString::to_string);
        p.stats = Some(stats.clone());
        p.elapsed_ms = stats.total_ms;
    });
    result.map(|()| stats)
}

/// What the passes leave for the file's end: the device state, and the hot set as runs
/// `(gpa, pages)`.
type Saved = (Vec<Section>, Vec<(u64, u64)>);

/// One snapshot being saved: what the passes keep.
struct Save<'a> {
    shared: &'a Shared<'a>,
    params: &'a SaveParams,
    started: Instant,
    stats: MigrationStats,
    /// The guest is paused here (by this save).
    paused: bool,
    throttle: u8,
}

/// What the passes and the writer threads share.
struct Shared<'a> {
    ram: Ram,
    control: &'a Control,
    /// Pages the writers wrote with data, and found zero.
    written: AtomicU64,
    zeros: AtomicU64,
    /// Pages handed to the writers and not written yet.
    pending: AtomicU64,
    /// Buffers for the final pass's pages, touched ahead (`Shared::stage`); taken while
    /// staging is on.
    pool: Mutex<Vec<Vec<u8>>>,
    /// The final pass's batches, copied and not written yet.
    staged: Mutex<Vec<(Vec<u64>, Vec<u8>)>>,
    staging: AtomicBool,
    /// A writer failed; its error is in `error`.
    failed: AtomicBool,
    error: Mutex<Option<SnapshotError>>,
}

impl Save<'_> {
    fn run(&mut self, vm: &mut dyn SourceVm, path: &Path) -> Result<(), MigrateError> {
        let config = match vm.config() {
            Ok(c) => c,
            Err(VmError::Unsupported { .. }) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        let regions = self.shared.ram.layout();
        let writer = Writer::create(path, self.params.vcpus, self.params.uuid, &regions, &config)?;
        let mut queues = Vec::new();
        let result = std::thread::scope(|scope| {
            for i in 0..self.params.writers {
                let (tx, rx) = sync_channel::<Vec<u64>>(QUEUE_DEPTH);
                queues.push(tx);
                let (this, writer) = (self.shared, &writer);
                std::thread::Builder::new()
                    .name(format!("snapshot-writer-{i}"))
                    .spawn_scoped(scope, move || this.write_batches(writer, rx))
                    .map_err(|e| MigrateError::io("starting the snapshot's writers", e))?;
            }
            let result = self.passes(vm, &queues);
            queues.clear(); // the writers end
            result
        });
        let (sections, hot) = result?;
        self.shared.check_writers()?;
        for (gpas, data) in self.shared.take_staged() {
            writer.write_pages(&gpas, &data[..gpas.len() * PAGE_SIZE as usize])?;
        }
        let t = Instant::now();
        writer.finish(&state::encode(&sections), &hot)?;
        tracing::debug!(
            "snapshot's end (state, hot set, CRC table, sync) written in {:.1} ms",
            ms(t.elapsed())
        );
        Ok(())
    }

    /// The passes, the pause and the final pass, then the state; returns the sections and
    /// the hot set (the pages the final pass and the dirty pass before it sent, in that order).
    fn passes(
        &mut self,
        vm: &mut dyn SourceVm,
        queues: &[SyncSender<Vec<u64>>],
    ) -> Result<Saved, MigrateError> {
        let mut bitmap = DirtyBitmap::new(self.shared.ram.regions());
        let t = Instant::now();
        vm.start_dirty_log()?;
        self.stats.dirty_start_ms = ms(t.elapsed());
        self.stats.setup_ms = ms(self.started.elapsed());
        self.set_phase(Phase::Precopy);
        self.first_pass(queues)?;
        let (mut pass, mut stalled) = (1, 0);
        // What each dirty pass sent, newest last: the hot set is made of them.
        let mut history: Vec<Vec<(u64, u64)>> = Vec::new();
        loop {
            vm.fetch_dirty(&mut bitmap)?;
            let dirtied = bitmap.count();
            let last = self.stats.passes.last_mut().expect("pass 1 ran");
            last.dirty_rate_pages_per_s = dirtied as f64 / (last.duration_ms / 1e3).max(1e-3);
            stalled = policy::stall_count(stalled, last.pages * PAGE_SIZE, dirtied * PAGE_SIZE);
            let now = Observation {
                remaining_bytes: dirtied * PAGE_SIZE,
                in_flight_bytes: 0,
                bandwidth: last.pages as f64 * PAGE_SIZE as f64
                    / (last.duration_ms / 1e3).max(1e-3),
                elapsed: self.started.elapsed(),
                stalled_passes: stalled,
                throttle: self.throttle,
                postcopy_granted: false,
            };
            let dirty_rate = last.dirty_rate_pages_per_s;
            self.publish(pass, &now, dirty_rate);
            match policy::decide(&self.params.policy, &now) {
                Decision::Switchover => {
                    self.stats.converged = policy::fits(&self.params.policy, &now);
                    break;
                }
                Decision::Cancel => {
                    return Err(MigrateError::Timeout(
                        self.params.policy.timeout.unwrap_or_default(),
                    ));
                }
                Decision::Throttle(percent) => self.set_throttle(vm, percent)?,
                // Nothing is in flight to a file, and it has no postcopy.
                Decision::Iterate | Decision::Drain | Decision::Postcopy => {}
            }
            pass += 1;
            history.push(bitmap.runs_except(None, BATCH_PAGES as u64));
            self.dirty_pass(&mut bitmap, queues, pass, false)?;
        }
        self.set_phase(Phase::Switchover);
        // The final pass copies its pages into memory, to be written once the guest runs
        // again: the pause does not wait for the file system. The buffers are touched now, so
        // that the copy does not fault fresh memory in while the guest waits.
        self.shared.stage(bitmap.count() * 2);
        let t0 = Instant::now();
        vm.pause()?;
        self.paused = true;
        let t1 = Instant::now();
        vm.fetch_dirty(&mut bitmap)?;
        let t2 = Instant::now();
        history.push(bitmap.runs_except(None, BATCH_PAGES as u64));
        self.dirty_pass(&mut bitmap, queues, pass + 1, true)?;
        let t3 = Instant::now();
        let sections = vm.save_state()?;
        let t4 = Instant::now();
        if !self.params.stop {
            vm.resume()?;
            self.paused = false;
        }
        let t5 = Instant::now();
        let d = &mut self.stats.downtime;
        d.total_ms = ms(t5 - t0);
        d.pause_ms = ms(t1 - t0);
        d.final_sync_ms = ms(t2 - t1);
        d.final_pages_ms = ms(t3 - t2);
        d.state_save_ms = ms(t4 - t3);
        d.resume_ms = ms(t5 - t4);
        d.state_bytes = sections.iter().map(|s| s.data.len() as u64).sum();
        d.save_parts = vm.state_parts();
        history.reverse();
        let max_runs = self.shared.ram.size().div_ceil(PAGE_SIZE) as usize;
        let hot = super::hot::hot_set(&history, &self.shared.ram.layout(), max_runs);
        Ok((sections, hot))
    }

    /// Pass 1: what the guest's memory holds, walking populated ranges only.
    fn first_pass(&mut self, queues: &[SyncSender<Vec<u64>>]) -> Result<(), MigrateError> {
        let started = Instant::now();
        let before = self.shared.handled();
        let mut batch = Vec::with_capacity(BATCH_PAGES);
        let mut next = 0;
        for (index, region) in self.shared.ram.regions().to_vec().iter().enumerate() {
            let end = region.gpa + region.size;
            let mut at = region.gpa;
            while let Some((data, hole)) = self
                .shared
                .ram
                .next_data(index, at)
                .map_err(|e| MigrateError::io("looking for populated memory", e))?
            {
                for gpa in (data..hole.min(end)).step_by(PAGE_SIZE as usize) {
                    batch.push(gpa);
                    if batch.len() == BATCH_PAGES {
                        self.shared
                            .hand(queues, &mut next, std::mem::take(&mut batch), true)?;
                        batch.reserve(BATCH_PAGES);
                    }
                }
                at = hole;
                if at >= end {
                    break;
                }
            }
        }
        self.shared.hand(queues, &mut next, batch, true)?;
        self.end_pass(1, false, before, started)
    }

    /// Writes every page marked in `bitmap`; `paused` for the final pass (not cancellable:
    /// the guest resumes once it ends or fails).
    fn dirty_pass(
        &mut self,
        bitmap: &mut DirtyBitmap,
        queues: &[SyncSender<Vec<u64>>],
        pass: u32,
        paused: bool,
    ) -> Result<(), MigrateError> {
        let started = Instant::now();
        let before = self.shared.handled();
        let mut cursor = Cursor::default();
        let mut next = 0;
        while !cursor.at_end(bitmap) {
            let mut batch = Vec::with_capacity(BATCH_PAGES);
            bitmap.take(&mut cursor, BATCH_PAGES, &mut batch);
            self.shared.hand(queues, &mut next, batch, !paused)?;
        }
        self.end_pass(pass, paused, before, started)
    }

    /// Waits until the writers have written everything handed to them, and records the pass.
    fn end_pass(
        &mut self,
        pass: u32,
        paused: bool,
        before: u64,
        started: Instant,
    ) -> Result<(), MigrateError> {
        while self.shared.pending.load(Ordering::Acquire) > 0 {
            self.shared.check_writers()?;
            if !paused && self.shared.control.cancelled() {
                return Err(MigrateError::Cancelled);
            }
            std::thread::sleep(POLL);
        }
        self.shared.check_writers()?;
        let pages = self.shared.handled() - before;
        self.stats.passes.push(PassStats {
            pass,
            paused,
            throttle_percent: self.throttle,
            pages,
            bytes: pages * PAGE_SIZE,
            duration_ms: ms(started.elapsed()),
            dirty_rate_pages_per_s: 0.0,
        });
        Ok(())
    }

    fn set_throttle(&mut self, vm: &mut dyn SourceVm, percent: u8) -> Result<(), MigrateError> {
        match vm.set_throttle(percent) {
            Ok(()) => {
                self.throttle = percent;
                self.stats.throttle_max_percent = self.stats.throttle_max_percent.max(percent);
                self.shared.control.update(|p| p.throttle_percent = percent);
                Ok(())
            }
            Err(VmError::Unsupported { .. }) => {
                self.stats.throttle_unsupported = true;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn set_phase(&self, phase: Phase) {
        self.shared.control.update(|p| p.phase = phase);
    }

    /// What a pass end publishes.
    fn publish(&self, pass: u32, now: &Observation, dirty_rate: f64) {
        let sent = self.shared.written.load(Ordering::Relaxed) * PAGE_SIZE;
        self.shared.control.update(|p| {
            p.pass = pass;
            p.remaining_bytes = now.remaining_bytes;
            p.bytes_sent = sent;
            p.bandwidth_mb_s = now.bandwidth / 1e6;
            p.dirty_rate_pages_per_s = dirty_rate;
            p.expected_downtime_ms = now.expected_downtime().map(ms);
            p.elapsed_ms = ms(now.elapsed);
        });
    }
}

impl Shared<'_> {
    /// Queues `batch` on the next writer, round-robin; looks at cancellation first when
    /// `cancellable`.
    fn hand(
        &self,
        queues: &[SyncSender<Vec<u64>>],
        next: &mut usize,
        batch: Vec<u64>,
        cancellable: bool,
    ) -> Result<(), MigrateError> {
        if cancellable && self.control.cancelled() {
            return Err(MigrateError::Cancelled);
        }
        self.check_writers()?;
        if batch.is_empty() {
            return Ok(());
        }
        self.pending.fetch_add(batch.len() as u64, Ordering::AcqRel);
        let queue = &queues[*next % queues.len()];
        *next += 1;
        if queue.send(batch).is_err() {
            self.check_writers()?;
            return Err(MigrateError::Channel(
                "a snapshot writer ended early".into(),
            ));
        }
        Ok(())
    }

    /// A writer thread: copies each batch out of guest memory and writes it to the file.
    /// After a failure it only counts what it is handed, so the passes end and see it.
    fn write_batches(&self, writer: &Writer, batches: Receiver<Vec<u64>>) {
        let mut buf = Vec::with_capacity(BATCH_PAGES * PAGE_SIZE as usize);
        for batch in batches {
            if !self.failed.load(Ordering::Acquire)
                && let Err(e) = self.write_batch(writer, &batch, &mut buf)
            {
                *self.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                self.failed.store(true, Ordering::Release);
            }
            self.pending.fetch_sub(batch.len() as u64, Ordering::AcqRel);
        }
    }

    fn write_batch(
        &self,
        writer: &Writer,
        batch: &[u64],
        buf: &mut Vec<u8>,
    ) -> Result<(), SnapshotError> {
        // A copy, so that the CRC recorded is the CRC of what was written even while the
        // guest writes the page (it is dirty then, and a later pass writes it again).
        let slices = self
            .ram
            .page_slices(batch)
            .map_err(|_| SnapshotError::OutsideRam { gpa: batch[0] })?;
        if self.staging.load(Ordering::Acquire) {
            let mut copy = self
                .pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop()
                .unwrap_or_else(|| vec![0; BATCH_PAGES * PAGE_SIZE as usize]);
            let mut at = 0;
            for s in &slices {
                copy[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            }
            let zeros = copy[..at]
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
        buf.clear();
        for s in &slices {
            buf.extend_from_slice(s);
        }
        let zeros = writer.write_pages(batch, buf)?;
        self.count(batch.len() as u64, zeros);
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
            let mut b = vec![0u8; BATCH_PAGES * PAGE_SIZE as usize];
            // Fault every page in (a zeroed allocation may be mapped lazily).
            for page in b.chunks_exact_mut(PAGE_SIZE as usize) {
                page[0] = 1;
            }
            pool.push(b);
        }
        *self.pool.lock().unwrap_or_else(PoisonError::into_inner) = pool;
        self.staging.store(true, Ordering::Release);
    }

    /// The staged batches, in no particular order (each page is in one batch).
    fn take_staged(&self) -> Vec<(Vec<u64>, Vec<u8>)> {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        std::mem::take(&mut *self.staged.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The first writer's error, if one failed.
    fn check_writers(&self) -> Result<(), MigrateError> {
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

    /// Pages the writers have written so far, data and zeros.
    fn handled(&self) -> u64 {
        self.written.load(Ordering::Relaxed) + self.zeros.load(Ordering::Relaxed)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
