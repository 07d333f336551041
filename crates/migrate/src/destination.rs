//! The receiving side: check the main hello, accept the announced data channels (each must
//! name this migration's uuid and a fresh channel id), then treat every byte as hostile. Data
//! channels carry pages and zero runs, each handled by a receiver thread; the main channel
//! carries pass ends, device state and Complete, in that order. Only after every mandatory
//! section loaded is the guest resumed.

#![forbid(unsafe_code)]

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::conn::Conn;
use crate::error::MigrateError;
use crate::ram::Ram;
use crate::receiver::{self, PageBits, PassBarrier, ReceiverStats};
use crate::stats;
use crate::vm::{DestinationVm, Section};
use crate::wire::{self, Header, Hello, Kind, PAGE_SIZE, Refusal, Role, SectionId};

/// How long the destination waits for the next record on the main channel before it gives up
/// on a silent source. Generous: the main channel is quiet while a long pass runs on the data
/// channels (a pass is bounded by the migration's own timeout, at most minutes).
const RECORD_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the announced data channels have to connect after the main hello.
pub const CHANNEL_TIMEOUT: Duration = Duration::from_secs(10);

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
}

/// Receives a migration whose main connection is `stream`; `accept(deadline)` yields the data
/// connections. On success the guest runs; on error nothing runs and the caller discards the
/// VM.
pub fn receive(
    vm: &mut dyn DestinationVm,
    stream: TcpStream,
    accept: &mut dyn FnMut(Instant) -> std::io::Result<TcpStream>,
) -> Result<ReceiveStats, MigrateError> {
    let mut conn =
        Conn::new(stream).map_err(|e| MigrateError::io("setting up the connection", e))?;
    let _ = conn.stream().set_read_timeout(Some(RECORD_TIMEOUT));
    let ram = Ram::new(vm.ram())?;
    let cpu_start = stats::thread_cpu_ns();
    let result = run(vm, &mut conn, accept, ram, cpu_start);
    if let Err(e) = &result
        && !matches!(e, MigrateError::Remote(_))
    {
        conn.send_error(&format!("destination: {e}"));
    }
    result
}

fn run(
    vm: &mut dyn DestinationVm,
    conn: &mut Conn,
    accept: &mut dyn FnMut(Instant) -> std::io::Result<TcpStream>,
    ram: Ram,
    cpu_start: u64,
) -> Result<ReceiveStats, MigrateError> {
    let hello = conn.read_hello()?;
    let mut reply = Hello {
        role: Role::Main,
        channel: 0,
        uuid: hello.uuid,
        memory_size: ram.size(),
        status: Refusal::Accepted as u32,
        channels: hello.channels,
    };
    if hello.role != Role::Main || hello.channel != 0 {
        reply.status = Refusal::Role as u32;
        conn.write_hello(&reply)?;
        return Err(MigrateError::Refused(
            "the first connection must be the main channel (role main, channel 0)".into(),
        ));
    }
    if hello.memory_size != ram.size() {
        reply.status = Refusal::MemorySize as u32;
        conn.write_hello(&reply)?;
        return Err(MigrateError::Refused(format!(
            "guest memory sizes differ (source {} bytes, destination {} bytes); start the destination with the same --memory",
            hello.memory_size,
            ram.size()
        )));
    }
    if hello.channels == 0 || hello.channels > wire::MAX_CHANNELS {
        reply.status = Refusal::ChannelId as u32;
        conn.write_hello(&reply)?;
        return Err(MigrateError::Refused(format!(
            "{} data channels announced; 1 to {} are allowed",
            hello.channels,
            wire::MAX_CHANNELS
        )));
    }
    conn.write_hello(&reply)?;

    let pages = ram.size() / PAGE_SIZE;
    let claimed = Arc::new(PageBits::new(pages));
    let shared = receiver::Shared {
        barrier: Arc::new(PassBarrier::new(
            usize::from(hello.channels) + 1,
            claimed.clone(),
        )),
        written: Arc::new(PageBits::new(pages)),
        claimed,
        ram,
    };
    let mut receivers = Vec::new();
    let result = accept_channels(&hello, accept, &shared, &mut receivers).and_then(|()| {
        main_loop(
            vm,
            conn,
            &shared,
            receivers.len() as u16,
            cpu_start,
            &mut receivers,
        )
    });
    if result.is_err() {
        shared.barrier.fail("the main channel failed");
        for r in receivers {
            let _ = r.1.stream_shutdown();
            let _ = r.0.join();
        }
    }
    result
}

