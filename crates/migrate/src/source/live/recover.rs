//! Postcopy recovery on the source: when a connection breaks in postcopy (or
//! [`Control::pause_postcopy`](crate::Control::pause_postcopy) breaks them), the session does
//! not fail. The guest runs on the destination and the pages it still lacks exist only here, so
//! the session severs what is left of its connections, enters postcopy-paused, and waits for
//! [`Control::resume_postcopy`](crate::Control::resume_postcopy) to name where to reconnect.
//! There it greets the destination as a recovery (role Resume, the migration's uuid), reads the
//! list of pages the destination still lacks, opens the data channels (and the preempt
//! connection) anew, and goes on sending from that list. A failure during recovery goes back
//! to paused; a later recovery starts over.
//!
//! Invariant: every listed page the destination lacks is in the bitmap after a recovery,
//! because the destination's list is the truth (a page queued or sent before the break may
//! never have arrived); a page it holds is never sent again, and a page not on the discard
//! list is refused in its list.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::bitmap::DirtyBitmap;
use crate::conn::Conn;
use crate::control::Phase;
use crate::error::{MigrateError, ProtocolError, Rule};
use crate::source::reader::{InboundReader, Opening};
use crate::source::{Session, ms};
use crate::stats::PostcopyStats;
use crate::transport::{Dialer, Stream};
use crate::wire::{self, Kind, PAGE_SIZE, Role};

/// How long one connection attempt of a recovery may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for the destination's Missing list when no peer timeout was set.
const MISSING_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a paused session looks for a resume request.
const PAUSED_POLL: Duration = Duration::from_millis(100);

