//! The handover to a live destination: after the final pass (`switchover.rs`), send the
//! device state and Complete (or Postcopy) and wait for the destination to say it resumed the
//! guest.
//!
//! Invariant: the guest is [`GuestState::HandedOver`] right after Complete is flushed. Before
//! that, a failure resumes the guest here; after it, the guest may run on the destination, so
//! a failure (including no answer within the peer timeout) leaves it paused. One answer undoes
//! the handover: the destination's Error before its Resumed, in precopy. A precopy
//! destination sends Error only before it resumes (a failed load or resume leaves nothing
//! running there, and after the resume nothing fails its session), so the guest runs nowhere
//! and resumes here.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::error::{MigrateError, Rule};
use crate::source::reader::{Awaiting, Inbound};
use crate::source::{GuestState, Session, ms};
use crate::vm::{Section, SourceVm};
use crate::wire::ResumedRecord;
use crate::wire::{Header, Kind};

/// How long the source waits for the destination to load the state and resume the guest
/// when it has no peer timeout: a load is milliseconds (a few KiB of state per vCPU), so this
/// only bounds a hung destination. With a peer timeout, the wait is that long.
const RESUME_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the source looks for page requests while a postcopy destination loads the state:
/// a Resumed ends the wait at once, and a load that faults waits at most this long extra.
const LOAD_TICK: Duration = Duration::from_micros(200);

/// The wait for the destination's answer to Complete.
const AWAITING_RESUMED: Awaiting = Awaiting {
    during: "waiting for the destination to resume the guest",
    expected: "Resumed",
};

/// What the source does between looks for Resumed while a postcopy destination loads.
pub(super) type ServeWhileLoading<'f, 'a> =
    &'f mut dyn FnMut(&mut Session<'a>) -> Result<(), MigrateError>;

impl<'a> Session<'a> {
    /// Stops the guest here and hands it over; `pass` is the final pass's number.
    pub(super) fn switchover(
        &mut self,
        vm: &mut dyn SourceVm,
        pass: u32,
    ) -> Result<(), MigrateError> {
        let (sections, steps) = self.final_pass(vm, pass)?;
        self.hand_over(&sections, Kind::Complete, steps, None)
    }

    /// Sends the saved state and `last` (Complete, or Postcopy), hands the guest over, waits
    /// for the destination's Resumed and records where the downtime went; `steps` are when
    /// the pause was asked for, the guest paused, the final sync, the final pages and the
    /// state save ended. `serve`, in postcopy, answers the page requests of a destination
    /// whose state load touches a page it does not have yet, every [`LOAD_TICK`] while it
    /// waits.
    pub(super) fn hand_over(
        &mut self,
        sections: &[Section],
        last: Kind,
        steps: [Instant; 5],
        serve: Option<ServeWhileLoading<'_, 'a>>,
    ) -> Result<(), MigrateError> {
        let [t0, t1, t2, t3, t4] = steps;
        self.send_device_state(sections)?;
        self.peer.conn.write_header(&Header::new(last, 0, 0))?;
        self.peer.conn.flush("handing the guest over")?;
        self.guest = GuestState::HandedOver;
        self.control.update(|p| p.handed_over = true);
        let resumed = match self.await_resumed(serve) {
            Ok(r) => r,
            Err(e @ MigrateError::Remote(..)) if last == Kind::Complete => {
                // The destination refused the state and runs nothing: the guest is still ours.
                self.guest = GuestState::Paused;
                self.control.update(|p| p.handed_over = false);
                return Err(e);
            }
            // In postcopy with recovery a break here pauses both sides like any later one
            // (the destination may run the guest, and it has the state); the caller recovers.
            Err(e) if last == Kind::Postcopy && self.recoverable(&e) => return Err(e),
            Err(e) => return Err(MigrateError::Unacknowledged(Box::new(e))),
        };
        self.note_resumed([t0, t1, t2, t3, t4], resumed);
        Ok(())
    }

    /// Records where the downtime went, on both sides, once the destination's Resumed came
    /// (now): `steps` as [`Session::final_pass`] returns them.
    pub(super) fn note_resumed(&mut self, steps: [Instant; 5], resumed: ResumedRecord) {
        let t6 = Instant::now();
        self.note_downtime(steps, t6);
        let d = &mut self.report.stats.downtime;
        d.load_ms = resumed.load_ns as f64 / 1e6;
        d.resume_ms = resumed.resume_ns as f64 / 1e6;
        d.transfer_ms = (ms(t6 - steps[4]) - d.load_ms - d.resume_ms).max(0.0);
        d.load_parts = resumed.parts;
        self.report.stats.cpu_seconds_destination = resumed.cpu_ns as f64 / 1e9;
    }

    /// Writes the device-state sections on the main connection, one record each; the flush
    /// after Complete sends them.
    pub(super) fn send_device_state(&mut self, sections: &[Section]) -> Result<(), MigrateError> {
        for s in sections {
            self.peer
                .conn
                .write_section(s.header(), &s.data, "sending device state")?;
        }
        Ok(())
    }

    /// Waits for the destination's Resumed, on the reader thread, calling `serve` every
    /// [`LOAD_TICK`] meanwhile if given; its Error, or the reader's failure, fails
    /// (acknowledgements that still arrive are folded in by the reader).
    pub(super) fn await_resumed(
        &mut self,
        mut serve: Option<ServeWhileLoading<'_, 'a>>,
    ) -> Result<ResumedRecord, MigrateError> {
        let timeout = self.params.peer_timeout.unwrap_or(RESUME_TIMEOUT);
        let deadline = Instant::now() + timeout;
        let tick = if serve.is_some() { LOAD_TICK } else { timeout };
        let ending = loop {
            let reader = self
                .peer
                .acks
                .reader
                .as_ref()
                .expect("the reader runs from the handshake on");
            if let Some(e) = reader.wait(tick) {
                break e;
            }
            if Instant::now() >= deadline {
                break Err(MigrateError::io(
                    AWAITING_RESUMED.during,
                    std::io::Error::from(std::io::ErrorKind::TimedOut),
                ));
            }
            if let Some(serve) = serve.as_mut() {
                serve(self)?;
            }
        };
        self.note_acks();
        match ending? {
            Inbound::Resumed(r) => Ok(r),
            Inbound::Error(message) => Err(MigrateError::Remote(
                crate::error::Side::Destination,
                message,
            )),
            Inbound::Received(_) | Inbound::PageRequest(_) | Inbound::StateReady => {
                unreachable!("the reader folds acknowledgements and queues requests")
            }
            Inbound::Done(_) => Err(MigrateError::misplaced(Kind::Done, Rule::DoneAfterResumed)),
        }
    }
}
