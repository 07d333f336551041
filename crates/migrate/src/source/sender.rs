//! A data channel's sender thread: takes batches of page addresses from the migration thread,
//! has the pages scanned for zeros in guest memory (by the detector the migration's
//! [`ZeroDetectorFactory`] builds for this thread: inline, offloaded, or the VMM's own), checks
//! what comes back (a failed or malformed completion is scanned here), and sends the zero
//! pages as compact runs and the rest as a Pages record whose page data the kernel copies
//! straight from guest memory (one `writev` of the buffered header and addresses and the
//! pages; `Ram::page_slices` says why sending live guest memory is as correct as a copy). A
//! data page is read twice at most: its first bytes by the scan (which stops at the first
//! non-zero step), and the whole page by the kernel right after, mostly from cache. An
//! `EndOfPass` message is written to the stream in order after the pass's batches: the
//! destination's barrier relies on it.
//!
//! Not used: `MSG_ZEROCOPY` (QEMU's zero-copy-send). Guest memory would suit it (the pages
//! are never freed or reused while the `Ram` lives, and a page the guest changes before the NIC
//! reads it goes out newer, which precopy tolerates since tracking was re-armed first; the
//! sender would only have to collect every completion before it finishes). But over loopback
//! the kernel copies at delivery anyway, and a loopback microbenchmark (4 GiB, plain `send`
//! against `SO_ZEROCOPY` + `send(MSG_ZEROCOPY)` with completions read from the error queue,
//! four runs each) measured the sender at 0.24 s/GiB against 0.30 with 512 KiB writes and 0.19
//! against 0.22 with 2 MiB ones: pinning and completions cost more than they save. Worth a new
//! measurement on a real NIC, through a capability of the `Stream` (a raw fd or `None`).

#![forbid(unsafe_code)]

use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::params::TestHooks;
use super::wakeup::Wakeup;
use crate::compress::{Compression, CompressionStats, PageCompressor};
use crate::conn::Conn;
use crate::error::{Internal, MigrateError};
use crate::ram::Ram;
use crate::scan::{Batch, Completion, FailEvery, ZeroDetector, ZeroDetectorFactory};
use crate::stage_clock::PushClock;
use crate::stats;
use crate::transport::Stream;
use crate::wire::{self, Header, Kind, Latencies, PAGE_SIZE};

/// Batches queued per sender: enough to keep it busy while the migration thread walks the
/// bitmap, few enough that a cancel takes effect within a few batches.
const QUEUE_DEPTH: usize = 4;
/// Batches in the detector before the oldest is sent: 1 lets an offload engine scan one batch
/// while the sender copies the next.
const PIPELINE: usize = 1;

/// What the migration thread tells a sender.
#[derive(Debug)]
pub enum ChannelMsg {
    Pages(Vec<u64>),
    /// Postcopy pages a vCPU waits for, asked for at the instant given: written, flushed, and
    /// the time since counted in the pool's turnaround.
    Urgent(Vec<u64>, Instant),
    EndOfPass(u32),
    /// The pages that follow are postcopy pages: write the marker and flush.
    Postcopy,
    /// Flush and close the stream.
    Shutdown,
}

/// What one sender did.
#[derive(Clone, Copy, Debug, Default)]
pub struct SenderStats {
    pub pages_normal: u64,
    pub pages_zero: u64,
    /// Batches an offload engine failed, which the sender then scanned itself.
    pub fallbacks: u64,
    pub cpu_ns: u64,
    /// What compression did, when on.
    pub compression: Option<CompressionStats>,
}

/// The migration thread's end of a sender.
#[derive(Debug)]
pub struct Sender {
    /// The queue, in a slot that [`Sender::finish`] empties: another thread may hold the slot
    /// and queue through it ([`Sender::queue`]), never keeping the queue open past the finish.
    tx: Queue,
    thread: Option<JoinHandle<Result<SenderStats, MigrateError>>>,
}

