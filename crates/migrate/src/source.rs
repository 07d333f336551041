//! The sending side: setup, pass 1 over populated memory, dirty passes until the policy says
//! switch over, then pause, send the rest and the device state, and wait for the destination
//! to resume the guest.
//!
//! Pages travel on `channels` data connections, each with a sender thread (see `sender.rs`) fed
//! batches of `packet_pages` addresses round-robin; the main connection carries pass ends,
//! device state and Complete. Every step is bounded: batches are at most 2 MiB, dirty tracking
//! is re-armed in chunks of [`CLEAR_CHUNK_PAGES`], the bitmap walk scans a bounded number of
//! words per call, and between any two of these the loop checks cancellation and the rate
//! limit.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::bitmap::{Cursor, DirtyBitmap};
use crate::conn::Conn;
use crate::control::{Control, Phase};
use crate::error::MigrateError;
use crate::policy::{self, Decision, Observation, Policy};
use crate::ram::Ram;
use crate::scan::ZeroDetection;
use crate::sender::{ChannelMsg, Sender, SenderConfig};
use crate::stats::{self, MigrationStats, PassStats, Sample, SampleKind, Timeline};
use crate::transport::Stream;
use crate::vm::SourceVm;
use crate::wire::{self, Capabilities, Header, Hello, Kind, PAGE_SIZE, Role};

/// Pages re-armed per `clear_dirty` call in pass 1: 64 MiB, about 1 ms of write-protecting on
/// a normal host, and 1024 calls for a 64 GiB guest.
pub const CLEAR_CHUNK_PAGES: u64 = 16 * 1024;
/// Window over which the send rate is measured for the convergence decision: long enough to
/// span several records, short enough to follow a changing link.
const BANDWIDTH_WINDOW: Duration = Duration::from_secs(1);
/// Longest the rate limiter sleeps before looking at cancellation again.
const MAX_SLEEP: Duration = Duration::from_millis(50);
/// How long the source waits for the destination to load the state and resume the guest.
const RESUME_TIMEOUT: Duration = Duration::from_secs(30);
/// The protocol features this source asks for: none yet (postcopy will be the first).
const REQUESTED: Capabilities = Capabilities::NONE;

/// How to migrate.
#[derive(Clone, Copy, Debug)]
pub struct SourceParams {
    pub policy: Policy,
    /// Bytes per second, `None` = unlimited.
    pub max_bandwidth: Option<u64>,
    pub uuid: [u8; 16],
    /// Data channels (QEMU: multifd-channels), 1..=[`wire::MAX_CHANNELS`].
    pub channels: u16,
    /// Pages per batch (QEMU: the multifd packet size / 4096), 1..=512.
    pub packet_pages: u32,
    pub zero: ZeroDetection,
    /// Tests only: make the offload engine fail every n-th batch.
    pub offload_fail_every: Option<u64>,
}

/// Default data channels: two streams already beat one on loopback, and each costs a thread on
/// both sides of a small machine.
pub const DEFAULT_CHANNELS: u16 = 2;
/// Default batch: 512 KiB (128 pages), QEMU's multifd packet size.
pub const DEFAULT_PACKET_PAGES: u32 = 128;

impl SourceParams {
    pub fn new(policy: Policy, uuid: [u8; 16]) -> SourceParams {
        SourceParams {
            policy,
            max_bandwidth: None,
            uuid,
            channels: DEFAULT_CHANNELS,
            packet_pages: DEFAULT_PACKET_PAGES,
            zero: ZeroDetection::Inline,
            offload_fail_every: None,
        }
    }
}

