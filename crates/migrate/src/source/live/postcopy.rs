//! Postcopy on the source: pause the guest, tell the destination which pages it must fetch
//! again (Discard), hand over the device state (Postcopy), and once the guest runs there,
//! send every remaining page, those a vCPU waits for first.
//!
//! Invariants:
//! - The set of pages still to send is the dirty bitmap after the final sync, and every page
//!   leaves it exactly once, by the background walk or by a request (`test_and_clear`), so the
//!   destination receives each missing page at least once, in the only version there is: the
//!   guest no longer runs here. A page goes twice only by a request: resent ahead of a queued
//!   copy, or forwarded by the reader (`forward.rs`) while the walk had it; the destination
//!   installs the first copy and drops the second.
//! - The guest is `GuestState::HandedOver` once the Postcopy record is flushed: from then on the destination may
//!   run the guest, so a failure leaves it paused here, and the migration cannot be cancelled.
//! - A request is served before the next background batch is queued; a request where the
//!   last one's readahead window ended brings a window of the pages after it along
//!   (`readahead.rs`), and the walk then follows that vCPU from there. Otherwise the walk goes
//!   hottest chunk first (`heat.rs`).
//! - For the first `postcopy_quiet_start` after the guest resumed there, only requested pages (and
//!   their readahead) are sent: the guest's first faults do not share the cores with the bulk.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::bitmap::DirtyBitmap;
use crate::control::Phase;
use crate::error::{MigrateError, ProtocolError, Rule};
use crate::source::forward::Requested;
use crate::source::heat::Walk;
use crate::source::postcopy_state::PostcopyState;
use crate::source::readahead;
use crate::source::reader::Inbound;
use crate::source::{GuestState, Session, ms};
use crate::stats::{PostcopyStats, PostcopyTrigger};
use crate::vm::SourceVm;
use crate::wire::{self, Header, Kind, Latencies, PAGE_SIZE};

/// Discard lists sent while the guest still runs, at most: each one waits for the destination
/// to apply the one before and lists the pages dirtied meanwhile. A guest writing 1 GiB flat
/// out in order (`ferry bench postcopy --pause-only`) shrinks the list by ~0.4x a round (240K,
/// 60K, 23K, 9K pages): after 4 rounds 9K pages were left to punch in the pause, ~7 ms; 8
/// rounds reach the bound below.
const EARLY_DISCARD_ROUNDS: u32 = 8;
/// Few enough pages for the destination to punch out within the pause: ~1 ms at the ~0.94 us a
/// page of runs measured by `ferry bench channels` ("making stale pages zero"). No further
/// round before pausing.
const LATE_DISCARD_PAGES: u64 = 1024;
/// Longest wait for the destination to apply a discard list before the next round.
const DISCARD_WAIT: Duration = Duration::from_secs(2);

/// Discard runs closer than this many pages are merged (see `Session::coalesce`).
const DISCARD_GAP: u64 = 16;

/// Longest the source waits for a page request while the bandwidth limit or a full data
/// channel holds the background walk back; a request that comes ends the wait at once.
const REQUEST_POLL: Duration = Duration::from_millis(1);

/// Most pages one requested run brings (before its readahead window): a vCPU's fault asks for
/// one page or one host page, so a run that spans a region (a stranger's, or a bug's) is not
/// queued page by page.
const MAX_REQUEST_PAGES: u64 = 4096;
/// Bytes of requested runs (windows included) looked at in one pick.
const MAX_PICK_BYTES: u64 = 2 * MAX_REQUEST_PAGES * PAGE_SIZE;

/// How long the source waits at most for the destination's Done after sending every page: the
/// destination installs what is in flight and answers; this bounds a destination that hangs.
/// A peer timeout shorter than this bounds the wait instead: a stopped destination keeps its
/// sockets open (its kernel even answers keepalives), so only silence tells it is gone.
const DONE_TIMEOUT: Duration = Duration::from_secs(60);