/// A sender's queue in a slot its owner empties when it finishes it.
pub type Queue = Arc<Mutex<Option<SyncSender<ChannelMsg>>>>;

/// Queues `msg` through `queue` if it has room: `Ok(None)` when queued, `Ok(Some(msg))` back
/// when full, `Err(msg)` when the sender finished or stopped.
pub fn try_queue(queue: &Queue, msg: ChannelMsg) -> Result<Option<ChannelMsg>, ChannelMsg> {
    match queue.lock().unwrap().as_ref() {
        None => Err(msg),
        Some(tx) => match tx.try_send(msg) {
            Ok(()) => Ok(None),
            Err(TrySendError::Full(msg)) => Ok(Some(msg)),
            Err(TrySendError::Disconnected(msg)) => Err(msg),
        },
    }
}

/// How senders scan and where they count bytes.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// Builds this sender's zero detector ([`crate::SourceParams::zero`]).
    pub zero: Arc<dyn ZeroDetectorFactory>,
    /// Bytes written by all senders, for the bandwidth window.
    pub bytes: Arc<AtomicU64>,
    /// Pages written by all senders (with data or as zero runs), so that the session knows how
    /// many it queued are not written yet.
    pub pages: Arc<AtomicU64>,
    /// Pages records' checksums cover their page data ([`wire::Capabilities::CHECKSUM_PAGES`]
    /// granted).
    pub checksum_pages: bool,
    /// How precopy's pages are compressed (`compress.rs`), as granted.
    pub compression: Compression,
    /// Each channel's share of the bandwidth limit in force, bytes per second (0: none); the
    /// session changes it with the limit.
    pub link_cap: Arc<AtomicU64>,
    /// Page bytes of the data records (Pages and CompressedPages) all senders wrote, and the
    /// bytes written for them, for the session's [`crate::compress::WireShare`].
    pub data_pages: Arc<AtomicU64>,
    pub data_wire: Arc<AtomicU64>,
    /// Request to pages written, for every [`ChannelMsg::Urgent`] (shared by the senders).
    pub turnaround: Arc<Mutex<Latencies>>,
    /// Where the postcopy push's time goes: each sender's waits, scans and writes after the
    /// postcopy marker (`stage_clock.rs`).
    pub clock: Arc<PushClock>,
    /// Rung as a batch leaves the queue: the postcopy push waits on it for room
    /// (`wakeup.rs`).
    pub room: Wakeup,
}

impl Sender {
    /// Starts the sender of data channel `channel`; `hooks` inject test faults (the default
    /// injects none).
    pub fn start(
        channel: u16,
        stream: Box<dyn Stream>,
        ram: Ram,
        config: SenderConfig,
        hooks: TestHooks,
    ) -> Result<Sender, MigrateError> {
        let conn =
            Conn::new(stream).map_err(|e| MigrateError::io("setting up a data channel", e))?;
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let thread = std::thread::Builder::new()
            .name(format!("send-{channel}"))
            .spawn(move || run(channel, conn, ram, rx, config, hooks))
            .map_err(|e| MigrateError::io("starting a sender thread", e))?;
        Ok(Sender {
            tx: Arc::new(Mutex::new(Some(tx))),
            thread: Some(thread),
        })
    }

    /// Queues a message; on failure the sender has stopped, and [`Sender::finish`] says why.
    pub fn send(&self, msg: ChannelMsg) -> bool {
        // Cloned out of the slot, so that a send that waits for room holds no lock.
        let tx = self.tx.lock().unwrap().clone();
        tx.is_some_and(|tx| tx.send(msg).is_ok())
    }

    /// The slot of this sender's queue, for a thread that queues without waiting
    /// (`try_queue`); empty once the sender finishes.
    pub fn queue(&self) -> Queue {
        self.tx.clone()
    }

