//! The session's data channels: connecting the ones the main hello announced (each hello
//! screened against it: the migration's uuid, a channel not seen before, a preempt connection
//! only when granted), and joining their receivers when precopy ends.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Running, Session};
use crate::destination::arrival::{Arrival, Arrivals, CHANNEL_TIMEOUT, RECORD_TIMEOUT};
use crate::destination::progress::IncomingPhase;
use crate::destination::receiver::{self, PageBits, PassBarrier};
use crate::destination::sink;
use crate::error::{Connection, Internal, MigrateError};
use crate::transport::Stream;
use crate::wire::{self, Capabilities, Hello, PAGE_SIZE, Refusal, Role};

impl Session<'_> {
    /// Phase 2: every announced data channel connects within [`CHANNEL_TIMEOUT`], naming this
    /// migration and a fresh channel id; each gets a receiver thread.
    pub(super) fn connect_channels(
        &mut self,
        arrivals: &mut dyn Arrivals,
    ) -> Result<(), MigrateError> {
        let main = self.hello;
        let shared = match &self.shared {
            // A postcopy recovery: the new channels carry on where the broken ones stopped.
            Some(shared) => shared.clone(),
            None => {
                let pages = self.ram.size() / PAGE_SIZE;
                let claimed = Arc::new(PageBits::new(pages));
                let shared = receiver::Shared {
                    barrier: Arc::new(PassBarrier::new(
                        usize::from(main.channels) + 1,
                        claimed.clone(),
                        RECORD_TIMEOUT,
                    )),
                    written: Arc::new(PageBits::new(pages)),
                    claimed,
                    ram: self.ram.clone(),
                    sink: sink::for_landing(self.vm.page_landing(main.channels), &self.ram),
                    control: self.control.clone(),
                    postcopy: self.gate.clone(),
                    checksum_pages: self.granted.contains(Capabilities::CHECKSUM_PAGES),
                    compress: self.granted.contains(Capabilities::COMPRESS),
                };
                self.shared = Some(shared.clone());
                shared
            }
        };
        // Each channel has CHANNEL_TIMEOUT after the one before: a source opens them one at a
        // time, so one total for all would refuse many channels over a long round trip.
        let mut deadline = Instant::now() + CHANNEL_TIMEOUT;
        // Slot PREEMPT_CHANNEL (0) is the preempt connection, when granted; slots 1.. the data
        // channels.
        let mut seen = vec![false; usize::from(main.channels) + 1];
        let preempt = self.granted.contains(Capabilities::PREEMPT);
        let expected = usize::from(main.channels) + usize::from(preempt);
        while self.receivers.len() < expected {
            if self.control.cancelled() {
                return Err(MigrateError::CancelledHere);
            }
            if self.control.silent() {
                // The watchdog gave up on the source while its channels were awaited.
                return Err(MigrateError::Stalled {
                    during: "waiting for the data channels",
                });
            }
            // In short waits, so that a cancel or the watchdog is seen at once.
            let Some(arrival) = arrivals.next(deadline.min(Instant::now() + CHANNEL_POLL))? else {
                if Instant::now() < deadline {
                    continue;
                }
                let mut missing: Vec<String> = (1..=main.channels)
                    .filter(|&c| !seen[usize::from(c)])
                    .map(|c| format!("data channel {c}"))
                    .collect();
                if preempt && !seen[usize::from(wire::PREEMPT_CHANNEL)] {
                    missing.push("the preempt connection".into());
                }
                return Err(MigrateError::Refused(format!(
                    "{} never connected within {CHANNEL_TIMEOUT:?} of the connection before",
                    missing.join(", ")
                )));
            };
            let Arrival { mut stream, hello } = arrival;
            let refusal = channel_refusal(&main, &hello, &seen, self.granted);
            let mut reply = Hello {
                status: Refusal::Accepted as u32,
                memory_size: self.ram.size(),
                ..hello
            };
            if let Some((status, _)) = &refusal {
                reply.status = *status as u32;
            }
            let answered = std::io::Write::write_all(&mut stream, &reply.encode())
                .map_err(|e| MigrateError::io("answering a data channel", e));
            if let Some((_, why)) = refusal {
                return Err(MigrateError::Refused(why));
            }
            answered?;
            seen[usize::from(hello.channel)] = true;
            deadline = Instant::now() + CHANNEL_TIMEOUT;
            let _ = stream.set_read_timeout(Some(RECORD_TIMEOUT));
            self.control.register(stream.as_ref());
            let handle = stream
                .try_clone_stream()
                .map_err(|e| MigrateError::io("accepting a data channel", e))?;
            self.receivers.push(Running {
                channel: hello.channel,
                thread: receiver::start(hello.channel, stream, shared.clone()),
                stream: handle,
            });
            let connected = self
                .receivers
                .iter()
                .filter(|r| r.channel != wire::PREEMPT_CHANNEL)
                .count() as u16;
            self.control.update(|p| p.channels_connected = connected);
        }
        arrivals.close();
        self.stats.channels = main.channels;
        self.control.update(|p| p.phase = IncomingPhase::Precopy);
        Ok(())
    }

    /// After Complete: every data channel must have ended after the last pass.
    pub(super) fn join_receivers(&mut self) -> Result<(), MigrateError> {
        for r in self.receivers.drain(..) {
            let s = r.thread.join().map_err(|_| Internal::ReceiverPanicked {
                connection: Connection(r.channel),
            })??;
            // The preempt connection carries no passes, nor do the channels a postcopy
            // recovery opened.
            if r.channel != wire::PREEMPT_CHANNEL
                && s.passes != self.stats.passes
                && self.recoveries == 0
            {
                return Err(MigrateError::ChannelEnded {
                    channel: r.channel,
                    after_pass: s.passes,
                    pass: self.stats.passes,
                });
            }
            self.stats.pages += s.pages;
            self.stats.zero_pages += s.zero_pages;
            self.stats.receiver_cpu_ns += s.cpu_ns;
            self.stats.decompress_cpu_ns += s.decompress_cpu_ns;
            self.stats.compressed_records += s.compressed_records;
        }
        Ok(())
    }
}

