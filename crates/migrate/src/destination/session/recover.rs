//! Postcopy recovery on the destination: when a connection breaks in postcopy, the session
//! neither fails nor abandons the guest. It shuts the remaining connections, stops their
//! receivers (a huge page half assembled is dropped: it was never placed), and enters
//! postcopy-paused: the guest runs, and a vCPU that touches a missing page waits (its request
//! is remembered). Once the VMM hands it a listener
//! ([`IncomingControl::recover_on`](crate::destination::IncomingControl::recover_on)), it
//! screens every connection there as the main listener does (`listen.rs`: garbage, silence,
//! trickles and strangers are dropped and counted, and the guest waits on), and to the source's
//! recovery hello (role Resume, this migration's uuid) it answers,
//! sends the runs of listed pages it still lacks (Missing) and Resume, asks again for every
//! page a vCPU waits for, and accepts the data channels (and the preempt connection) anew.
//! A failure during recovery returns to paused; a cancel gives the guest up as any postcopy
//! failure does.

#![forbid(unsafe_code)]

use std::net::Shutdown;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use super::Session;
use crate::conn::Conn;
use crate::destination::arrival::{Arrival, RECORD_TIMEOUT};
use crate::destination::listen::Screening;
use crate::destination::postcopy::Postcopy;
use crate::destination::progress::IncomingPhase;
use crate::error::MigrateError;
use crate::transport::Listener;
use crate::wire::{self, Capabilities, Header, Hello, Kind, Refusal};

/// How often a paused session looks for a listener, a cancel, or a connection.
const PAUSED_POLL: Duration = Duration::from_millis(100);

impl Session<'_> {
    /// Whether `e` is a broken connection that recovery can mend.
    pub(super) fn recoverable(&self, e: &MigrateError) -> bool {
        self.granted.contains(Capabilities::RECOVER)
            && !self.control.cancelled()
            && e.is_broken_connection()
    }

    /// Postcopy-paused until a recovery succeeds; `why` is what broke.
    pub(super) fn recover(
        &mut self,
        pc: &Arc<Postcopy>,
        why: MigrateError,
    ) -> Result<(), MigrateError> {
        let paused = Instant::now();
        let mut why = self.silenced(why);
        let mut listener: Option<Box<dyn Listener>> = None;
        loop {
            self.sever();
            tracing::warn!("postcopy paused: {why}; waiting for a recovery");
            let message = why.to_string();
            self.control.update(|p| {
                p.phase = IncomingPhase::PostcopyPaused;
                p.error = Some(message);
            });
            let attempt = loop {
                if self.control.cancelled() {
                    return Err(MigrateError::CancelledHere);
                }
                if let Some(l) = self.control.take_recovery() {
                    listener = Some(l);
                }
                let Some(l) = &listener else {
                    std::thread::sleep(PAUSED_POLL);
                    continue;
                };
                match self.screen_recovery(l.as_ref(), pc)? {
                    Attempt::Ended(result) => break result,
                    Attempt::NewListener(l) => listener = Some(l),
                }
            };
            match attempt {
                Ok(()) => break,
                Err(e) if self.recoverable(&e) || matches!(e, MigrateError::Refused(_)) => {
                    why = e;
                }
                Err(e) => return Err(e),
            }
        }
        self.recoveries += 1;
        self.paused += paused.elapsed();
        self.control.update(|p| {
            p.phase = IncomingPhase::Postcopy;
            p.error = None;
        });
        Ok(())
    }

    /// Screens `listener` (on a thread of its own, as the main listener is screened) until
    /// this migration's Resume comes and its recovery ends, a new listener is given, or a
    /// cancel: garbage, silence, trickles and strangers are dropped and counted, and never end
    /// the wait.
    fn screen_recovery(
        &mut self,
        listener: &dyn Listener,
        pc: &Arc<Postcopy>,
    ) -> Result<Attempt, MigrateError> {
        let uuid = self.hello.uuid;
        let control = self.control.clone();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let screening = Screening::recovery(scope, listener, control, uuid, &stop)?;
            loop {
                if self.control.cancelled() {
                    return Err(MigrateError::CancelledHere);
                }
                if let Some(l) = self.control.take_recovery() {
                    return Ok(Attempt::NewListener(l));
                }
                let Some(arrival) = screening.next_resume(PAUSED_POLL) else {
                    continue;
                };
                let result = self.resume_on(arrival, pc, &screening);
                if result.is_err() {
                    screening.reopen(uuid);
                }
                return Ok(Attempt::Ended(result));
            }
        })
    }
    /// Shuts the main connection and every receiver's, and waits for the receivers.
    fn sever(&mut self) {
        let _ = self.conn.stream().shutdown(Shutdown::Both);
        for r in self.receivers.drain(..) {
            let _ = r.stream.shutdown(Shutdown::Both);
            if let Ok(Ok(s)) = r.thread.join() {
                self.stats.pages += s.pages;
                self.stats.zero_pages += s.zero_pages;
                self.stats.receiver_cpu_ns += s.cpu_ns;
                self.stats.decompress_cpu_ns += s.decompress_cpu_ns;
                self.stats.compressed_records += s.compressed_records;
            }
        }
    }

    /// One recovery on a new connection, whose hello the screen found to be this migration's
    /// Resume: the Missing list, the pending requests, and the channels.
    fn resume_on(
        &mut self,
        arrival: Arrival,
        pc: &Arc<Postcopy>,
        screening: &Screening<'_>,
    ) -> Result<(), MigrateError> {
        let Arrival { mut stream, hello } = arrival;
        let reply = Hello {
            status: Refusal::Accepted as u32,
            memory_size: self.ram.size(),
            capabilities: self.granted,
            ..hello
        };
        std::io::Write::write_all(&mut stream, &reply.encode())
            .map_err(|e| MigrateError::io("answering a recovery", e))?;
        self.control.register(stream.as_ref());
        let _ = stream.set_read_timeout(Some(RECORD_TIMEOUT));
        let out = stream
            .try_clone_stream()
            .map_err(|e| MigrateError::io("accepting a recovery", e))?;
        self.conn = Conn::new(stream).map_err(|e| MigrateError::io("accepting a recovery", e))?;
        let missing = pc.missing_runs();
        let mut first: Vec<(Header, Vec<u8>)> = missing
            .chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize)
            .map(|chunk| {
                (
                    Header::runs(Kind::Missing, chunk.len() as u32),
                    wire::encode_runs(chunk),
                )
            })
            .collect();
        first.push((Header::new(Kind::Resume, 0, 0), Vec::new()));
        // Missing and Resume go first on the new connection, and only then may the fault
        // thread write to it: a page request ahead of Resume would be a protocol error there.
        pc.replace_out_after(out, &first)?;
        let pending = pc.pending_requests();
        for chunk in pending.chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize) {
            pc.write(
                &Header::runs(Kind::PageRequest, chunk.len() as u32),
                &wire::encode_runs(chunk),
            )?;
        }
        let main = self
            .conn
            .stream()
            .try_clone_stream()
            .map_err(|e| MigrateError::io("accepting a recovery", e))?;
        self.connect_channels(&mut screening.channels(hello.uuid, main))?;
        self.control.update(|p| p.phase = IncomingPhase::Postcopy);
        Ok(())
    }
}

/// How one screened wait for a recovery ended.
enum Attempt {
    /// A Resume came, and its recovery succeeded or failed.
    Ended(Result<(), MigrateError>),
    /// The VMM gave a new listener: screen that one instead.
    NewListener(Box<dyn Listener>),
}