/// A receiver thread and a handle to shut its socket down.
type Running = (
    std::thread::JoinHandle<Result<ReceiverStats, MigrateError>>,
    StreamHandle,
);

#[derive(Debug)]
struct StreamHandle(TcpStream);

impl StreamHandle {
    fn stream_shutdown(&self) -> std::io::Result<()> {
        self.0.shutdown(std::net::Shutdown::Both)
    }
}

fn accept_channels(
    main: &Hello,
    accept: &mut dyn FnMut(Instant) -> std::io::Result<TcpStream>,
    shared: &receiver::Shared,
    receivers: &mut Vec<Running>,
) -> Result<(), MigrateError> {
    let deadline = Instant::now() + CHANNEL_TIMEOUT;
    let mut seen = vec![false; usize::from(main.channels) + 1];
    while receivers.len() < usize::from(main.channels) {
        let stream = accept(deadline).map_err(|e| {
            let missing: Vec<String> = (1..=main.channels)
                .filter(|&c| !seen[usize::from(c)])
                .map(|c| c.to_string())
                .collect();
            MigrateError::Refused(format!(
                "data channel(s) {} never connected within {CHANNEL_TIMEOUT:?} ({e})",
                missing.join(", ")
            ))
        })?;
        let _ = stream.set_read_timeout(Some(CHANNEL_TIMEOUT));
        // Unbuffered: whatever follows the hello belongs to the receiver thread.
        let mut raw = [0u8; wire::HELLO_SIZE];
        std::io::Read::read_exact(&mut &stream, &mut raw)
            .map_err(|e| MigrateError::io("reading a data channel's hello", e))?;
        let hello = Hello::decode(&raw)?;
        let reply_to = |h: &Hello| {
            std::io::Write::write_all(&mut &stream, &h.encode())
                .map_err(|e| MigrateError::io("answering a data channel", e))
        };
        let mut reply = Hello {
            status: Refusal::Accepted as u32,
            memory_size: shared.ram.size(),
            ..hello
        };
        let refusal = if hello.role != Role::Data {
            Some((
                Refusal::Role,
                format!(
                    "a second connection with role {:?}; extra connections must be data channels",
                    hello.role
                ),
            ))
        } else if hello.uuid != main.uuid {
            Some((
                Refusal::UnknownMigration,
                format!(
                    "data channel {} names migration {:02x?}, not the one in progress",
                    hello.channel, hello.uuid
                ),
            ))
        } else if hello.channel == 0 || hello.channel > main.channels {
            Some((
                Refusal::ChannelId,
                format!(
                    "data channel id {} is out of range 1..={}",
                    hello.channel, main.channels
                ),
            ))
        } else if seen[usize::from(hello.channel)] {
            Some((
                Refusal::ChannelId,
                format!("data channel {} connected twice", hello.channel),
            ))
        } else {
            None
        };
        if let Some((status, why)) = refusal {
            reply.status = status as u32;
            let _ = reply_to(&reply);
            return Err(MigrateError::Refused(why));
        }
        reply_to(&reply)?;
        seen[usize::from(hello.channel)] = true;
        let _ = stream.set_read_timeout(Some(RECORD_TIMEOUT));
        let handle = StreamHandle(
            stream
                .try_clone()
                .map_err(|e| MigrateError::io("accepting a data channel", e))?,
        );
        receivers.push((
            receiver::start(hello.channel, stream, shared.clone()),
            handle,
        ));
    }
    Ok(())
}

