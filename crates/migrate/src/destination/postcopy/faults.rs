//! Postcopy's fault thread on the destination: it reads userfaultfd's fault messages and acts
//! on each by the state of its host page (the parent module's doc): a hole not needed is
//! filled with zeros, a page held here or already written is mapped, an installed one only
//! woken, and a needed one asked for once on the main connection.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Instant;

use super::{FAULT_POLL, Postcopy, placed};
use crate::error::{Internal, MigrateError};
use crate::uffd::{Fault, Wake};
use crate::wire::{self, Header, Kind};

impl Postcopy {
    /// Handles one fault by the state of its host page (see the module doc); returns the
    /// start of a unit to ask for.
    fn on_fault(&self, f: &Fault) -> Result<Option<(u64, Instant)>, MigrateError> {
        // Units are aligned in guest and host address alike (regions start on one).
        let host = f.addr & !(self.unit as usize - 1);
        let Some(gpa) = self.ram.gpa_of_host(host) else {
            return Err(Internal::FaultOutsideRam { addr: f.addr }.into());
        };
        let i = self.ram.page_index(gpa)?;
        if !self.needed.get(i) {
            if f.minor {
                // Held here and final, only not mapped (written through the file).
                placed(
                    self.uffd
                        .continue_range(host, self.unit as usize, Wake::Now),
                )?;
                return Ok(None);
            }
            self.zero_fills.fetch_add(1, Ordering::Relaxed);
            self.zero_fill(host)?;
            return Ok(None);
        }
        if self.installed.get(i) {
            self.wake_bytes(host, self.unit as usize)?;
            return Ok(None);
        }
        if self.written.get(i) {
            // In the file, its copy not mapped yet (its receiver busy or descheduled): mapped
            // here, the vCPU waits for nobody.
            placed(
                self.uffd
                    .continue_range(host, self.unit as usize, Wake::Now),
            )?;
            return Ok(None);
        }
        if self.requested.set(i) {
            return Ok(None);
        }
        let now = Instant::now();
        self.first_fault.lock().unwrap().insert(i, now);
        // Installed between the two looks: the copy woke the waiter already, and the source
        // ignores a request for a page it sent.
        Ok(Some((gpa, now)))
    }

    /// The fault thread's loop: read faults, answer or ask, until stopped.
    fn run_faults(&self) -> Result<(), MigrateError> {
        let mut faults = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            faults.clear();
            self.uffd.read_faults(&mut faults, FAULT_POLL)?;
            self.faults
                .fetch_add(faults.len() as u64, Ordering::Relaxed);
            let mut ask: Vec<(u64, u64)> = Vec::new();
            let mut since = Vec::new();
            for f in &faults {
                if let Some((gpa, at)) = self.on_fault(f)? {
                    ask.push((gpa, self.unit_pages()));
                    since.push(at);
                }
            }
            for chunk in ask.chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize) {
                let asked = self.write(
                    &Header::runs(Kind::PageRequest, chunk.len() as u32),
                    &wire::encode_runs(chunk),
                );
                match asked {
                    // Paused: the recovery asks again for every requested page still missing.
                    Err(e) if self.recoverable => {
                        tracing::debug!("a page request waits for the recovery: {e}");
                        break;
                    }
                    r => r?,
                }
            }
            if !ask.is_empty() {
                let mut s = self.stages.lock().unwrap();
                for at in since {
                    s.ask.add(at.elapsed().as_micros() as u64);
                }
            }
        }
        Ok(())
    }
}

/// The fault thread of a postcopy phase.
#[derive(Debug)]
pub(crate) struct FaultThread {
    pc: Arc<Postcopy>,
    thread: Option<JoinHandle<()>>,
}

impl FaultThread {
    pub(crate) fn start(pc: Arc<Postcopy>) -> Result<FaultThread, MigrateError> {
        let shared = pc.clone();
        let thread = std::thread::Builder::new()
            .name("postcopy-faults".into())
            .spawn(move || {
                if let Err(e) = shared.run_faults() {
                    *shared.failure.lock().unwrap() = Some(Arc::new(e));
                    let _guard = shared.all_in.0.lock().unwrap();
                    shared.all_in.1.notify_all();
                }
            })
            .map_err(|e| MigrateError::io("starting the postcopy fault thread", e))?;
        Ok(FaultThread {
            pc,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(mut self) {
        self.pc.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