/// The longest single wait for a data channel, between looks for a cancel or a silent source.
const CHANNEL_POLL: Duration = Duration::from_millis(100);

/// Why a data or preempt connection's hello does not belong to the migration `main`
/// announced, if it does not: `granted` says whether a preempt connection may come, and
/// `seen[PREEMPT_CHANNEL]` whether it connected.
fn channel_refusal(
    main: &Hello,
    hello: &Hello,
    seen: &[bool],
    granted: Capabilities,
) -> Option<(Refusal, String)> {
    if hello.role == Role::Preempt {
        return if !granted.contains(Capabilities::PREEMPT) {
            Some((
                Refusal::Role,
                "a preempt connection, but the preempt capability was not granted".into(),
            ))
        } else if hello.uuid != main.uuid {
            Some((
                Refusal::UnknownMigration,
                format!(
                    "a preempt connection names migration {:02x?}, not the one in progress",
                    hello.uuid
                ),
            ))
        } else if hello.channel != wire::PREEMPT_CHANNEL {
            Some((
                Refusal::ChannelId,
                format!(
                    "a preempt connection with channel id {} (must be {})",
                    hello.channel,
                    wire::PREEMPT_CHANNEL
                ),
            ))
        } else if seen[usize::from(wire::PREEMPT_CHANNEL)] {
            Some((Refusal::ChannelId, "a second preempt connection".into()))
        } else {
            None
        };
    }
    if hello.role != Role::Data {
        Some((
            Refusal::Role,
            format!(
                "a second connection with role {:?}; extra connections must be data channels (or the preempt connection)",
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
    } else if hello.channel == wire::PREEMPT_CHANNEL || hello.channel > main.channels {
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
    }
}
