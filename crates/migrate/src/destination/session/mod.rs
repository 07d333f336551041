//! One incoming migration as a value with phases: [`Session::new`] takes the main connection
//! and its hello, [`Session::handshake`] accepts or refuses it, and [`Session::run`] connects
//! the announced data channels, follows the main channel through the passes, loads the device
//! state, resumes the guest and acknowledges. Each phase is a method; what the phases share
//! (connections, receivers, counters) is the session's, and it is consumed when it ends.
//! Here: the handshake, the run, precopy on the main channel, and the load and resume; in
//! `channels.rs` the data channels' connection and the join of their receivers; in
//! `postcopy.rs` the postcopy phase; in `recover.rs` postcopy-paused and its recovery. Those
//! add their methods to [`Session`] and nothing here names them, so the files stand on this one
//! and not the other way round.
//!
//! When the source asked for [`Capabilities::PROGRESS`], an [`Acker`] thread acknowledges
//! what arrived on the main connection from the moment every data channel connected until
//! Complete (or a failure); the session writes on the main connection only before it starts and
//! after it stopped.

#![forbid(unsafe_code)]

use std::net::Shutdown;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::acker::Acker;
use super::arrival::{Arrival, Arrivals, HELLO_TIMEOUT, RECORD_TIMEOUT};
use super::gate::PostcopyGate;
use super::order::{self, Step};
use super::postcopy::Postcopy;
use super::progress::Watchdog;
use super::progress::{IncomingControl, IncomingPhase};
use super::receiver::{self, ReceiverStats};
use super::sections::Sections;
use crate::conn::Conn;
use crate::error::{MigrateError, Rule};
use crate::ram::Ram;
use crate::stats;
use crate::transport::Stream;
use crate::vm::{DestinationVm, Section, VmError};
use crate::wire::{self, Capabilities, Header, Hello, Kind, PAGE_SIZE, Refusal, Role};

mod channels;
mod chunks;
mod local;
mod postcopy;
mod recover;

/// What the destination measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReceiveStats {
    pub pages: u64,
    pub zero_pages: u64,
    pub passes: u32,
    pub channels: u16,
    pub load: Duration,
    pub resume: Duration,
    /// CPU time of the data channels' receiver threads.
    pub receiver_cpu_ns: u64,
    /// Of it, the CPU time spent decoding compressed records, and how many there were.
    pub decompress_cpu_ns: u64,
    pub compressed_records: u64,
    /// Chunks of iterative device state loaded while the guest ran on the source, and their
    /// bytes.
    pub state_chunks: u64,
    pub state_chunk_bytes: u64,
    /// What postcopy did here, if the source switched to it.
    pub postcopy: Option<PostcopyReceived>,
}

/// The destination's postcopy figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PostcopyReceived {
    /// A request's stages on this side: fault read to request written, the install of a record
    /// that brings a waited-for page, and its wakes.
    pub ask: crate::stats::Stage,
    pub install: crate::stats::Stage,
    pub wake: crate::stats::Stage,
    /// Pages on the discard list, fetched from the source after the switch.
    pub pages: u64,
    /// Faults on pages that were not needed (holes), filled with zeros here.
    pub zero_fills: u64,
    /// Fault messages the fault thread read (a vCPU or VMM thread touching a missing page).
    pub faults: u64,
    /// Fault to page in place, for the pages a vCPU waited for.
    pub latencies: wire::Latencies,
    /// Resume to the last page in place.
    pub duration: Duration,
    /// Times a broken connection paused postcopy and a recovery resumed it.
    pub recoveries: u32,
    /// Time spent in postcopy-paused.
    pub paused: Duration,
    /// Postcopy ran over the memory this side held (minor faults: pages written into the
    /// file and mapped, none freed and allocated again); else over holes punched at the
    /// discard (missing faults).
    pub over_held: bool,
    /// Where the receivers' time went (`stage_clock.rs`).
    pub intake: crate::stage_clock::IntakeStages,
}

/// A receiver thread and a handle to shut its socket down.
#[derive(Debug)]
struct Running {
    channel: u16,
    thread: JoinHandle<Result<ReceiverStats, MigrateError>>,
    stream: Box<dyn Stream>,
}

