//! Postcopy recovery on the destination: when a connection breaks in postcopy, the session
//! neither fails nor abandons the guest. It shuts the remaining connections, stops their
//! receivers (a huge page half assembled is dropped: it was never placed), and enters
//! postcopy-paused: the guest runs, and a vCPU that touches a missing page waits (its request
//! is remembered). Once the VMM hands it a listener
//! ([`IncomingControl::recover_on`](crate::destination::IncomingControl::recover_on)), it waits
//! there for the source's recovery hello (role Resume, this migration's uuid), answers it,
//! sends the runs of listed pages it still lacks (Missing) and Resume, asks again for every
//! page a vCPU waits for, and accepts the data channels (and the preempt connection) anew.
//! A failure during recovery returns to paused; a cancel gives the guest up as any postcopy
//! failure does.

#![forbid(unsafe_code)]

use std::net::Shutdown;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Session;
use crate::conn::Conn;
use crate::destination::postcopy::Postcopy;
use crate::destination::{Arrival, Arrivals, CHANNEL_TIMEOUT, HELLO_TIMEOUT, IncomingPhase};
use crate::error::MigrateError;
use crate::transport::Listener;
use crate::wire::{self, Capabilities, Header, Hello, Kind, Refusal, Role};

/// How often a paused session looks for a listener, a cancel, or a connection.
const PAUSED_POLL: Duration = Duration::from_millis(100);

impl Session<'_> {
    /// Whether `e` is a broken connection that recovery can mend.
    pub(super) fn recoverable(&self, e: &MigrateError) -> bool {
        self.granted.contains(Capabilities::RECOVER)
            && !self.control.cancelled()
            && matches!(
                e,
                MigrateError::Io { .. }
                    | MigrateError::Truncated { .. }
                    | MigrateError::Stalled { .. }
                    | MigrateError::Channel(_)
                    | MigrateError::ChannelEnded { .. }
            )
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
                match l.accept_within(PAUSED_POLL) {
                    Ok(Some(stream)) => break self.resume_on(stream, pc, l.as_ref()),
                    Ok(None) => {}
                    Err(e) => {
                        break Err(MigrateError::io("waiting for the source to reconnect", e));
                    }
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

    /// Shuts the main connection and every receiver's, and waits for the receivers.
    fn sever(&mut self) {
        let _ = self.conn.stream().shutdown(Shutdown::Both);
        for r in self.receivers.drain(..) {
            let _ = r.stream.shutdown(Shutdown::Both);
            if let Ok(Ok(s)) = r.thread.join() {
                self.stats.pages += s.pages;
                self.stats.zero_pages += s.zero_pages;
                self.stats.receiver_cpu_ns += s.cpu_ns;
            }
        }
    }

    /// One recovery on a new connection: its hello must be the source's Resume for this
    /// migration; then the Missing list, the pending requests, and the channels.
    fn resume_on(
        &mut self,
        mut stream: Box<dyn crate::transport::Stream>,
        pc: &Arc<Postcopy>,
        listener: &dyn Listener,
    ) -> Result<(), MigrateError> {
        let hello = super::super::read_hello(stream.as_mut(), HELLO_TIMEOUT)?;
        let refusal = if hello.role != Role::Resume {
            Some((
                Refusal::Role,
                format!("a {:?} connection while waiting for a recovery", hello.role),
            ))
        } else if hello.uuid != self.hello.uuid {
            Some((
                Refusal::UnknownMigration,
                "a recovery for another migration".to_string(),
            ))
        } else {
            None
        };
        let reply = Hello {
            status: refusal.as_ref().map_or(Refusal::Accepted, |r| r.0) as u32,
            memory_size: self.ram.size(),
            capabilities: self.granted,
            ..hello
        };
        let _ = std::io::Write::write_all(&mut stream, &reply.encode());
        if let Some((_, why)) = refusal {
            self.control.reject(why.clone());
            return Err(MigrateError::Refused(why));
        }
        self.control.register(stream.as_ref());
        let _ = stream.set_read_timeout(Some(super::super::RECORD_TIMEOUT));
        pc.replace_out(
            stream
                .try_clone_stream()
                .map_err(|e| MigrateError::io("accepting a recovery", e))?,
        );
        self.conn = Conn::new(stream).map_err(|e| MigrateError::io("accepting a recovery", e))?;
        let missing = pc.missing_runs();
        for chunk in missing.chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize) {
            self.conn.write_record(
                &Header::runs(Kind::Missing, chunk.len() as u32),
                &wire::encode_runs(chunk),
            )?;
        }
        self.conn.write_header(&Header::new(Kind::Resume, 0, 0))?;
        self.conn.flush("sending what this side lacks")?;
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
        self.connect_channels(&mut Reconnecting { listener, main })?;
        self.control.update(|p| p.phase = IncomingPhase::Postcopy);
        Ok(())
    }
}

/// The data connections of a recovery, from its listener. A source whose recovery failed
/// after the Resume closes the recovery's main connection: that ends the wait at once, and the
/// destination is paused again, ready for the next recovery, instead of waiting out the
/// channels' deadline.
struct Reconnecting<'a> {
    listener: &'a dyn Listener,
    main: Box<dyn crate::transport::Stream>,
}

impl Arrivals for Reconnecting<'_> {
    fn next(&mut self, deadline: Instant) -> Result<Option<Arrival>, MigrateError> {
        let mut stream = loop {
            if self.main.hung_up() {
                return Err(MigrateError::io(
                    "waiting for the recovery's channels",
                    std::io::Error::from(std::io::ErrorKind::ConnectionAborted),
                ));
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(PAUSED_POLL);
            match self
                .listener
                .accept_within(wait)
                .map_err(|e| MigrateError::io("accepting a data channel", e))?
            {
                Some(stream) => break stream,
                None if Instant::now() >= deadline => return Ok(None),
                None => {}
            }
        };
        let hello = super::super::read_hello(stream.as_mut(), CHANNEL_TIMEOUT)?;
        Ok(Some(Arrival { stream, hello }))
    }

    fn close(&mut self) {}
}
