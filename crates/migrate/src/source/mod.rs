//! The sending side: setup, pass 1 over populated memory, dirty passes until the policy says
//! switch over, then pause, send the rest and the device state, and wait for the destination
//! to resume the guest.
//!
//! One migration is a `Session` value that owns its target (`target.rs`: where the pages go;
//! `Live`, a live destination's connections, reader and channel pool, by default), RAM,
//! bitmap and the values below, and is consumed by `Session::conclude`. The transfer core is
//! written over any target and lives in this folder's files; what only one kind of target
//! does lives beside it: a live destination's in `live/` (the handshake, the handover with
//! its Resumed, postcopy, recovery, the local handover), a file's in `keep.rs`. The core's
//! phases live one to a file:
//!
//! - here: the entry point and the ending (success, or failure with the guest resumed unless
//!   it was handed over);
//! - `precopy.rs`: pass 1, the dirty passes and the policy call between them;
//! - `switchover.rs`: pause, final pass, device state saved, and the downtime breakdown;
//! - `observe.rs`: what the policy observes (in flight, the absorption rate) and the drain
//!   before a switchover;
//! - `progress.rs`: what the session publishes to [`Control`] and samples on the timeline;
//! - `hints.rs`: free page hints around the dirty syncs;
//! - `iterate.rs`: iterative device state, chunks after each pass's pages, and the wait for
//!   the destination's StateReady before a switchover.
//!
//! The session's own values, each in a file of its own: `params.rs` (the parameters, the
//! [`Mode`] and their check, and the test hooks), `link.rs` (the limiter, the send rate and
//! what a page costs on the wire), `converge.rs` (the stall count, throttle and dirty limit in
//! force), `report.rs` (statistics, timeline and their clocks), `hint_rounds.rs` (free page
//! hints), `iteration.rs` (iterative device state: pending and sent) and `postcopy_state.rs`
//! (postcopy's settings, heat and request hand-off, present only
//! in its mode).
//!
//! And the parts the phases use: `target.rs` (the seam: where pages go, and what the target
//! acknowledged and said), `agreement.rs` (what the destination granted, one value the
//! handshake sets in place of a flag per capability), `ack_state.rs` (a live destination's
//! acknowledgements), `pool.rs` (the data channels' senders), `sender.rs` (one channel's
//! sender thread), `reader.rs` (the thread that reads what comes back on the main
//! connection), `forward.rs`, `readahead.rs` and `heat.rs` (postcopy's request forwarding,
//! readahead and push order), `limiter.rs` and `bandwidth.rs` (the rate limit and the rate
//! window as pure values).
//!
//! Each file below this one stands on it or on its siblings, never both ways: a value the
//! session holds sits in a file of its own, and the phases that use it add their steps to
//! `Session` in theirs.
//!
//! Pages travel on `channels` data connections, each with a sender thread (see `sender.rs`) fed
//! batches of `packet_pages` addresses round-robin; the main connection carries pass ends,
//! device state and Complete. Every step is bounded: batches are at most 2 MiB, the bitmap
//! walk scans a bounded number of words per call, and between any two of these the loop
//! checks cancellation and the rate limit. Dirty tracking starts empty
//! (`SourceVm::start_dirty_log`, one call into the VMM whose cost follows populated memory,
//! counted as the loop's first step in `max_step_ms`) and pass 1 walks populated memory
//! only, so no step follows the configured size of RAM.
//!
//! Invariant: the source never runs a guest it handed over. Until Complete is sent, any failure
//! resumes a paused guest and tells the destination why; after it, the guest stays paused.

#![forbid(unsafe_code)]

mod ack_state;
pub(crate) mod agreement;
mod bandwidth;
mod converge;
mod forecast;
mod forward;
mod heat;
mod hint_rounds;
mod hints;
mod iterate;
mod iteration;
pub(crate) mod keep;
mod limiter;
mod link;
mod live;
mod observe;
mod params;
mod pool;
mod postcopy_state;
mod precopy;
mod progress;
mod readahead;
mod reader;
mod report;
mod sender;
mod switchover;
pub(crate) mod target;
mod wakeup;

use std::time::{Duration, Instant};

use self::converge::Convergence;
use self::hint_rounds::Hints;
use self::iteration::Iteration;
use self::limiter::Pacing;
use self::link::Link;
use self::live::Live;
pub use self::params::{
    DEFAULT_CHANNELS, DEFAULT_PACKET_PAGES, DEFAULT_PEER_TIMEOUT, DEFAULT_POSTCOPY_QUIET_START,
    Mode, Postcopy, PostcopyOrder, Preempt, SourceParams, TestHooks,
};
use self::postcopy_state::PostcopyState;
use self::report::Report;
pub(crate) use self::target::Target;
use crate::bitmap::DirtyBitmap;
use crate::conn::Conn;
use crate::control::{Control, Phase};
use crate::error::MigrateError;
use crate::job::JobStats;
use crate::ram::Ram;
use crate::stats::MigrationStats;
use crate::transport::Stream;
use crate::vm::SourceVm;