/// One incoming migration.
pub struct Session<'a> {
    vm: &'a mut dyn DestinationVm,
    conn: Conn,
    hello: Hello,
    control: Arc<IncomingControl>,
    ram: Ram,
    shared: Option<receiver::Shared>,
    receivers: Vec<Running>,
    /// What the main hello's reply granted.
    granted: Capabilities,
    /// Acknowledges progress while pages arrive, when [`Capabilities::PROGRESS`] was granted.
    acker: Option<Acker>,
    /// Postcopy's state, from the first Discard (or the Postcopy record) on.
    postcopy: Option<Arc<Postcopy>>,
    /// Where the receivers wait for postcopy to begin.
    gate: Arc<PostcopyGate>,
    stats: ReceiveStats,
    cpu_start: u64,
    /// Postcopy recoveries so far, and the time spent paused.
    recoveries: u32,
    paused: Duration,
    /// Gives up on a source that sends nothing for the peer timeout; stops with the session.
    _watchdog: Option<Watchdog>,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("hello", &self.hello)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<'a> Session<'a> {
    /// A session for the main connection `main`, whose hello was read.
    pub fn new(
        vm: &'a mut dyn DestinationVm,
        main: Arrival,
        control: Arc<IncomingControl>,
    ) -> Result<Session<'a>, MigrateError> {
        let ram = Ram::new(vm.ram())?;
        control.register(main.stream.as_ref());
        let peer = main.stream.peer();
        let conn =
            Conn::new(main.stream).map_err(|e| MigrateError::io("setting up the connection", e))?;
        let _ = conn.stream().set_read_timeout(Some(RECORD_TIMEOUT));
        control.update(|p| p.source = Some(peer));
        let watchdog = control.watch();
        Ok(Session {
            vm,
            conn,
            hello: main.hello,
            control,
            ram,
            shared: None,
            receivers: Vec::new(),
            granted: Capabilities::NONE,
            acker: None,
            postcopy: None,
            gate: Arc::new(PostcopyGate::default()),
            stats: ReceiveStats::default(),
            cpu_start: stats::thread_cpu_ns(),
            recoveries: 0,
            paused: Duration::ZERO,
            _watchdog: watchdog,
        })
    }

    /// With [`Capabilities::CONFIG`] asked for, reads the source's VmConfig record and asks the
    /// VMM whether this VM can take that guest; the VMM's reason if not.
    fn config_refusal(&mut self, hello: &Hello) -> Result<Option<String>, MigrateError> {
        if !hello.capabilities.contains(Capabilities::CONFIG) {
            return Ok(None);
        }
        let during = "reading the source VM's configuration";
        // A source sends it right after its hello: a peer that asked to send it and then says
        // nothing holds this destination (busy to every other source) no longer than a hello
        // may take, or the peer timeout if shorter.
        let within = self
            .control
            .peer_timeout()
            .map_or(HELLO_TIMEOUT, |t| t.min(HELLO_TIMEOUT));
        let _ = self.conn.stream().set_read_timeout(Some(within));
        let h = self.conn.read_header(during);
        let _ = self.conn.stream().set_read_timeout(Some(RECORD_TIMEOUT));
        let h = h?;
        if h.kind != Kind::VmConfig {
            return Err(MigrateError::misplaced(h.kind, Rule::ConfigFirst));
        }
        let config = self.conn.read_payload(&h, during)?;
        // Taken in like any record: the source counts it as written, and a byte it never saw
        // acknowledged would look in flight for the whole migration.
        let c = &self.control;
        c.add(&c.bytes, wire::HEADER_SIZE as u64 + h.len);
        Ok(self.vm.check_config(&config).err().map(|e| match e {
            VmError::Failed { source, .. } => source.to_string(),
            e => e.to_string(),
        }))
    }

    /// Phase 1: accepts the main hello or refuses it (the reply says why, and so does the
    /// error). A refused session has touched nothing.
    pub fn handshake(self) -> Result<Session<'a>, MigrateError> {
        self.handshake_then(|| {})
    }

    /// [`Session::handshake`], calling `before_refusal` before a refusal is sent: a waiting
    /// destination reopens to the next source there, so that a source that tries again as
    /// soon as it reads its refusal is not refused as a second one.
    pub(crate) fn handshake_then(
        mut self,
        before_refusal: impl FnOnce(),
    ) -> Result<Session<'a>, MigrateError> {
        let hello = self.hello;
        let (mut offered, page_shift) = supported(&self.ram);
        // Iterative state where the VMM takes it, and only beside progress acknowledgements,
        // whose connection carries the StateReady.
        if self.vm.state_ready().is_err() || !hello.capabilities.contains(Capabilities::PROGRESS) {
            offered = Capabilities(offered.0 & !Capabilities::ITERATIVE_STATE.0);
        }
        // Descriptors ride only on a Unix socket (not on TLS over one), and devices' go only
        // to a VMM whose devices take them.
        if !self.conn.stream().carries_fds() {
            offered = Capabilities(offered.0 & !Capabilities::LOCAL.0);
        }
        if !offered.contains(Capabilities::LOCAL) || !self.vm.takes_device_fds() {
            offered = Capabilities(offered.0 & !Capabilities::LOCAL_DEVICES.0);
        }
        let mut reply = Hello {
            role: Role::Main,
            channel: wire::MAIN_CHANNEL,
            uuid: hello.uuid,
            memory_size: self.ram.size(),
            status: Refusal::Accepted as u32,
            channels: hello.channels,
            capabilities: hello.capabilities.grant(offered),
            postcopy_page_shift: 0,
        };
        let refusal = if hello.role != Role::Main || hello.channel != wire::MAIN_CHANNEL {
            Some((
                Refusal::Role,
                "the first connection must be the main channel (role main, channel 0)".into(),
            ))
        } else if hello.memory_size != self.ram.size() {
            Some((
                Refusal::MemorySize,
                crate::error::memory_sizes_differ(hello.memory_size, self.ram.size()),
            ))
        } else if let Some(why) = self.config_refusal(&hello).unwrap_or_else(|e| {
            // Answered like a configuration that does not fit, so that the source hears why.
            Some(format!(
                "the source's VM configuration did not arrive intact: {e}"
            ))
        }) {
            Some((Refusal::Config, why))
        } else if hello.channels == 0 || hello.channels > wire::MAX_CHANNELS {
            Some((
                Refusal::ChannelId,
                format!(
                    "{} data channels announced; 1 to {} are allowed",
                    hello.channels,
                    wire::MAX_CHANNELS
                ),
            ))
        } else {
            None
        };
        if let Some((status, why)) = refusal {
            before_refusal();
            reply.status = status as u32;
            // The source puts its own "refused" before the reason.
            if self.conn.write_hello(&reply).is_ok() {
                self.conn.send_error(&why);
            }
            let e = MigrateError::Refused(why);
            self.control.unregister_all();
            return Err(e);
        }
        if reply.capabilities.contains(Capabilities::POSTCOPY) {
            reply.postcopy_page_shift = page_shift;
        }
        self.conn.write_hello(&reply)?;
        self.granted = reply.capabilities;
        self.conn.error_codes = reply.capabilities.contains(Capabilities::ERROR_CODES);
        self.control.update(|p| {
            p.phase = IncomingPhase::Handshake;
            p.channels_announced = hello.channels;
            p.postcopy_recover = reply.capabilities.contains(Capabilities::RECOVER);
        });
        Ok(self)
    }

    /// Phases 2 to 5: channels, precopy, state, resume. On success the guest runs; on error
    /// nothing runs, the source is told why, and every receiver has stopped.
    pub fn run(mut self, arrivals: &mut dyn Arrivals) -> Result<ReceiveStats, MigrateError> {
        let result = if self.granted.contains(Capabilities::LOCAL) {
            self.receive_locally()
        } else {
            self.receive(arrivals)
        };
        let result = result.map_err(|e| self.fail(e));
        self.control.unregister_all();
        self.control.update(|p| match &result {
            Ok(_) => p.phase = IncomingPhase::Completed,
            Err(e) => {
                p.phase = match e {
                    MigrateError::CancelledHere | MigrateError::CancelledThere(..) => {
                        IncomingPhase::Cancelled
                    }
                    _ => IncomingPhase::Failed,
                };
                p.error = Some(e.to_string());
            }
        });
        result
    }

    /// Phases 2 to 5 of a migration that sends pages.
    fn receive(&mut self, arrivals: &mut dyn Arrivals) -> Result<ReceiveStats, MigrateError> {
        // A StateReady is this migration's: none was said for it yet.
        self.control.forget_state_ready();
        self.connect_channels(arrivals)
            .and_then(|()| self.start_acks())
            .and_then(|()| self.precopy())
            .and_then(|ending| self.stop_acks().map(|()| ending))
            .and_then(|ending| match ending {
                PrecopyEnd::Complete(sections) => self.load_and_resume(&sections),
                PrecopyEnd::Postcopy(sections) => self.postcopy(&sections),
            })
    }

    /// Ends a failed session: names the cause, tells the source, stops the receivers.
    fn fail(&mut self, e: MigrateError) -> MigrateError {
        let e = if self.control.cancelled() {
            MigrateError::CancelledHere
        } else {
            self.silenced(e)
        };
        // The acker's own failure matters less than `e`, which is what the source is told.
        let _ = self.stop_acks();
        // The source's own error is not sent back; the source names this side as the sayer.
        if !e.from_the_peer() {
            self.conn.send_ending(&e);
        }
        if let Some(shared) = &self.shared {
            shared.barrier.fail("the main channel failed");
        }
        for r in self.receivers.drain(..) {
            let _ = r.stream.shutdown(Shutdown::Both);
            let _ = r.thread.join();
        }
        e
    }

    /// `e`, or what caused it: the watchdog gave up on a silent source.
    fn silenced(&self, e: MigrateError) -> MigrateError {
        if self.control.take_silence() {
            MigrateError::Stalled {
                during: "waiting for the source's next record",
            }
        } else {
            e
        }
    }

    /// Starts acknowledging progress if the source asked for it.
    fn start_acks(&mut self) -> Result<(), MigrateError> {
        if self.granted.contains(Capabilities::PROGRESS) {
            self.acker = Some(Acker::start(self.conn.stream(), self.control.clone())?);
        }
        Ok(())
    }

    /// Stops acknowledging (the main connection's write side is the session's again); an
    /// acknowledgement that could not be written ends the migration.
    fn stop_acks(&mut self) -> Result<(), MigrateError> {
        self.acker.take().map_or(Ok(()), Acker::stop)
    }

    /// Phase 3: the main channel's pass ends, then the device state up to Complete (every
    /// receiver finished every pass) or, with postcopy, the discard list and the device state
    /// up to Postcopy.
    fn precopy(&mut self) -> Result<PrecopyEnd, MigrateError> {
        let barrier = self
            .shared
            .as_ref()
            .expect("channels connected")
            .barrier
            .clone();
        let mut state = Sections::default();
        let mut at = order::Main::START;
        loop {
            let h = match self.conn.read_header("receiving the migration") {
                Ok(h) => h,
                Err(e) => return Err(self.explain_main_end(e)),
            };
            // A discard list counts as received once it is applied: the source waits for that
            // before pausing its guest, so that the punching is not downtime.
            let record = wire::HEADER_SIZE as u64 + h.len;
            let c = &self.control;
            if h.kind != Kind::Discard {
                c.add(&c.bytes, record);
            }
            let (then, step) = order::next(at, h.kind, h.count, self.granted)?;
            at = then;
            match step {
                Step::EndPass(pass) => {
                    self.stats.passes = pass;
                    self.check_state_ready()?;
                    barrier.wait(pass)?;
                    self.control.update(|p| p.passes = pass);
                }
                Step::Discard => {
                    let payload = self.conn.read_payload(&h, "receiving a discard list")?;
                    let pc = self.start_postcopy()?;
                    let w: Vec<u64> = wire::decode_addresses(&payload).collect();
                    for run in w.chunks_exact(2) {
                        pc.discard(run[0], run[1])?;
                    }
                    let c = &self.control;
                    c.add(&c.bytes, record);
                }
                Step::Section => {
                    let payload = self.conn.read_payload(&h, "receiving device state")?;
                    state.add(&payload)?;
                }
                Step::Chunk => {
                    let payload = self.conn.read_payload(&h, "receiving a state chunk")?;
                    self.load_chunk(&payload)?;
                }
                Step::Postcopy => {
                    self.start_postcopy()?;
                    return Ok(PrecopyEnd::Postcopy(state.into_vec()));
                }
                Step::Complete => {
                    self.join_receivers()?;
                    return Ok(PrecopyEnd::Complete(state.into_vec()));
                }
                Step::PeerError => {
                    let p = self.conn.read_payload(&h, "reading the source's error")?;
                    return Err(MigrateError::from_peer(crate::error::Side::Source, &h, &p));
                }
            }
        }
    }

    /// The main channel ended: a data channel's failure explains it better, so give the
    /// receivers a moment to report one.
    fn explain_main_end(&self, e: MigrateError) -> MigrateError {
        let barrier = &self.shared.as_ref().expect("channels connected").barrier;
        let deadline = Instant::now() + Duration::from_secs(1);
        while barrier.failure().is_none()
            && self.receivers.iter().any(|r| !r.thread.is_finished())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        barrier.failure().unwrap_or(e)
    }

    /// The Resumed record: load, resume and CPU times, and the VMM's parts of the load.
    fn resumed_record(&self, cpu: u64) -> (Header, Vec<u8>) {
        wire::ResumedRecord {
            load_ns: self.stats.load.as_nanos() as u64,
            resume_ns: self.stats.resume.as_nanos() as u64,
            cpu_ns: cpu,
            parts: self.vm.state_parts(),
        }
        .encode()
    }

    /// Phases 4 and 5: load every section, resume the guest, acknowledge with the times.
    fn load_and_resume(&mut self, sections: &[Section]) -> Result<ReceiveStats, MigrateError> {
        if self.control.cancelled() {
            return Err(MigrateError::CancelledHere);
        }
        self.control.update(|p| p.phase = IncomingPhase::Loading);
        let t = Instant::now();
        self.vm.load_state(sections)?;
        self.stats.load = t.elapsed();
        self.resume_and_acknowledge()
    }

    /// Resumes the guest and sends Resumed with the times. From the resume on nothing may fail
    /// the session: a lost acknowledgement leaves the source paused, which is what it must do.
    fn resume_and_acknowledge(&mut self) -> Result<ReceiveStats, MigrateError> {
        self.stats.resume = self.vm.resume()?;
        let cpu = stats::thread_cpu_ns() - self.cpu_start + self.stats.receiver_cpu_ns;
        let (header, payload) = self.resumed_record(cpu);
        let ack = self
            .conn
            .write_record(&header, &payload)
            .and_then(|()| self.conn.flush("acknowledging the resume"));
        if let Err(e) = ack {
            tracing::warn!(
                "the guest runs here, but the source did not get the acknowledgement: {e}"
            );
        }
        Ok(self.stats.clone())
    }
}