impl Session<'_> {
    /// Whether `e` is a broken connection that recovery can mend (not a refusal or a protocol
    /// violation, which a reconnect would only repeat).
    pub(super) fn recoverable(&self, e: &MigrateError) -> bool {
        self.peer.agreed.recover && e.is_broken_connection()
    }

    /// Fails with a broken connection when a pause was asked for (after severing them all):
    /// the same path a real failure takes. So does a data or preempt connection the other end
    /// closed: a page written into it just before may be lost without any write failing, and
    /// the recovery's Missing list is what brings it back.
    pub(super) fn check_pause(&mut self) -> Result<(), MigrateError> {
        if !self.peer.agreed.recover {
            return Ok(());
        }
        let during = if self.control.take_pause() {
            "postcopy, paused on request"
        } else if self.peer.pool.hung_up() {
            "postcopy: the destination's end of a data or preempt connection closed"
        } else {
            return Ok(());
        };
        self.sever();
        Err(MigrateError::io(
            during,
            std::io::Error::from(std::io::ErrorKind::ConnectionAborted),
        ))
    }

    /// Shuts every connection down and stops the threads that use them.
    fn sever(&mut self) {
        self.peer.pool.sever();
        let _ = self.peer.conn.stream().shutdown(std::net::Shutdown::Both);
        self.peer.acks.reader = None;
    }

    /// Postcopy-paused until a recovery succeeds: waits for a resume request, reconnects,
    /// and loads the destination's list of what it lacks into the bitmap. `why` is what broke.
    pub(super) fn recover(
        &mut self,
        pc: &mut PostcopyStats,
        listed: &DirtyBitmap,
        why: MigrateError,
    ) -> Result<(), MigrateError> {
        let paused = Instant::now();
        let mut why = why;
        loop {
            self.sever();
            tracing::warn!("postcopy paused: {why}; waiting for a resume to reconnect");
            let message = why.to_string();
            self.control.update(|p| p.error = Some(message));
            self.set_phase(Phase::PostcopyPaused);
            let to = loop {
                if self.control.given_up() {
                    return Err(MigrateError::GivenUp);
                }
                if let Some(to) = self.control.wait_resume(PAUSED_POLL) {
                    break to;
                }
            };
            match self.reconnect(&to, listed) {
                Ok(()) => break,
                Err(e) if self.recoverable(&e) || matches!(e, MigrateError::Refused(_)) => {
                    self.control.update(|p| p.recovery_failures += 1);
                    why = e;
                }
                Err(e) => return Err(e),
            }
        }
        pc.recoveries += 1;
        pc.paused_ms += ms(paused.elapsed());
        let recoveries = pc.recoveries;
        self.control.update(|p| {
            p.error = None;
            p.recoveries = recoveries;
        });
        self.set_phase(Phase::Postcopy);
        Ok(())
    }

    /// One recovery attempt at `to`: the hello, the Missing list, the reader, the channels.
    fn reconnect(&mut self, to: &Dialer, listed: &DirtyBitmap) -> Result<(), MigrateError> {
        let peer_timeout = self.params.peer_timeout;
        let connect = move || -> std::io::Result<Box<dyn Stream>> {
            let s = to.connect(CONNECT_TIMEOUT).map_err(std::io::Error::other)?;
            s.set_write_timeout(peer_timeout)?;
            s.set_keepalive(peer_timeout)?;
            Ok(s)
        };
        let stream =
            connect().map_err(|e| MigrateError::io("reconnecting to the destination", e))?;
        let conn = Conn::new(stream).map_err(|e| MigrateError::io("reconnecting", e))?;
        self.peer.earlier_bytes += std::mem::replace(&mut self.peer.conn, conn).bytes_written;
        self.peer.conn.write_hello(&self.main_hello(Role::Resume))?;
        let reply = self.peer.conn.read_hello(self.params.peer_timeout)?;
        if reply.status != wire::Refusal::Accepted as u32 {
            return Err(MigrateError::Refused(match wire::Refusal::try_from(reply.status) {
                Ok(wire::Refusal::UnknownMigration | wire::Refusal::NotPaused) => "the destination has no paused postcopy migration of this uuid (was it given `ferry migrate-recover`?)".into(),
                _ => format!("the destination refused the recovery with status {}", reply.status),
            }));
        }
        // The Missing list comes within the peer timeout: a peer that answered the hello and
        // then says nothing must not hold the recovery (and later resume requests) for ever.
        self.peer
            .conn
            .stream()
            .set_read_timeout(Some(self.params.peer_timeout.unwrap_or(MISSING_TIMEOUT)))
            .map_err(|e| MigrateError::io("reconnecting", e))?;
        self.read_missing(listed)?;
        self.peer
            .conn
            .stream()
            .set_read_timeout(None)
            .map_err(|e| MigrateError::io("reconnecting", e))?;
        // A resumed connection's reader takes page requests from its first byte.
        self.peer.acks.reader = Some(InboundReader::start(
            &mut self.peer.conn,
            self.peer.agreed,
            Opening::Recovery,
        )?);
        let preempt = self.preempt();
        self.peer
            .pool
            .open(&connect, &self.params, &self.ram, self.hooks, preempt)?;
        self.peer.pool.postcopy()?;
        self.lend_lane();
        Ok(())
    }

    /// Reads the destination's Missing runs up to Resume into the bitmap (which it replaces):
    /// each run must be RAM, whole units, and listed.
    fn read_missing(&mut self, listed: &DirtyBitmap) -> Result<(), MigrateError> {
        let mut missing = DirtyBitmap::new(self.ram.regions());
        loop {
            let h = self
                .peer
                .conn
                .read_header("reading what the destination lacks")?;
            let payload = self
                .peer
                .conn
                .read_payload(&h, "reading the Missing list")?;
            match h.kind {
                Kind::Missing => {
                    let words: Vec<u64> = wire::decode_addresses(&payload).collect();
                    for run in words.chunks_exact(2) {
                        let (gpa, pages) = (run[0], run[1]);
                        self.ram.check_run(gpa, pages)?;
                        for k in 0..pages {
                            let page = gpa + k * PAGE_SIZE;
                            if !listed.contains(page) {
                                return Err(ProtocolError::LacksUndropped { gpa: page }.into());
                            }
                            missing.set(page);
                        }
                    }
                }
                Kind::Resume => break,
                Kind::Error => {
                    return Err(MigrateError::Remote(
                        crate::error::Side::Destination,
                        String::from_utf8_lossy(&payload).into_owned(),
                    ));
                }
                k => {
                    return Err(MigrateError::misplaced(k, Rule::InRecovery));
                }
            }
        }
        missing.round_out(self.peer.agreed.postcopy_unit);
        self.bitmap = missing;
        Ok(())
    }
}