/// Migrates `vm` over `stream`. On success the source VM is left paused (the guest runs on the
/// destination); on any failure before the guest was handed over it runs again, with nothing
/// lost, and a later migration sends everything anew.
pub fn migrate<S: Stream + 'static>(
    vm: &mut dyn SourceVm,
    stream: S,
    connect: &dyn Fn() -> std::io::Result<S>,
    params: &SourceParams,
    control: &Control,
) -> Result<MigrationStats, MigrateError> {
    if params.channels == 0 || params.channels > wire::MAX_CHANNELS {
        return Err(MigrateError::Order(format!(
            "{} channels requested; use 1 to {}",
            params.channels,
            wire::MAX_CHANNELS
        )));
    }
    if params.packet_pages == 0 || params.packet_pages > wire::MAX_PAGES_PER_RECORD {
        return Err(MigrateError::Order(format!(
            "packet size of {} pages is outside 1..={} (4 KiB to 2 MiB)",
            params.packet_pages,
            wire::MAX_PAGES_PER_RECORD
        )));
    }
    let conn = Conn::new(Box::new(stream))
        .map_err(|e| MigrateError::io("setting up the connection", e))?;
    let ram = Ram::new(vm.ram())?;
    let mut source = Source {
        bitmap: DirtyBitmap::new(ram.regions()),
        ram,
        conn,
        params: *params,
        control,
        start: Instant::now(),
        cpu_start: stats::thread_cpu_ns(),
        stats: MigrationStats::default(),
        window: VecDeque::new(),
        paused: false,
        handed_over: false,
        senders: Vec::new(),
        next_sender: 0,
        data_bytes: Arc::new(AtomicU64::new(0)),
        limiter_start: Instant::now(),
        limiter_bytes: 0,
        samples: 0,
        timeline: Timeline::default(),
        pass: 0,
        phase: Phase::Setup,
    };
    control.update(|p| p.phase = Phase::Setup);
    let connect = || connect().map(|s| Box::new(s) as Box<dyn Stream>);
    let result = source.run(vm, &connect);
    for mut sender in source.senders.drain(..) {
        let _ = sender.finish();
    }
    vm.stop_dirty_log();
    match result {
        Ok(()) => {
            source.mark(Phase::Completed);
            let s = source.finish_stats();
            control.update(|p| {
                p.phase = Phase::Completed;
                p.stats = Some(s.clone());
            });
            Ok(s)
        }
        Err(e) => {
            let e = source.explain(e);
            if !source.handed_over {
                source.conn.send_error(&e.to_string());
                if source.paused {
                    vm.resume()?;
                }
            }
            let phase = match e {
                MigrateError::Cancelled => Phase::Cancelled,
                _ => Phase::Failed,
            };
            source.mark(phase);
            let s = source.finish_stats();
            control.update(|p| {
                p.phase = phase;
                p.error = Some(e.to_string());
                p.stats = Some(s);
            });
            Err(e)
        }
    }
}

struct Source<'a> {
    ram: Ram,
    bitmap: DirtyBitmap,
    conn: Conn,
    params: SourceParams,
    control: &'a Control,
    start: Instant,
    cpu_start: u64,
    stats: MigrationStats,
    /// (time, bytes written) samples for the bandwidth window.
    window: VecDeque<(Instant, u64)>,
    paused: bool,
    /// Complete was sent: from here the guest may run on the destination, so the source must
    /// never run it again.
    handed_over: bool,
    senders: Vec<Sender>,
    next_sender: usize,
    /// Bytes all data channels wrote.
    data_bytes: Arc<AtomicU64>,
    limiter_start: Instant,
    limiter_bytes: u64,
    samples: u64,
    /// The report's time series, and the pass and phase its samples are tagged with.
    timeline: Timeline,
    pass: u32,
    phase: Phase,
}