    /// Queues a message if the queue has room: `Ok(None)` when queued, `Ok(Some(msg))` back
    /// when the queue is full, `Err(msg)` when the sender has stopped ([`Sender::finish`]
    /// says why).
    pub fn try_send(&self, msg: ChannelMsg) -> Result<Option<ChannelMsg>, ChannelMsg> {
        try_queue(&self.tx, msg)
    }

    /// Closes the queue (the sender finishes what it has, or stops if it failed) and returns
    /// its result.
    pub fn finish(&mut self) -> Result<SenderStats, MigrateError> {
        drop(self.tx.lock().unwrap().take());
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Internal::Panicked {
                thread: "a sender thread",
            }
            .into()),
            None => Ok(SenderStats::default()),
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

fn run(
    channel: u16,
    mut conn: Conn,
    ram: Ram,
    rx: Receiver<ChannelMsg>,
    config: SenderConfig,
    hooks: TestHooks,
) -> Result<SenderStats, MigrateError> {
    let cpu_start = stats::thread_cpu_ns();
    let mut detector = config.zero.detector(&ram);
    if let Some(every) = hooks.zero_fail_every {
        detector = Box::new(FailEvery::new(detector, every));
    }
    let mut detector = Pipeline {
        detector,
        outstanding: 0,
    };
    let mut s = SenderStats::default();
    let mut out = Output {
        conn: &mut conn,
        ram: &ram,
        stats: &mut s,
        copy: config.checksum_pages.then(Vec::new),
        compressor: match config.compression {
            Compression::Off => None,
            mode => Some(
                PageCompressor::new(mode)
                    .map_err(|e| MigrateError::io("setting up compression", e))?,
            ),
        },
        gathered: Vec::new(),
        config: &config,
    };
    // After the postcopy marker every batch goes out whole at once, not pipelined.
    let mut postcopy = false;
    loop {
        let waited = Instant::now();
        let Ok(msg) = rx.recv() else {
            break;
        };
        config.room.ring();
        // The background stream's senders: the preempt connection's waits for requests.
        if postcopy && channel != wire::PREEMPT_CHANNEL {
            config.clock.sender_idle.since(waited);
        }
        match msg {
            ChannelMsg::Urgent(gpas, asked) => {
                detector.submit(Batch::new(gpas));
                drain(&mut detector, &mut out)?;
                out.conn.flush("sending requested pages")?;
                let us = asked.elapsed().as_micros() as u64;
                config.turnaround.lock().unwrap().add(us);
            }
            ChannelMsg::Pages(gpas) if postcopy => {
                // A vCPU may be waiting for any of these pages: nothing stays behind, and
                // the batch is timed stage by stage.
                let scanning = Instant::now();
                detector.submit(Batch::new(gpas));
                let mut done = Vec::with_capacity(detector.outstanding);
                while let Some(c) = detector.complete() {
                    done.push(c);
                }
                config.clock.scan.since(scanning);
                let (writing, cpu) = (Instant::now(), stats::thread_cpu_ns());
                for c in done {
                    out.send(c)?;
                }
                out.conn.flush("sending postcopy pages")?;
                config
                    .clock
                    .write
                    .add(writing.elapsed(), stats::thread_cpu_ns() - cpu);
            }
            ChannelMsg::Pages(gpas) => {
                detector.submit(Batch::new(gpas));
                while detector.outstanding > PIPELINE {
                    out.send(detector.complete().expect("outstanding batch"))?;
                }
            }
            ChannelMsg::EndOfPass(pass) => {
                drain(&mut detector, &mut out)?;
                out.marker(Header::new(Kind::EndOfPass, pass, 0), "ending a pass")?;
            }
            ChannelMsg::Postcopy => {
                postcopy = true;
                // A vCPU may wait for any page from here on: none waits for a compressor.
                out.stats.compression = out.compressor.take().map(|c| c.stats);
                drain(&mut detector, &mut out)?;
                out.marker(Header::new(Kind::Postcopy, 0, 0), "starting postcopy")?;
            }
            ChannelMsg::Shutdown => {
                drain(&mut detector, &mut out)?;
                out.conn.flush("closing a data channel")?;
                let _ = out.conn.stream().shutdown(std::net::Shutdown::Write);
                break;
            }
        }
    }
    if let Some(c) = out.compressor.take() {
        out.stats.compression = Some(c.stats);
    }
    s.cpu_ns = stats::thread_cpu_ns() - cpu_start;
    Ok(s)
}

fn drain(detector: &mut Pipeline, out: &mut Output<'_>) -> Result<(), MigrateError> {
    while let Some(c) = detector.complete() {
        out.send(c)?;
    }
    Ok(())
}

/// The sender's detector and the batches in it, counted here rather than asked of the
/// detector: a pass end drains exactly what was submitted, whatever a VMM's detector believes.
struct Pipeline {
    detector: Box<dyn ZeroDetector>,
    outstanding: usize,
}

impl Pipeline {
    fn submit(&mut self, batch: Batch) {
        self.detector.submit(batch);
        self.outstanding += 1;
    }

