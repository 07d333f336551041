//! The session in postcopy: the fault path started over guest RAM, the device state loaded and
//! the guest resumed while pages still arrive, the source's Complete awaited, and nothing
//! missing at the end.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{PostcopyReceived, ReceiveStats, Session};
use crate::destination::postcopy::Postcopy;
use crate::destination::postcopy::faults::FaultThread;
use crate::destination::progress::IncomingPhase;
use crate::destination::receiver;
use crate::error::{MigrateError, Rule};
use crate::stats;
use crate::vm::Section;
use crate::wire::{self, Capabilities, Header, Kind};

/// How long postcopy waits, after the source's Complete and the end of every data channel, for
/// the last pages to be installed (they are in the receivers' hands by then).
const ALL_IN_TIMEOUT: Duration = Duration::from_secs(30);

impl Session<'_> {
    /// The postcopy state, made at the first Discard (or at Postcopy, with nothing to
    /// discard): guest RAM is registered with userfaultfd from here on.
    pub(super) fn start_postcopy(&mut self) -> Result<Arc<Postcopy>, MigrateError> {
        if let Some(pc) = &self.postcopy {
            return Ok(pc.clone());
        }
        let out = self
            .conn
            .stream()
            .try_clone_stream()
            .map_err(|e| MigrateError::io("starting postcopy", e))?;
        let recoverable = self.granted.contains(Capabilities::RECOVER);
        // Over memory this side holds (minor faults) when precopy's pages landed through the
        // guest's mapping: the pages not needed are mapped there already, so only the needed
        // ones fault. Pages written through the file are not, and each would fault once.
        let over_held =
            self.vm.page_landing(self.stats.channels.max(1)) == crate::vm::PageLanding::Mapping;
        let pc = Arc::new(Postcopy::new(
            self.ram.clone(),
            out,
            recoverable,
            over_held,
        )?);
        self.postcopy = Some(pc.clone());
        Ok(pc)
    }

    /// Postcopy: load the state and resume the guest while the receivers install the pages
    /// that still come and the fault thread asks for those a vCPU waits for; then wait for
    /// the source's Complete and for every page, and say Done.
    ///
    /// Once the guest ran, a failure cannot be undone: the session hands the VM to
    /// [`DestinationVm::abandon`] and keeps the userfaultfd open for good (see `postcopy.rs`).
    pub(super) fn postcopy(&mut self, sections: &[Section]) -> Result<ReceiveStats, MigrateError> {
        let pc = self.postcopy.clone().expect("Postcopy started it");
        let faults = FaultThread::start(pc.clone())?;
        self.gate.open(pc.clone());
        let discarded = pc.remaining();
        self.control.update(|p| p.phase = IncomingPhase::Loading);
        let t = Instant::now();
        if let Err(e) = self.vm.load_state(sections) {
            faults.stop();
            return Err(e.into());
        }
        self.stats.load = t.elapsed();
        self.stats.resume = match self.vm.resume() {
            Ok(d) => d,
            Err(e) => {
                // The vCPUs may have started: the pages they wait for must never become zeros.
                std::mem::forget(pc.clone());
                faults.stop();
                let e = MigrateError::from(e);
                self.vm.abandon(&e.to_string());
                return Err(e);
            }
        };
        let resumed_at = Instant::now();
        self.control.update(|p| p.phase = IncomingPhase::Postcopy);
        let mut result = self.write_resumed(&pc);
        if let Err(e) = &result
            && self.recoverable(e)
        {
            result = self.recover(&pc, result.unwrap_err());
        }
        let result = result.and_then(|()| {
            loop {
                let r = self
                    .await_complete(&pc)
                    .and_then(|()| self.join_receivers())
                    .and_then(|()| self.nothing_lost(&pc))
                    .and_then(|()| pc.wait_all_in(ALL_IN_TIMEOUT))
                    .and_then(|()| pc.finish());
                match r {
                    Err(e) if self.recoverable(&e) => self.recover(&pc, e)?,
                    r => break r,
                }
            }
        });
        faults.stop();
        if let Err(e) = result {
            std::mem::forget(pc.clone());
            self.vm.abandon(&e.to_string());
            return Err(e);
        }
        let latencies = pc.latencies();
        let stages = pc.stages();
        self.stats.postcopy = Some(PostcopyReceived {
            ask: (&stages.ask).into(),
            install: (&stages.install).into(),
            wake: (&stages.wake).into(),
            pages: discarded,
            zero_fills: pc.zero_fills(),
            faults: pc.faults(),
            latencies,
            duration: resumed_at.elapsed(),
            recoveries: self.recoveries,
            paused: self.paused,
            over_held: pc.over_held(),
            intake: pc.intake.stages(),
        });
        // Every page is here; a lost Done leaves the source waiting, then failing, with the
        // guest safe here.
        if let Err(e) = pc.write(
            &Header::new(Kind::Done, 0, wire::DONE_SIZE),
            &latencies.encode(),
        ) {
            tracing::warn!("every page arrived, but the source did not get Done: {e}");
        }
        Ok(self.stats.clone())
    }

    /// Once every connection that carries pages ended, no page can still come: with recovery
    /// granted, pages still missing were lost with a connection that broke (a page written
    /// just before its end), and a recovery's Missing list brings them. Without it, the wait
    /// for them fails in its own time.
    pub(super) fn nothing_lost(&self, pc: &Postcopy) -> Result<(), MigrateError> {
        let left = pc.remaining();
        if left > 0 && self.granted.contains(Capabilities::RECOVER) {
            return Err(MigrateError::io(
                "postcopy: every connection ended",
                std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    format!("{left} pages never arrived; a connection broke"),
                ),
            ));
        }
        Ok(())
    }

    /// Tells the source the guest runs here (postcopy: through the shared writer).
    pub(super) fn write_resumed(&mut self, pc: &Postcopy) -> Result<(), MigrateError> {
        let cpu = stats::thread_cpu_ns() - self.cpu_start;
        let (header, payload) = self.resumed_record(cpu);
        pc.write(&header, &payload)
    }

    /// Postcopy: reads the main connection until the source's Complete (it sent every page),
    /// installing the requested pages it carries when [`Capabilities::MAIN_PAGES`] was granted.
    pub(super) fn await_complete(&mut self, pc: &Postcopy) -> Result<(), MigrateError> {
        let mut buffer = Vec::new();
        loop {
            let h = match self.conn.read_header("waiting for the source's last pages") {
                Ok(h) => h,
                Err(e) => return Err(self.explain_main_end(e)),
            };
            if h.kind == Kind::Pages && self.granted.contains(Capabilities::MAIN_PAGES) {
                let c = &self.control;
                c.add(&c.bytes, wire::HEADER_SIZE as u64 + h.len);
                let checking = self.granted.contains(Capabilities::CHECKSUM_PAGES);
                let pages = receiver::install_postcopy_record(
                    self.conn.reader(),
                    &h,
                    pc,
                    checking,
                    &mut buffer,
                )?;
                c.add(&c.pages, pages);
                continue;
            }
            return self.main_record_in_postcopy(&h);
        }
    }

    /// A record other than requested pages on the main connection in postcopy: Complete ends
    /// the wait, the source's Error fails it, anything else is out of order.
    pub(super) fn main_record_in_postcopy(&mut self, h: &Header) -> Result<(), MigrateError> {
        match h.kind {
            Kind::Complete => Ok(()),
            Kind::Error => {
                let p = self.conn.read_payload(h, "reading the source's error")?;
                Err(MigrateError::from_peer(crate::error::Side::Source, h, &p))
            }
            k => Err(MigrateError::misplaced(k, Rule::MainChannelInPostcopy)),
        }
    }
}