impl Source<'_> {
    fn run(
        &mut self,
        vm: &mut dyn SourceVm,
        connect: &dyn Fn() -> std::io::Result<Box<dyn Stream>>,
    ) -> Result<(), MigrateError> {
        self.conn.write_hello(&Hello {
            role: Role::Main,
            channel: 0,
            uuid: self.params.uuid,
            memory_size: self.ram.size(),
            status: 0,
            channels: self.params.channels,
            capabilities: REQUESTED,
        })?;
        let reply = self.conn.read_hello()?;
        if !reply.capabilities.is_subset(REQUESTED) {
            return Err(MigrateError::Order(format!(
                "the destination granted capabilities {:#x} that were not asked for",
                reply.capabilities.0
            )));
        }
        if reply.status != wire::Refusal::Accepted as u32 {
            return Err(MigrateError::Refused(match reply.status {
                1 => format!(
                    "guest memory sizes differ (source {} bytes, destination {} bytes); start the destination with the same --memory",
                    self.ram.size(),
                    reply.memory_size
                ),
                5 => "the destination is busy with another migration; start another `ferry run --incoming` for this one".into(),
                s => format!("status {s}"),
            }));
        }
        self.open_channels(connect)?;
        vm.start_dirty_log()?;
        self.stats.setup_ms = ms(self.start.elapsed());
        self.set_phase(Phase::Precopy);

        self.first_pass(vm)?;
        let mut pass = 1;
        loop {
            let pass_started = Instant::now();
            let before = self.bitmap.count();
            let t = Instant::now();
            vm.fetch_dirty(&mut self.bitmap)?;
            self.stats.max_sync_ms = self.stats.max_sync_ms.max(ms(t.elapsed()));
            let last = self.stats.passes.last_mut().expect("pass 1 ran");
            last.dirty_rate_pages_per_s =
                (self.bitmap.count() - before) as f64 / (last.duration_ms / 1000.0).max(1e-3);
            let dirty_rate = last.dirty_rate_pages_per_s;
            self.sample(SampleKind::Boundary);
            let now = Observation {
                remaining_bytes: self.bitmap.count() * PAGE_SIZE,
                bandwidth: self.bandwidth(),
                elapsed: self.start.elapsed(),
            };
            let sent = self.bytes_written();
            self.control.update(|p| {
                p.pass = pass;
                p.bytes_sent = sent;
                p.remaining_bytes = now.remaining_bytes;
                p.bandwidth_mb_s = now.bandwidth / 1e6;
                p.dirty_rate_pages_per_s = dirty_rate;
                p.expected_downtime_ms = now.expected_downtime().map(ms);
                p.elapsed_ms = ms(now.elapsed);
            });
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
                Decision::Iterate => {}
            }
            pass += 1;
            self.dirty_pass(pass, false, pass_started)?;
        }
        self.switchover(vm, pass + 1)
    }

    /// Pass 1: re-arm dirty tracking for each region, chunk by chunk, then send what its
    /// backing file holds, walking populated ranges with `SEEK_DATA`/`SEEK_HOLE`. Re-arming the
    /// whole region before looking is what makes the walk safe: a page populated after the look
    /// was written after its re-arm, so the dirty log has it. (Looking chunk by chunk instead
    /// would make each `SEEK_HOLE` walk the rest of a fully populated file: quadratic.)
    fn first_pass(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        let started = Instant::now();
        self.pass = 1;
        let (mut pages, bytes_before) = (0u64, self.bytes_written());
        let mut batch = Vec::with_capacity(wire::MAX_PAGES_PER_RECORD as usize);
        for (index, region) in self.ram.regions().to_vec().iter().enumerate() {
            let end = region.gpa + region.size;
            let t = Instant::now();
            let mut chunk = region.gpa;
            while chunk < end {
                self.check_control()?;
                let chunk_end = (chunk + CLEAR_CHUNK_PAGES * PAGE_SIZE).min(end);
                vm.clear_dirty(chunk, (chunk_end - chunk) / PAGE_SIZE)?;
                chunk = chunk_end;
            }
            self.stats.dirty_clear_ms += ms(t.elapsed());
            let mut at = region.gpa;
            while let Some((data, hole)) = self
                .ram
                .next_data(index, at)
                .map_err(|e| MigrateError::io("looking for populated memory", e))?
            {
                for gpa in (data..hole.min(end)).step_by(PAGE_SIZE as usize) {
                    batch.push(gpa);
                    if batch.len() == batch.capacity() {
                        self.check_control()?;
                        pages += self.send_pages(&batch, true)?;
                        batch.clear();
                    }
                }
                at = hole;
                if at >= end {
                    break;
                }
            }
        }
        pages += self.send_pages(&batch, true)?;
        self.stats.pages_skipped_holes = self.ram.size() / PAGE_SIZE - pages;
        self.end_pass(1, false, pages, bytes_before, started)
    }

    /// Sends every page marked in the bitmap.
    fn dirty_pass(
        &mut self,
        pass: u32,
        paused: bool,
        started: Instant,
    ) -> Result<(), MigrateError> {
        self.pass = pass;
        let (mut pages, bytes_before) = (0u64, self.bytes_written());
        let mut cursor = Cursor::default();
        let mut batch = Vec::with_capacity(wire::MAX_PAGES_PER_RECORD as usize);
        while !cursor.at_end(&self.bitmap) {
            if !paused {
                self.check_control()?;
            }
            self.bitmap.take(&mut cursor, batch.capacity(), &mut batch);
            pages += self.send_pages(&batch, !paused)?;
            batch.clear();
        }
        self.end_pass(pass, paused, pages, bytes_before, started)
    }

    fn end_pass(
        &mut self,
        pass: u32,
        paused: bool,
        pages: u64,
        bytes_before: u64,
        started: Instant,
    ) -> Result<(), MigrateError> {
        for i in 0..self.senders.len() {
            self.queue_for(i, ChannelMsg::EndOfPass(pass))?;
        }
        self.conn
            .write_header(&Header::new(Kind::EndOfPass, pass, 0))?;
        self.conn.flush("ending a pass")?;
        self.stats.passes.push(PassStats {
            pass,
            paused,
            pages,
            bytes: self.bytes_written() - bytes_before,
            duration_ms: ms(started.elapsed()),
            dirty_rate_pages_per_s: 0.0,
        });
        self.sample(SampleKind::Boundary);
        Ok(())
    }

    /// Connects and greets the data channels, and starts their senders.
    fn open_channels(
        &mut self,
        connect: &dyn Fn() -> std::io::Result<Box<dyn Stream>>,
    ) -> Result<(), MigrateError> {
        let io = |e| MigrateError::io("connecting a data channel", e);
        for channel in 1..=self.params.channels {
            let stream = connect().map_err(io)?;
            let mut c = Conn::new(stream.try_clone_stream().map_err(io)?).map_err(io)?;
            c.write_hello(&Hello {
                role: Role::Data,
                channel,
                uuid: self.params.uuid,
                memory_size: self.ram.size(),
                status: 0,
                channels: self.params.channels,
                capabilities: Capabilities::NONE,
            })?;
            let reply = c.read_hello()?;
            if reply.status != wire::Refusal::Accepted as u32 {
                return Err(MigrateError::Refused(format!(
                    "data channel {channel} refused with status {}",
                    reply.status
                )));
            }
            let config = SenderConfig {
                zero: self.params.zero,
                offload_fail_every: self.params.offload_fail_every,
                bytes: self.data_bytes.clone(),
            };
            self.senders
                .push(Sender::start(channel, stream, self.ram.clone(), config)?);
        }
        Ok(())
    }

    /// Hands `gpas` to the data channels in batches of `packet_pages`, round-robin. Returns the
    /// pages handed over.
    fn send_pages(&mut self, gpas: &[u64], limited: bool) -> Result<u64, MigrateError> {
        for batch in gpas.chunks(self.params.packet_pages as usize) {
            if limited {
                self.rate_limit(batch.len() as u64 * (8 + PAGE_SIZE))?;
            }
            self.queue_for(self.next_sender, ChannelMsg::Pages(batch.to_vec()))?;
            self.next_sender = (self.next_sender + 1) % self.senders.len();
        }
        self.sample_bandwidth();
        Ok(gpas.len() as u64)
    }

    /// Queues `msg` for sender `i`; if that sender has stopped, returns why.
    fn queue_for(&mut self, i: usize, msg: ChannelMsg) -> Result<(), MigrateError> {
        if self.senders[i].send(msg) {
            return Ok(());
        }
        Err(match self.senders[i].finish() {
            Err(e) => e,
            Ok(_) => MigrateError::Order(format!("data channel {} stopped early", i + 1)),
        })
    }

    /// Bytes written on all connections.
    fn bytes_written(&self) -> u64 {
        self.conn.bytes_written + self.data_bytes.load(Ordering::Relaxed)
    }

    /// Flushes and closes every data channel and collects the senders' counts; a sender that
    /// failed fails the migration before the guest is handed over.
    fn close_channels(&mut self) -> Result<(), MigrateError> {
        for i in 0..self.senders.len() {
            self.queue_for(i, ChannelMsg::Shutdown)?;
        }
        for mut sender in self.senders.drain(..) {
            let s = sender.finish()?;
            self.stats.pages_normal += s.pages_normal;
            self.stats.pages_zero += s.pages_zero;
            self.stats.zero_scan_fallbacks += s.fallbacks;
            self.stats.cpu_seconds_source += s.cpu_ns as f64 / 1e9;
        }
        Ok(())
    }

    fn switchover(&mut self, vm: &mut dyn SourceVm, pass: u32) -> Result<(), MigrateError> {
        self.set_phase(Phase::Switchover);
        let t0 = Instant::now();
        vm.pause()?;
        self.paused = true;
        let t1 = Instant::now();
        vm.fetch_dirty(&mut self.bitmap)?;
        let t2 = Instant::now();
        self.dirty_pass(pass, true, t2)?;
        self.close_channels()?;
        let t3 = Instant::now();
        let sections = vm.save_state()?;
        let t4 = Instant::now();
        for s in &sections {
            self.conn
                .write_section(s.header(), &s.data, "sending device state")?;
        }
        self.conn.write_header(&Header::new(Kind::Complete, 0, 0))?;
        self.conn.flush("completing")?;
        self.handed_over = true;
        let (load_ns, resume_ns, cpu_ns) = self
            .await_resumed()
            .map_err(|e| MigrateError::Unacknowledged(Box::new(e)))?;
        let t6 = Instant::now();
        let d = &mut self.stats.downtime;
        d.total_ms = ms(t6 - t0);
        d.pause_ms = ms(t1 - t0);
        d.final_sync_ms = ms(t2 - t1);
        d.final_pages_ms = ms(t3 - t2);
        d.state_save_ms = ms(t4 - t3);
        d.load_ms = load_ns as f64 / 1e6;
        d.resume_ms = resume_ns as f64 / 1e6;
        d.transfer_ms = (ms(t6 - t4) - d.load_ms - d.resume_ms).max(0.0);
        self.stats.cpu_seconds_destination = cpu_ns as f64 / 1e9;
        Ok(())
    }

    fn await_resumed(&mut self) -> Result<(u64, u64, u64), MigrateError> {
        let _ = self.conn.stream().set_read_timeout(Some(RESUME_TIMEOUT));
        let h = self
            .conn
            .read_header("waiting for the destination to resume the guest")?;
        let payload = self
            .conn
            .read_payload(h.len, "reading the destination's answer")?;
        match h.kind {
            Kind::Resumed => {
                let w =
                    |i: usize| u64::from_le_bytes(payload[8 * i..8 * i + 8].try_into().unwrap());
                Ok((w(0), w(1), w(2)))
            }
            Kind::Error => Err(MigrateError::Remote(
                String::from_utf8_lossy(&payload).into_owned(),
            )),
            k => Err(MigrateError::Order(format!(
                "expected Resumed from the destination, got {k:?}"
            ))),
        }
    }

    fn check_control(&self) -> Result<(), MigrateError> {
        if self.control.cancelled() {
            return Err(MigrateError::Cancelled);
        }
        Ok(())
    }

    /// Sleeps, in slices that look at cancellation, until sending `bytes` more keeps the
    /// average at or under `max_bandwidth`.
    fn rate_limit(&mut self, bytes: u64) -> Result<(), MigrateError> {
        let Some(rate) = self.params.max_bandwidth else {
            return Ok(());
        };
        self.limiter_bytes += bytes;
        loop {
            self.check_control()?;
            let due = self.limiter_start
                + Duration::from_secs_f64(self.limiter_bytes as f64 / rate as f64);
            let now = Instant::now();
            if due <= now {
                return Ok(());
            }
            std::thread::sleep((due - now).min(MAX_SLEEP));
        }
    }

    fn sample_bandwidth(&mut self) {
        let now = Instant::now();
        self.window.push_back((now, self.bytes_written()));
        while self.window.len() > 2 && now - self.window[1].0 >= BANDWIDTH_WINDOW {
            self.window.pop_front();
        }
        self.samples += 1;
        self.sample(SampleKind::Tick);
        // Publish progress every 16 records (~32 MiB): often enough to watch, cheap enough.
        if self.samples.is_multiple_of(16) {
            let (sent, bandwidth, elapsed) =
                (self.bytes_written(), self.bandwidth(), self.start.elapsed());
            self.control.update(|p| {
                p.bytes_sent = sent;
                p.bandwidth_mb_s = bandwidth / 1e6;
                p.elapsed_ms = ms(elapsed);
            });
        }
    }

    /// Publishes a new phase and marks it on the timeline.
    fn set_phase(&mut self, phase: Phase) {
        self.control.update(|p| p.phase = phase);
        self.mark(phase);
    }

    /// Marks a phase on the timeline only (the final phase is published with the statistics).
    fn mark(&mut self, phase: Phase) {
        self.phase = phase;
        self.sample(SampleKind::Boundary);
    }

    /// Records where the migration stands on the report's timeline.
    fn sample(&mut self, kind: SampleKind) {
        let sample = Sample {
            t_ms: ms(self.start.elapsed()),
            bytes_sent: self.bytes_written(),
            remaining_bytes: self.bitmap.count() * PAGE_SIZE,
            send_rate_mb_s: self.bandwidth() / 1e6,
            dirty_rate_pages_per_s: self
                .stats
                .passes
                .last()
                .map_or(0.0, |p| p.dirty_rate_pages_per_s),
            pass: self.pass,
            phase: self.phase,
        };
        self.timeline.record(sample, kind);
    }

    /// Bytes per second over the recent window.
    fn bandwidth(&self) -> f64 {
        match (self.window.front(), self.window.back()) {
            (Some(&(t0, b0)), Some(&(t1, b1))) if t1 > t0 => {
                (b1 - b0) as f64 / (t1 - t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// A failed write may hide the destination's own explanation: look for it.
    fn explain(&mut self, e: MigrateError) -> MigrateError {
        match e {
            MigrateError::Io { .. } | MigrateError::Truncated { .. } => {
                match self.conn.peer_error() {
                    Some(message) => MigrateError::Remote(message),
                    None => e,
                }
            }
            e => e,
        }
    }

    fn finish_stats(&mut self) -> MigrationStats {
        let mut s = self.stats.clone();
        s.timeline = self.timeline.samples().to_vec();
        s.total_ms = ms(self.start.elapsed());
        s.bytes_sent = self.bytes_written();
        s.bandwidth_mb_s = s.bytes_sent as f64 / 1e6 / (s.total_ms / 1000.0).max(1e-3);
        s.cpu_seconds_source += (stats::thread_cpu_ns() - self.cpu_start) as f64 / 1e9;
        s
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