    /// The oldest outstanding batch's completion; `None` when nothing is outstanding.
    fn complete(&mut self) -> Option<Completion> {
        if self.outstanding == 0 {
            return None;
        }
        self.outstanding -= 1;
        Some(self.detector.complete())
    }
}

/// Writes one Pages record of `gpas` (in address order, at most a record's worth) on `conn`,
/// its data straight from guest memory; with `copy` (page checksums) each page is copied
/// first and the copy checksummed and sent, so the guest writing on cannot make them differ.
fn write_record(
    conn: &mut Conn,
    ram: &Ram,
    gpas: &[u64],
    copy: Option<&mut Vec<u8>>,
) -> Result<(), MigrateError> {
    let header = Header::pages(gpas.len() as u32);
    let addresses: Vec<u8> = gpas.iter().flat_map(|a| a.to_le_bytes()).collect();
    let mut crc = wire::crc(&addresses);
    let pages = match copy {
        None => ram.page_slices(gpas)?,
        Some(copy) => {
            copy.resize(gpas.len() * PAGE_SIZE as usize, 0);
            ram.copy_pages(gpas, copy)?;
            crc = wire::crc_append(crc, copy);
            vec![IoSlice::new(copy)]
        }
    };
    conn.write_header(&header.with_crc(crc))?;
    conn.write_all(&addresses, "sending pages")?;
    conn.write_with_pages(&pages, "sending pages")
}

/// [`write_record`] for the migration thread (postcopy's requested pages on the main
/// connection): not flushed; with `checksum_pages` through a copy made for the call.
pub fn write_pages(
    conn: &mut Conn,
    ram: &Ram,
    gpas: &[u64],
    checksum_pages: bool,
) -> Result<(), MigrateError> {
    let mut copy = checksum_pages.then(Vec::new);
    write_record(conn, ram, gpas, copy.as_mut())
}

struct Output<'a> {
    conn: &'a mut Conn,
    ram: &'a Ram,
    stats: &'a mut SenderStats,
    /// With page checksums: the pages of a record, copied before they are checksummed, so
    /// that what is sent is what was checksummed while the guest writes on.
    copy: Option<Vec<u8>>,
    /// Precopy's compression, when on (taken at the postcopy marker).
    compressor: Option<PageCompressor>,
    /// The pages of a batch to compress, copied out of guest memory first: the frame then
    /// decodes to bytes the guest really held at one time.
    gathered: Vec<u8>,
    config: &'a SenderConfig,
}