/// How precopy ended: the pass it sent last, and what comes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// Pause, send the last dirty pages and the state, and hand over.
    Switchover(u32),
    /// Pause, hand over with the state, and send the rest while the guest runs there; and why.
    Postcopy(u32, crate::stats::PostcopyTrigger),
}

/// Where the guest runs, and so whether a pass's pages are paced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GuestState {
    /// Precopy: the guest dirties pages behind the pass; the pass is paced and cancellable.
    Running,
    /// Switchover: every millisecond is downtime, so the pass is never paced, and it is not
    /// cancelled half-way (a failure still resumes the guest).
    Paused,
    /// Complete (or Postcopy) was sent: from here the guest may run on the destination, so
    /// a failure never resumes it here.
    HandedOver,
}

impl GuestState {
    /// A paused guest's pages are downtime, and so are a handed-over guest's faults: they
    /// go out as fast as the link takes them.
    fn pacing(self) -> Pacing {
        match self {
            GuestState::Running => Pacing::Limited,
            GuestState::Paused | GuestState::HandedOver => Pacing::Unlimited,
        }
    }
}

/// Migrates `vm` over `stream`. On success the source VM is left paused (the guest runs on the
/// destination); on any failure before the guest was handed over it runs again, with nothing
/// lost, and a later migration sends everything anew.
pub fn migrate<S: Stream + 'static>(
    vm: &mut dyn SourceVm,
    stream: S,
    connect: &dyn Fn() -> std::io::Result<S>,
    params: &SourceParams,
    control: &Control,
) -> Result<MigrationStats, MigrateError> {
    migrate_with_hooks(vm, stream, connect, params, control, &TestHooks::default())
}

/// [`migrate`] with faults injected: for the engine's own tests only.
#[doc(hidden)]
pub fn migrate_with_hooks<S: Stream + 'static>(
    vm: &mut dyn SourceVm,
    stream: S,
    connect: &dyn Fn() -> std::io::Result<S>,
    params: &SourceParams,
    control: &Control,
    hooks: &TestHooks,
) -> Result<MigrationStats, MigrateError> {
    params.check()?;
    stream
        .set_write_timeout(params.peer_timeout)
        .and_then(|()| stream.set_keepalive(params.peer_timeout))
        .map_err(|e| MigrateError::io("setting up the connection", e))?;
    let conn = Conn::new(Box::new(stream))
        .map_err(|e| MigrateError::io("setting up the connection", e))?;
    let ram = Ram::new(vm.ram())?;
    let mut session = Session::new(ram, Live::new(conn), params, *hooks, control);
    control.update(|p| {
        p.phase = Phase::Setup;
        p.settings = params.settings();
        p.local = params.is_local();
    });
    let connect = || {
        let s = connect()?;
        s.set_write_timeout(params.peer_timeout)?;
        s.set_keepalive(params.peer_timeout)?;
        Ok(Box::new(s) as Box<dyn Stream>)
    };
    let result = session.run(vm, &connect);
    session.conclude(vm, result)
}

/// One outgoing migration, to a live destination (`Live`, the default) or to another
/// [`Target`]. The core holds what every target needs; what only a live destination has (its
/// reader and acknowledgements, postcopy's connections) is the target's, and postcopy's own
/// state is a value of its own, present only when the migration may switch to it.
struct Session<'a, P = Live> {
    /// Where the pages go: the connections, what was agreed and acknowledged on them, or a
    /// file.
    peer: P,
    ram: Ram,
    bitmap: DirtyBitmap,
    params: SourceParams,
    hooks: TestHooks,
    control: &'a Control,
    /// The bandwidth limit, the send rate and what a page costs on the wire.
    link: Link,
    /// The stall count, and the throttle and dirty limit in force.
    converge: Convergence,
    /// Statistics, timeline and the clocks behind them.
    report: Report,
    /// Running, paused, or handed over: from the handover the guest may run on the
    /// destination, so the source must never run it again.
    guest: GuestState,
    /// Free page hints: rounds, and pass 1's pages to skip.
    hints: Hints,
    /// Iterative device state, once started (`iterate.rs`).
    iteration: Option<Iteration>,
    /// Postcopy's settings and what it gathers in precopy (the heat) and after the switch
    /// (the request hand-off); `None` unless [`Mode::Postcopy`].
    postcopy: Option<PostcopyState>,
}