/// How the main channel ended precopy, with the device state.
enum PrecopyEnd {
    /// Every page arrived: load, resume, acknowledge.
    Complete(Vec<Section>),
    /// Load, resume, and fetch the rest while the guest runs.
    Postcopy(Vec<Section>),
}

/// What this destination offers, and the page shift postcopy uses: postcopy only where a
/// userfaultfd can be opened (it needs the kernel's support and the permission:
/// `vm.unprivileged_userfaultfd` or `CAP_SYS_PTRACE`, or access to `/dev/userfaultfd`) that
/// handles guest RAM's memory: shmem, or 2 MiB hugetlbfs pages with every region starting and
/// ending on one (postcopy's unit is the host page).
fn supported(ram: &Ram) -> (Capabilities, u8) {
    let without = Capabilities(
        Capabilities::SUPPORTED.0
            & !(Capabilities::POSTCOPY.0
                | Capabilities::PREEMPT.0
                | Capabilities::RECOVER.0
                | Capabilities::MAIN_PAGES.0),
    );
    let refuse = |why: &str| {
        tracing::warn!("postcopy is not offered: {why}");
        (without, 0)
    };
    let shift = match ram.host_page_size() {
        Some(PAGE_SIZE) => wire::SMALL_PAGE_SHIFT,
        Some(HUGE_PAGE) => wire::HUGE_PAGE_SHIFT,
        Some(other) => {
            return refuse(&format!(
                "guest RAM is on {} KiB host pages; postcopy handles 4 KiB and 2 MiB pages",
                other >> 10
            ));
        }
        None => return refuse("guest RAM mixes host page sizes"),
    };
    if shift == wire::HUGE_PAGE_SHIFT
        && ram
            .regions()
            .iter()
            .any(|r| !r.gpa.is_multiple_of(HUGE_PAGE) || !r.size.is_multiple_of(HUGE_PAGE))
    {
        return refuse("a region of guest RAM does not start and end on a 2 MiB page");
    }
    match crate::uffd::Uffd::new() {
        Ok(u) if shift == wire::SMALL_PAGE_SHIFT && !u.features().missing_shmem => {
            refuse("this kernel's userfaultfd cannot handle shared memory")
        }
        Ok(u) if shift == wire::HUGE_PAGE_SHIFT && !u.features().missing_hugetlbfs => {
            refuse("this kernel's userfaultfd cannot handle hugetlbfs")
        }
        // Requested pages on the main connection are whole records of 4 KiB pages; huge
        // pages are assembled on the data channels and the preempt connection only.
        Ok(_) if shift == wire::HUGE_PAGE_SHIFT => (
            Capabilities(Capabilities::SUPPORTED.0 & !Capabilities::MAIN_PAGES.0),
            shift,
        ),
        Ok(_) => (Capabilities::SUPPORTED, shift),
        Err(e) => refuse(&e.to_string()),
    }
}

/// A 2 MiB huge page.
const HUGE_PAGE: u64 = 1 << wire::HUGE_PAGE_SHIFT;