impl Output<'_> {
    /// Sends `gpas` as one CompressedPages record if compression is on, wanted for this batch
    /// and saves enough (`compress.rs`); whether it did.
    fn compressed(&mut self, gpas: &[u64]) -> Result<bool, MigrateError> {
        let Some(c) = &mut self.compressor else {
            return Ok(false);
        };
        let cap = match self.config.link_cap.load(Ordering::Relaxed) {
            0 => None,
            rate => Some(rate as f64),
        };
        if !c.wants(cap) {
            return Ok(false);
        }
        self.gathered.resize(gpas.len() * PAGE_SIZE as usize, 0);
        self.ram.copy_pages(gpas, &mut self.gathered)?;
        let frame = c
            .compress(&self.gathered)
            .map_err(|e| MigrateError::io("compressing pages", e))?;
        let Some(frame) = frame else {
            return Ok(false);
        };
        // The addresses and the frame go as they are, under one checksum over both.
        let addresses: Vec<u8> = gpas.iter().flat_map(|a| a.to_le_bytes()).collect();
        let len = (addresses.len() + frame.len()) as u64;
        let header = Header::new(Kind::CompressedPages, gpas.len() as u32, len)
            .with_crc(wire::crc_append(wire::crc(&addresses), frame));
        self.conn.write_header(&header)?;
        self.conn
            .write_all(&addresses, "sending compressed pages")?;
        self.conn.write_all(frame, "sending compressed pages")?;
        Ok(true)
    }

    /// Writes and flushes a record without payload (a pass end, the postcopy marker), counted
    /// with the channel's bytes like any record: the destination acknowledges it, and a byte
    /// acknowledged but never counted here would hide as much in flight (a 40-byte discard
    /// list looked applied before the destination had read it, and the pause waited for it).
    fn marker(&mut self, header: Header, during: &'static str) -> Result<(), MigrateError> {
        self.conn.write_header(&header)?;
        self.conn.flush(during)?;
        self.config
            .bytes
            .fetch_add(wire::HEADER_SIZE as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Sends a scanned batch: zero pages as runs of adjacent pages, the rest as one Pages
    /// record of the batch's non-zero pages, in batch order.
    fn send(&mut self, c: Completion) -> Result<(), MigrateError> {
        let mut batch = c.batch;
        // A completion without one answer per page is one the detector failed: zipping it
        // would drop pages.
        if !c.ok || batch.zero.len() != batch.gpas.len() {
            self.stats.fallbacks += 1;
            batch.scan_inline(self.ram);
        }
        let before = self.conn.bytes_written;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut normal = Vec::with_capacity(batch.gpas.len());
        for (&gpa, &zero) in batch.gpas.iter().zip(&batch.zero) {
            if zero {
                match runs.last_mut() {
                    Some((start, n))
                        if *start + *n * PAGE_SIZE == gpa && *n < wire::MAX_ZERO_RUN_PAGES =>
                    {
                        *n += 1
                    }
                    _ => runs.push((gpa, 1)),
                }
            } else {
                normal.push(gpa);
            }
        }
        for chunk in runs.chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize) {
            let words = wire::encode_runs(chunk);
            self.conn
                .write_record(&Header::zero_runs(chunk.len() as u32), &words)?;
        }
        let data_before = self.conn.bytes_written;
        if !normal.is_empty() && !self.compressed(&normal)? {
            let (before, started) = (self.conn.bytes_written, Instant::now());
            write_record(self.conn, self.ram, &normal, self.copy.as_mut())?;
            if let Some(c) = &mut self.compressor {
                c.wrote(self.conn.bytes_written - before, started.elapsed());
            }
        }
        let c = self.config;
        c.data_pages
            .fetch_add(normal.len() as u64 * PAGE_SIZE, Ordering::Relaxed);
        c.data_wire
            .fetch_add(self.conn.bytes_written - data_before, Ordering::Relaxed);
        self.stats.pages_zero += (batch.gpas.len() - normal.len()) as u64;
        self.stats.pages_normal += normal.len() as u64;
        self.config
            .bytes
            .fetch_add(self.conn.bytes_written - before, Ordering::Relaxed);
        self.config
            .pages
            .fetch_add(batch.gpas.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}