impl<'a, P: Target> Session<'a, P> {
    fn new(
        ram: Ram,
        peer: P,
        params: &SourceParams,
        hooks: TestHooks,
        control: &'a Control,
    ) -> Session<'a, P> {
        Session {
            peer,
            bitmap: DirtyBitmap::new(ram.regions()),
            ram,
            params: params.clone(),
            hooks,
            control,
            link: Link::new(params.max_bandwidth),
            converge: Convergence::default(),
            report: Report::new(),
            guest: GuestState::Running,
            hints: if params.free_page_hints {
                Hints::default()
            } else {
                Hints::off()
            },
            iteration: None,
            postcopy: params.postcopy().cloned().map(PostcopyState::new),
        }
    }

    /// Ends the session: stops the senders and dirty logging, and on failure tells the
    /// destination why and resumes the guest unless it was handed over.
    fn conclude(
        mut self,
        vm: &mut dyn SourceVm,
        result: Result<(), MigrateError>,
    ) -> Result<MigrationStats, MigrateError> {
        self.peer.abandon();
        if self.guest != GuestState::HandedOver {
            self.finish_hints(vm);
        }
        self.report.stats.vcpus = vm.vcpu_dirty();
        self.end_iteration(vm);
        vm.stop_dirty_log();
        if self.converge.dirty_limit.take().is_some()
            && let Err(e) = vm.set_dirty_limit(None)
        {
            tracing::warn!("could not lift the guest's dirty limit: {e}");
        }
        if self.converge.throttle > 0 {
            if let Err(e) = vm.set_throttle(0) {
                tracing::warn!("could not lift the guest's throttle: {e}");
            }
            self.converge.throttle = 0;
            self.control.update(|p| p.throttle_percent = 0);
        }
        match result {
            Ok(()) => {
                self.mark(Phase::Completed);
                let s = self.finish_stats();
                self.control.update(|p| {
                    p.phase = Phase::Completed;
                    // The final figures, as the statistics give them: the last publish came
                    // before the pause.
                    p.bytes_sent = s.bytes_sent;
                    p.remaining_bytes = 0;
                    p.state_remaining_bytes = 0;
                    p.eta_ms = Some(0.0);
                    p.elapsed_ms = s.total_ms;
                    p.job = Some(JobStats::completed(&s));
                    p.stats = Some(s.clone());
                });
                Ok(s)
            }
            Err(e) => {
                let e = self.explain(e);
                if self.guest != GuestState::HandedOver {
                    // The destination's own error is not echoed back to it.
                    if !e.from_the_peer() {
                        self.peer.send_ending(&e);
                    }
                    if self.guest == GuestState::Paused {
                        vm.resume()?;
                    }
                }
                let phase = match e {
                    MigrateError::Cancelled => Phase::Cancelled,
                    _ => Phase::Failed,
                };
                self.mark(phase);
                let s = self.finish_stats();
                self.control.update(|p| {
                    p.phase = phase;
                    p.error = Some(e.to_string());
                    p.stats = Some(s);
                });
                Err(e)
            }
        }
    }

    /// A failed write may hide the destination's own explanation: look for it (on the reader
    /// thread once it runs; before that, on the connection).
    fn explain(&mut self, e: MigrateError) -> MigrateError {
        match e {
            MigrateError::Io { .. }
            | MigrateError::Truncated { .. }
            | MigrateError::Stalled { .. } => self.peer.peer_error().map_or(e, |m| {
                MigrateError::Remote(crate::error::Side::Destination, m)
            }),
            e => e,
        }
    }

    /// Bytes written on all connections.
    fn bytes_written(&self) -> u64 {
        self.peer.bytes_written()
    }

    /// Starts the dirty log and precopy. The control loop's first step is the VMM starting
    /// its dirty log (one call, whose cost follows populated memory), so `max_step_ms`
    /// counts it.
    fn start_tracking(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        let t = Instant::now();
        self.report.last_check = Some(t);
        vm.start_dirty_log()?;
        if let Some(rate) = self.params.dirty_limit {
            self.set_dirty_limit(vm, rate)?;
        }
        self.report.stats.dirty_start_ms = ms(t.elapsed());
        self.report.stats.setup_ms = ms(self.report.start.elapsed());
        self.start_iteration(vm)?;
        // What pass 1 will send, shown from the phase's start (pass 1 counts it down).
        self.report.first_pass_left = self.ram.populated_bytes();
        self.set_phase(Phase::Precopy);
        Ok(())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