fn main_loop(
    vm: &mut dyn DestinationVm,
    conn: &mut Conn,
    shared: &receiver::Shared,
    channels: u16,
    cpu_start: u64,
    receivers: &mut Vec<Running>,
) -> Result<ReceiveStats, MigrateError> {
    let mut stats = ReceiveStats {
        channels,
        ..ReceiveStats::default()
    };
    let mut sections: Vec<Section> = Vec::new();
    loop {
        let h = match conn.read_header("receiving the migration") {
            Ok(h) => h,
            Err(e) => {
                // A data channel's failure explains the main channel's end better; give the
                // receivers a moment to report one.
                let deadline = Instant::now() + Duration::from_secs(1);
                while shared.barrier.failure().is_none()
                    && receivers.iter().any(|r| !r.0.is_finished())
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return Err(shared
                    .barrier
                    .failure()
                    .map(MigrateError::Remote)
                    .unwrap_or(e));
            }
        };
        match h.kind {
            Kind::EndOfPass if !sections.is_empty() => {
                return Err(MigrateError::Order(
                    "EndOfPass record after device state".into(),
                ));
            }
            Kind::EndOfPass => {
                if h.count != stats.passes + 1 {
                    return Err(MigrateError::Order(format!(
                        "end of pass {} after pass {}",
                        h.count, stats.passes
                    )));
                }
                stats.passes = h.count;
                shared.barrier.wait(h.count)?;
            }
            Kind::DeviceState => {
                if stats.passes == 0 {
                    return Err(MigrateError::Order(
                        "device state before any memory pass".into(),
                    ));
                }
                let data = conn.read_payload(h.len, "receiving device state")?;
                sections.push(Section {
                    id: SectionId::from_u16(h.section),
                    version: h.count,
                    data,
                });
            }
            Kind::Complete => {
                if sections.is_empty() {
                    return Err(MigrateError::Order(
                        "Complete without any device state".into(),
                    ));
                }
                for (thread, _) in receivers.drain(..) {
                    let r = thread
                        .join()
                        .map_err(|_| MigrateError::Order("a receiver thread panicked".into()))??;
                    stats.pages += r.pages;
                    stats.zero_pages += r.zero_pages;
                    stats.receiver_cpu_ns += r.cpu_ns;
                }
                return finish(vm, conn, &sections, stats, cpu_start);
            }
            Kind::Error => {
                let p = conn.read_payload(h.len, "reading the source's error")?;
                return Err(MigrateError::Remote(
                    String::from_utf8_lossy(&p).into_owned(),
                ));
            }
            k => {
                return Err(MigrateError::Order(format!(
                    "{k:?} record on the main channel"
                )));
            }
        }
    }
}

fn finish(
    vm: &mut dyn DestinationVm,
    conn: &mut Conn,
    sections: &[Section],
    mut stats: ReceiveStats,
    cpu_start: u64,
) -> Result<ReceiveStats, MigrateError> {
    let t = Instant::now();
    vm.load_state(sections)?;
    stats.load = t.elapsed();
    stats.resume = vm.resume()?;
    let cpu = stats::thread_cpu_ns() - cpu_start + stats.receiver_cpu_ns;
    let mut payload = Vec::with_capacity(wire::RESUMED_SIZE as usize);
    for v in [
        stats.load.as_nanos() as u64,
        stats.resume.as_nanos() as u64,
        cpu,
    ] {
        payload.extend_from_slice(&v.to_le_bytes());
    }
    conn.write_record(&Header::new(Kind::Resumed, 0, wire::RESUMED_SIZE), &payload)?;
    conn.flush("acknowledging the resume")?;
    Ok(stats)
}