impl Session<'_> {
    /// Postcopy's state: there whenever postcopy runs, which it does only when granted, and
    /// it is asked for only in its mode.
    fn postcopy_state(&self) -> &PostcopyState {
        self.postcopy
            .as_ref()
            .expect("postcopy runs only in its mode")
    }

    /// Switches to postcopy after precopy pass `pass` and sends the rest.
    pub(super) fn postcopy(
        &mut self,
        vm: &mut dyn SourceVm,
        pass: u32,
        trigger: PostcopyTrigger,
    ) -> Result<(), MigrateError> {
        let settings = self.postcopy_state().settings.clone();
        self.set_phase(Phase::Discarding);
        let mut pc = PostcopyStats {
            after_passes: pass,
            trigger,
            ..PostcopyStats::default()
        };
        // The pages dirty at the last sync will be sent in postcopy whatever happens next: the
        // destination drops them while the guest still runs here (punching a GiB out of its
        // memory takes it ~0.2 s), and again those dirtied meanwhile, so that the pause only
        // covers the last few.
        let unit = self.peer.agreed.postcopy_unit;
        self.bitmap.round_out(unit);
        let mut early = DirtyBitmap::new(self.ram.regions());
        for round in 1..=EARLY_DISCARD_ROUNDS {
            let runs = self.coalesce(
                self.bitmap
                    .runs_except(Some(&early), wire::MAX_ZERO_RUN_PAGES),
                Some(&early),
            );
            let pages: u64 = runs.iter().map(|r| r.1).sum();
            for &(gpa, n) in &runs {
                for k in 0..n {
                    early.set(gpa + k * PAGE_SIZE);
                    self.bitmap.set(gpa + k * PAGE_SIZE);
                }
            }
            self.send_discards(&runs)?;
            self.peer.conn.flush("discarding stale pages")?;
            pc.early_discard_rounds = round;
            // Applied before anything else, the last round too: what it lists would otherwise
            // be punched out within the pause.
            let applied = self.wait_applied()?;
            if pages <= LATE_DISCARD_PAGES || !applied {
                break;
            }
            self.sync_dirty(vm)?;
            self.bitmap.round_out(unit);
        }
        let (t0, t1) = self.pause_guest(vm)?;
        self.sync_dirty(vm)?;
        self.bitmap.round_out(unit);
        let t2 = Instant::now();
        let late = self.coalesce(
            self.bitmap
                .runs_except(Some(&early), wire::MAX_ZERO_RUN_PAGES),
            Some(&early),
        );
        for &(gpa, pages) in &late {
            for k in 0..pages {
                self.bitmap.set(gpa + k * PAGE_SIZE);
            }
        }
        pc.discarded_pages = self.bitmap.count();
        self.send_discards(&late)?;
        drop(early);
        // Iterative state's rest goes on the main connection among the discard lists,
        // before the device state.
        self.send_state(vm, crate::source::limiter::Pacing::Unlimited)?;
        self.peer.pool.postcopy()?;
        self.finish_hints(vm);
        let sections = vm.save_state()?;
        let t3 = Instant::now();
        self.note_state(vm, &sections);
        // No final pages: they come after the switch. The destination may ask for pages while
        // it loads the state (a VMM's load can touch guest memory: KVM reads a vCPU's clock
        // page when its MSR is set); they are served at once.
        let listed = self.bitmap.clone();
        let mut walk = Walk::new(&self.bitmap, &self.postcopy_state().heat, settings.order);
        self.peer.readahead = readahead::Readahead::new(settings.prefetch_pages);
        self.peer
            .acks
            .reader
            .as_ref()
            .expect("the reader runs")
            .allow_requests();
        let handed = self.hand_over(
            &sections,
            Kind::Postcopy,
            [t0, t1, t2, t2, t3],
            Some(&mut |s: &mut Self| {
                s.serve_requests(&mut walk, &mut pc, &mut Vec::new(), &listed)
            }),
        );
        let bytes_at_switch = self.bytes_written();
        self.set_phase(Phase::Postcopy);
        if settings.max_bandwidth.is_some() {
            self.set_max_bandwidth(settings.max_bandwidth);
            let shown = self.params.settings();
            self.control.update(|p| p.settings = shown);
        }
        let mut walk = Some(walk);
        let mut quiet_until = Some(Instant::now() + settings.quiet_start);
        match handed {
            Ok(()) => {}
            // A break between Postcopy and Resumed: the destination has the state and may run
            // the guest, so both sides pause, and a recovery goes on from its Missing list.
            Err(e) if self.guest == GuestState::HandedOver && self.recoverable(&e) => {
                self.recover(&mut pc, &listed, e)?;
                (walk, quiet_until) = (None, None);
            }
            Err(e) => return Err(e),
        }
        let mut written_at = None;
        let latencies = loop {
            // After a recovery the walk starts over the destination's list.
            let from = walk.take().unwrap_or_else(|| {
                Walk::new(&self.bitmap, &self.postcopy_state().heat, settings.order)
            });
            let sent = self
                .share_main()
                .and_then(|()| {
                    let pushed = self.push_rest(&mut pc, &listed, from, quiet_until.take());
                    self.unshare_main(&mut pc);
                    pushed
                })
                .and_then(|()| self.peer.pool.close(&mut self.report.stats))
                .inspect(|()| written_at = Some(Instant::now()))
                .and_then(|()| {
                    self.peer
                        .conn
                        .write_header(&Header::new(Kind::Complete, 0, 0))
                })
                .and_then(|()| self.peer.conn.flush("completing postcopy"))
                .and_then(|()| self.await_done(&mut pc));
            match sent {
                Ok(latencies) => break latencies,
                Err(e) if self.recoverable(&e) => self.recover(&mut pc, &listed, e)?,
                Err(e) => return Err(e),
            }
        };
        pc.duration_ms = ms(t0.elapsed());
        pc.bytes = self.bytes_written() - bytes_at_switch;
        pc.latency_mean_us = latencies.mean_us();
        pc.latency_p50_us = latencies.quantile_us(0.5);
        pc.latency_p99_us = latencies.quantile_us(0.99);
        pc.latency_max_us = latencies.max_us;
        pc.latency_buckets = latencies.buckets.to_vec();
        pc.source_turnaround = (&self.peer.pool.turnaround()).into();
        pc.pages_forwarded += self.peer.pool.forwarded_pages();
        pc.source_handoff = (&self.postcopy_state().handoff).into();
        pc.vcpu_blocktime_ms = latencies.sum_us as f64 / 1e3;
        pc.push = self.peer.pool.clock().stages();
        if let Some((began, bytes)) = self.postcopy_state().push_began {
            pc.push.ms = ms(began.elapsed());
            pc.push.written_ms = written_at.map_or(0.0, |w| ms(w - began));
            pc.push.bytes = self.bytes_written() - bytes;
        }
        self.report.stats.postcopy = Some(pc);
        Ok(())
    }

    /// Merges discard runs that are fewer than [`DISCARD_GAP`] pages apart (in one region,
    /// within the wire's run length, and over no page of `done`, which was discarded already):
    /// each run costs the destination a hole punched in its memory (1–4 µs however short), so
    /// sending a few clean pages again is cheaper than punching around them. The caller marks
    /// the merged runs to be sent.
    fn coalesce(&self, runs: Vec<(u64, u64)>, done: Option<&DirtyBitmap>) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for (gpa, pages) in runs {
            if let Some((start, n)) = out.last_mut() {
                let end = *start + *n * PAGE_SIZE;
                let merged = (gpa + pages * PAGE_SIZE - *start) / PAGE_SIZE;
                let mergeable = gpa >= end
                    && (gpa - end) / PAGE_SIZE < DISCARD_GAP
                    && merged <= wire::MAX_ZERO_RUN_PAGES
                    && self.ram.check_run(*start, merged).is_ok()
                    && done.is_none_or(|d| {
                        (end..gpa)
                            .step_by(PAGE_SIZE as usize)
                            .all(|g| !d.contains(g))
                    });
                if mergeable {
                    *n = merged;
                    continue;
                }
            }
            out.push((gpa, pages));
        }
        out
    }

    /// Waits (bounded by [`DISCARD_WAIT`]) until the destination acknowledged everything
    /// sent, the discard lists included (it acknowledges one once applied); false when it does
    /// not acknowledge, or took too long.
    fn wait_applied(&mut self) -> Result<bool, MigrateError> {
        let deadline = Instant::now() + DISCARD_WAIT;
        loop {
            self.check_control()?;
            self.note_acks();
            if self.peer.acks.use_ != crate::source::ack_state::AckUse::Live {
                return Ok(false);
            }
            if self.in_flight() == 0 {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Writes Discard records for `runs`.
    fn send_discards(&mut self, runs: &[(u64, u64)]) -> Result<(), MigrateError> {
        for chunk in runs.chunks(wire::MAX_ZERO_RUNS_PER_RECORD as usize) {
            self.peer.conn.write_record(
                &Header::runs(Kind::Discard, chunk.len() as u32),
                &wire::encode_runs(chunk),
            )?;
        }
        Ok(())
    }

    /// Sends every page left in the bitmap: requested pages as soon as they are asked for,
    /// the rest in the walk's order (`heat.rs`). Until `quiet_until` only requests are served
    /// (see `SourceParams::postcopy_quiet_start`).
    ///
    /// The session never blocks where a request could wait: a background batch waits for the
    /// bandwidth limit or for room in a data channel's queue by waiting for requests (at most
    /// [`REQUEST_POLL`] at a time), and a request is served as soon as it is queued.
    fn push_rest(
        &mut self,
        pc: &mut PostcopyStats,
        listed: &DirtyBitmap,
        mut walk: Walk,
        quiet_until: Option<Instant>,
    ) -> Result<(), MigrateError> {
        let packet = self.batch_pages();
        // The background batch taken from the bitmap and not queued yet.
        let mut held: Vec<u64> = Vec::with_capacity(packet);
        let wakeup = self.peer.pool.wakeup();
        self.peer
            .acks
            .reader
            .as_ref()
            .expect("the reader runs")
            .ring_on_requests(wakeup.clone());
        loop {
            // Read before anything is looked at: a ring after it ends the wait for room.
            let seen = wakeup.seen();
            self.check_ended()?;
            self.retune();
            let serving = Instant::now();
            self.serve_requests(&mut walk, pc, &mut held, listed)?;
            self.peer.pool.clock().serve.since(serving);
            self.publish_running(Instant::now(), Some(pc));
            if held.is_empty() {
                if self.bitmap.count() == 0 {
                    return Ok(());
                }
                let quiet = quiet_until.map_or(Duration::ZERO, |t| {
                    t.saturating_duration_since(Instant::now())
                });
                if !quiet.is_zero() {
                    self.wait_requests(quiet.min(REQUEST_POLL));
                    continue;
                }
                if walk.at_end() {
                    // Pages listed again after the walk began (a recovery's).
                    walk = walk.again(&self.bitmap, &self.postcopy_state().heat);
                }
                // Whole units: a chunk holds whole units, and a batch is one unit or more.
                let (walking, bytes) = (Instant::now(), self.bytes_written());
                let state = self.postcopy.as_mut().expect("postcopy's mode");
                state.push_began.get_or_insert((walking, bytes));
                walk.take(&mut self.bitmap, packet, &mut held);
                self.peer.pool.clock().walk.since(walking);
                if let Some(l) = &mut self.link.limiter {
                    l.add(held.len() as u64 * (8 + PAGE_SIZE));
                }
                continue;
            }
            let wait = self
                .link
                .limiter
                .map_or(Duration::ZERO, |l| l.wait(self.report.start.elapsed()));
            if !wait.is_zero() {
                self.wait_requests(wait.min(REQUEST_POLL));
                continue;
            }
            let n = held.len() as u64;
            match self.peer.pool.try_queue_pages(std::mem::take(&mut held))? {
                None => {
                    pc.pages_background += n;
                    self.link.handed_pages += n;
                    held.reserve(packet);
                    self.after_batch();
                }
                Some(back) => {
                    held = back;
                    // Every queue full: until a sender takes a batch or a request comes.
                    let waiting = Instant::now();
                    wakeup.wait(seen, REQUEST_POLL);
                    self.peer.pool.clock().room_wait.since(waiting);
                }
            }
        }
    }

    /// Pages in one postcopy batch: the packet, or one destination host page when those are
    /// bigger, so that a huge page travels whole in one batch on one connection (the
    /// destination assembles it there; see `destination/assemble.rs`).
    fn batch_pages(&self) -> usize {
        if self.peer.agreed.postcopy_unit > 1 {
            self.peer.agreed.postcopy_unit as usize
        } else {
            self.params.packet_pages as usize
        }
    }

    /// Waits up to `timeout` for a page request (or less, if one is queued already).
    fn wait_requests(&self, timeout: Duration) {
        self.peer
            .acks
            .reader
            .as_ref()
            .expect("the reader runs")
            .wait_requests(timeout);
    }

    /// Queues the pages the destination asked for that are still to send (in the bitmap, or
    /// in the background batch `held` that waits for the bandwidth limit), ahead of the walk,
    /// and moves the walk to just after the last of them. A request for a page already sent
    /// (it is on its way) is counted and otherwise ignored.
    ///
    /// With the preempt connection (or the main connection, MAIN_PAGES), a request for a
    /// listed page the walk already queued is served again on it: the first copy may wait
    /// behind megabytes of background stream, and the page's bytes cannot change any more
    /// (the guest runs on the destination), so the destination keeps whichever copy lands
    /// first and drops the other.
    ///
    /// It does not look at how the reader ended: the caller does, except while the source
    /// waits for Resumed (which ends nothing) during a load that faults.
    fn serve_requests(
        &mut self,
        walk: &mut Walk,
        pc: &mut PostcopyStats,
        held: &mut Vec<u64>,
        listed: &DirtyBitmap,
    ) -> Result<(), MigrateError> {
        let unit = self.peer.agreed.postcopy_unit * PAGE_SIZE;
        let (requested, asked) = self.take_requests(pc)?;
        if requested.iter().any(|r| !r.forwarded) {
            self.postcopy
                .as_mut()
                .expect("postcopy's mode")
                .handoff
                .add(asked.elapsed().as_micros() as u64);
        }
        // Whole host pages of the destination, whatever it asked: `(gpa, bytes)`.
        let whole = |gpa: u64, pages: u64| {
            let start = gpa - gpa % unit;
            (
                start,
                (gpa + pages * PAGE_SIZE).next_multiple_of(unit) - start,
            )
        };
        let (mut runs, mut forwarded) = (Vec::new(), Vec::new());
        let mut sequential = false;
        for r in requested {
            if self.bitmap.contains(r.gpa) || held.contains(&r.gpa) {
                pc.faults_unreached += 1;
            }
            let pages = clamp_request(r.pages);
            // The pages after a sequential vCPU's fault, in the same run (readahead.rs).
            let window = self.peer.readahead.request(r.gpa, pages);
            sequential |= self.peer.readahead.sequential();
            let end = self
                .ram
                .region_end(r.gpa)
                .unwrap_or(r.gpa + pages * PAGE_SIZE);
            let ahead = window.min((end - r.gpa) / PAGE_SIZE - pages);
            pc.pages_readahead += ahead;
            if r.forwarded {
                // Its pages are queued already (forward.rs): the window is what is left.
                forwarded.push(whole(r.gpa, pages));
                if ahead > 0 {
                    runs.push(whole(r.gpa + pages * PAGE_SIZE, ahead));
                }
            } else {
                runs.push(whole(r.gpa, pages + ahead));
            }
        }
        // The forwarded pages leave what is still to send, counted as any requested page.
        let mut last = None;
        for batch in pick_batches(&forwarded) {
            let (taken, again) =
                readahead::pick(batch.iter().copied(), &mut self.bitmap, held, Some(listed));
            pc.pages_requested += taken.len() as u64;
            pc.pages_resent += again.len() as u64;
            last = taken.last().copied().or(last);
        }
        // Once the guest runs there, the main connection carries nothing else (MAIN_PAGES):
        // requested pages on it wait behind no background stream. Before, the destination's
        // session is loading the state and reads only the data channels.
        let on_main = self.peer.agreed.main_pages && self.report.phase == Phase::Postcopy;
        let resend = (self.peer.agreed.preempt || on_main).then_some(listed);
        // Picked a bounded number of pages at a time, so that however many requests are
        // queued, the pages looked at once stay few.
        for batch in pick_batches(&runs) {
            let (urgent, again) =
                readahead::pick(batch.iter().copied(), &mut self.bitmap, held, resend);
            pc.pages_resent += again.len() as u64;
            pc.pages_requested += urgent.len() as u64;
            for chunk in again.chunks(self.batch_pages()) {
                self.send_urgent(chunk, on_main, pc, asked)?;
            }
            for chunk in urgent.chunks(self.batch_pages()) {
                self.send_urgent(chunk, on_main, pc, asked)?;
            }
            if on_main && !(urgent.is_empty() && again.is_empty()) {
                self.peer.conn.flush("sending requested pages")?;
                self.peer.pool.note_turnaround(asked);
            }
            last = urgent.last().copied().or(last);
        }
        let Some(last) = last else {
            return Ok(());
        };
        walk.after_request(&self.bitmap, last, sequential);
        self.after_batch();
        Ok(())
    }

    /// Sends pages a vCPU waits for: on the main connection or, as `pool.queue_urgent`
    /// decides, on the preempt connection or the next data channel.
    fn send_urgent(
        &mut self,
        gpas: &[u64],
        on_main: bool,
        pc: &mut PostcopyStats,
        asked: Instant,
    ) -> Result<(), MigrateError> {
        if !on_main {
            return self.peer.pool.queue_urgent(gpas.to_vec(), asked);
        }
        self.write_main(gpas)?;
        self.report.stats.pages_normal += gpas.len() as u64;
        pc.pages_on_main += gpas.len() as u64;
        Ok(())
    }

    /// The page requests queued since the last call, counted and checked: a request outside
    /// RAM ends the migration.
    fn take_requests(
        &self,
        pc: &mut PostcopyStats,
    ) -> Result<(Vec<Requested>, Instant), MigrateError> {
        let (runs, since) = self
            .peer
            .acks
            .reader
            .as_ref()
            .expect("the reader runs")
            .take_requests();
        for r in &runs {
            pc.requests += 1;
            self.ram
                .check_run(r.gpa, r.pages)
                .map_err(ProtocolError::RequestOutsideRam)?;
        }
        Ok((runs, since.unwrap_or_else(Instant::now)))
    }

    /// Fails if the reader ended: the destination's Error, or a broken main connection (the
    /// destination cannot ask for pages any more); or, as if it had broken, when a pause was
    /// asked for.
    fn check_ended(&mut self) -> Result<(), MigrateError> {
        self.check_pause()?;
        let reader = self.peer.acks.reader.as_ref().expect("the reader runs");
        match reader.poll() {
            None => Ok(()),
            Some(Ok(Inbound::Error(message))) => Err(MigrateError::Remote(
                crate::error::Side::Destination,
                message,
            )),
            Some(Ok(Inbound::Done(_))) => Err(MigrateError::misplaced(Kind::Done, Rule::DoneLast)),
            Some(Ok(other)) => Err(MigrateError::misplaced(other.kind(), Rule::InPostcopy)),
            Some(Err(e)) => Err(e),
        }
    }

    /// Waits for the destination's Done; requests that still arrive are for pages on their
    /// way and are only counted (and checked).
    fn await_done(&mut self, pc: &mut PostcopyStats) -> Result<Latencies, MigrateError> {
        let wait = self
            .params
            .peer_timeout
            .map_or(DONE_TIMEOUT, |t| t.min(DONE_TIMEOUT));
        let deadline = Instant::now() + wait;
        loop {
            self.check_pause()?;
            self.take_requests(pc)?;
            let reader = self.peer.acks.reader.as_ref().expect("the reader runs");
            match reader.wait(Duration::from_millis(50)) {
                Some(Ok(Inbound::Done(l))) => return Ok(*l),
                Some(Ok(Inbound::Error(message))) => {
                    return Err(MigrateError::Remote(
                        crate::error::Side::Destination,
                        message,
                    ));
                }
                Some(Ok(other)) => {
                    return Err(MigrateError::misplaced(other.kind(), Rule::AwaitingDone));
                }
                Some(Err(e)) => return Err(e),
                None if Instant::now() > deadline => {
                    return Err(MigrateError::io(
                        "waiting for the destination to install the last pages",
                        std::io::Error::from(std::io::ErrorKind::TimedOut),
                    ));
                }
                None => {}
            }
        }
    }
}

/// The pages of a requested run the source serves (before its readahead window): a vCPU's
/// fault asks for a page or a few, so more is a stranger's or a bug's, and the background walk
/// sends the rest anyway.
fn clamp_request(pages: u64) -> u64 {
    pages.min(MAX_REQUEST_PAGES)
}

/// `runs` (`(gpa, bytes)`) in consecutive batches of at most [`MAX_PICK_BYTES`] each (a
/// longer run alone), so that however many requests are queued, a pick looks at few pages.
fn pick_batches(runs: &[(u64, u64)]) -> Vec<&[(u64, u64)]> {
    let mut batches = Vec::new();
    let mut rest = runs;
    while !rest.is_empty() {
        let mut bytes = 0;
        let n = rest
            .iter()
            .take_while(|r| {
                bytes += r.1;
                bytes <= MAX_PICK_BYTES || bytes == r.1
            })
            .count();
        let (batch, after) = rest.split_at(n);
        batches.push(batch);
        rest = after;
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination could make the source queue every page of a run that spans a region (a
    /// 1 GiB run: 262,144 pages looked at and queued at once).
    #[test]
    fn regression_a_request_spanning_a_region_is_served_a_bounded_number_of_pages_at_a_time() {
        assert_eq!(clamp_request((1 << 30) / PAGE_SIZE), MAX_REQUEST_PAGES);
        assert_eq!(clamp_request(1), 1);
        // A million one-page runs, and one huge run among them.
        let mut runs: Vec<(u64, u64)> =
            (0..1_000_000).map(|i| (i * PAGE_SIZE, PAGE_SIZE)).collect();
        runs[500_000].1 = MAX_PICK_BYTES * 3;
        let batches = pick_batches(&runs);
        let flat: Vec<(u64, u64)> = batches.iter().flat_map(|b| b.iter().copied()).collect();
        assert_eq!(flat, runs, "every run once, in order");
        for b in &batches {
            let bytes: u64 = b.iter().map(|r| r.1).sum();
            assert!(
                bytes <= MAX_PICK_BYTES || b.len() == 1,
                "{} runs, {bytes} bytes",
                b.len()
            );
        }
        assert!(batches.len() >= 1_000_000 * PAGE_SIZE as usize / MAX_PICK_BYTES as usize);
    }
}
