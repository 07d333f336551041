//! The handle other threads hold on an incoming migration: what it is doing, and a way to
//! stop it. The destination's counterpart of [`crate::Control`].

#![forbid(unsafe_code)]

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::transport::Stream;

pub use crate::phase::IncomingPhase;

/// What `GET /migration` shows on a destination.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct IncomingProgress {
    pub phase: IncomingPhase,
    /// Where sources connect.
    pub listening_on: String,
    /// The source of the migration under way, once its hello was accepted.
    pub source: Option<String>,
    pub channels_announced: u16,
    pub channels_connected: u16,
    /// Passes every channel has finished.
    pub passes: u32,
    pub pages_received: u64,
    pub zero_pages_received: u64,
    /// Record headers and payloads read on every connection of the migration.
    pub bytes_received: u64,
    /// Connections dropped before or beside the migration: garbage, silence, a second source.
    pub rejected_connections: u64,
    pub last_rejection: Option<String>,
    pub elapsed_ms: f64,
    /// Postcopy recovery was granted to the source: a connection that breaks in postcopy
    /// pauses the migration instead of failing it.
    #[serde(default)]
    pub postcopy_recover: bool,
    pub error: Option<String>,
    /// While [`IncomingPhase::Preparing`]: what, and how far along.
    #[serde(default)]
    pub preparing: Option<Preparing>,
}

/// A destination's preparation before it listens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preparing {
    /// What it does, e.g. "populating guest RAM".
    pub task: String,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// Default [`IncomingControl::set_peer_timeout`]: the source's own default, far above any
/// gap between two records of a live source (a dirty sync of a huge guest takes seconds).
pub const DEFAULT_SOURCE_TIMEOUT: Duration = crate::source::DEFAULT_PEER_TIMEOUT;

/// A session's watchdog thread; dropping it stops the thread.
#[derive(Debug)]
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Shared between the destination's threads and its controllers (the API, Ctrl-C).
#[derive(Debug)]
pub struct IncomingControl {
    cancelled: AtomicBool,
    /// How long the source may send nothing on every connection together while the
    /// destination waits for it; `None`: for ever.
    peer_timeout: Mutex<Option<Duration>>,
    /// Uids besides this process's own effective uid whose source may give guest RAM in a
    /// local handover (`transport/peer.rs`).
    allow_uids: Mutex<Vec<u32>>,
    /// The watchdog found the source silent for longer than `peer_timeout` and shut the
    /// connections; the session reports it as such.
    silent: AtomicBool,
    started: Instant,
    progress: Mutex<IncomingProgress>,
    pub(crate) pages: AtomicU64,
    pub(crate) zero_pages: AtomicU64,
    pub(crate) bytes: AtomicU64,
    /// Connections of the migration under way, shut down by a cancel so that every blocked
    /// read returns at once.
    streams: Mutex<Vec<Box<dyn Stream>>>,
    /// The VM said its devices with iterative state are ready for the switchover; the
    /// acknowledger tells the source (StateReady), once.
    state_ready: AtomicBool,
    /// Where a paused postcopy migration listens for its recovery, once given.
    recovery: Mutex<Option<Box<dyn crate::transport::Listener>>>,
    /// Where phase changes are logged for watchers, if the VMM keeps a log.
    events: Option<Arc<crate::events::EventLog>>,
}

impl Default for IncomingControl {
    fn default() -> IncomingControl {
        IncomingControl {
            cancelled: AtomicBool::new(false),
            peer_timeout: Mutex::new(Some(DEFAULT_SOURCE_TIMEOUT)),
            allow_uids: Mutex::default(),
            silent: AtomicBool::new(false),
            state_ready: AtomicBool::new(false),
            started: Instant::now(),
            progress: Mutex::default(),
            pages: AtomicU64::new(0),
            zero_pages: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            recovery: Mutex::new(None),
            streams: Mutex::default(),
            events: None,
        }
    }
}

impl IncomingControl {
    /// The log its phase changes go to, if it has one.
    pub fn events(&self) -> Option<Arc<crate::events::EventLog>> {
        self.events.clone()
    }

    /// A control whose phase changes go to `events` as they are published, starting with its
    /// first phase now.
    pub fn with_events(events: Arc<crate::events::EventLog>) -> IncomingControl {
        events.push(crate::events::EventKind::Destination {
            phase: IncomingPhase::default(),
            error: None,
        });
        IncomingControl {
            events: Some(events),
            ..IncomingControl::default()
        }
    }

    /// Stops waiting or receiving: no guest will run from this migration, and the source is
    /// told so (it keeps running). Has no effect once the guest was resumed.
    pub fn cancel(&self) {
        // Under the lock, so that a connection registered at the same moment is either in the
        // list here or sees the flag in `register`.
        let streams = self.streams.lock().unwrap();
        self.cancelled.store(true, Ordering::Release);
        for s in streams.iter() {
            // The read side only: the session may still tell the source why on the main
            // connection.
            let _ = s.shutdown(Shutdown::Read);
        }
    }

    pub fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// How long a source may send nothing at all (on every connection together) while this
    /// destination waits for its records, in the handshake, precopy or postcopy, before the
    /// destination gives up on it as it would on a broken connection: before the handover no
    /// guest runs here; in postcopy with recovery granted it pauses. `None`: wait for ever.
    /// Set it before the migration starts.
    pub fn set_peer_timeout(&self, timeout: Option<Duration>) {
        *self.peer_timeout.lock().unwrap() = timeout;
    }

    /// The peer timeout in force (`None`: no bound).
    pub fn peer_timeout(&self) -> Option<Duration> {
        *self.peer_timeout.lock().unwrap()
    }

    /// Lets a source running as one of `uids`, besides this process's own effective uid, give
    /// guest RAM in a local handover (`ferry run --incoming --allow-uid`). By default only a
    /// source of this VMM's own uid may: its memory would be this guest's, and a process of
    /// another uid that kept the descriptor could write into the guest. The source's uid is
    /// read from the socket (`SO_PEERCRED`) before its descriptors are. Set it before the
    /// migration starts.
    pub fn set_allow_uids(&self, uids: Vec<u32>) {
        *self.allow_uids.lock().unwrap() = uids;
    }

    /// The uids allowed besides this process's own ([`IncomingControl::set_allow_uids`]).
    pub fn allow_uids(&self) -> Vec<u32> {
        self.allow_uids.lock().unwrap().clone()
    }

    /// Whether the watchdog gave up on a silent source (and has not been told so yet).
    pub(crate) fn silent(&self) -> bool {
        self.silent.load(Ordering::Acquire)
    }

    /// Whether the watchdog gave up on a silent source since the last look (and forgets it).
    pub(crate) fn take_silence(&self) -> bool {
        self.silent.swap(false, Ordering::AcqRel)
    }

    /// Starts the watchdog of a session: while the session waits for the source (handshake,
    /// precopy, postcopy), no byte on any connection for the peer timeout shuts every
    /// connection's read side, so that each blocked read returns and the session ends (or
    /// pauses) as on a broken connection, naming the silence.
    pub(crate) fn watch(self: &Arc<Self>) -> Option<Watchdog> {
        let timeout = (*self.peer_timeout.lock().unwrap())?;
        let control = self.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-watchdog".into())
            .spawn(move || control.watchdog(timeout, &stopping))
            .ok()?;
        Some(Watchdog {
            stop,
            thread: Some(thread),
        })
    }

    fn watchdog(&self, timeout: Duration, stop: &AtomicBool) {
        // Silence is counted in ticks this thread lived through, not in wall-clock time: a
        // destination that was itself stopped (SIGSTOP, a frozen host) does not blame the
        // source for the time it slept.
        let tick = (timeout / 8).clamp(Duration::from_millis(1), Duration::from_millis(250));
        let look = || {
            (
                self.bytes.load(Ordering::Relaxed),
                self.progress.lock().unwrap().phase,
            )
        };
        let mut last = look();
        let mut quiet = Duration::ZERO;
        while !stop.load(Ordering::Acquire) {
            std::thread::park_timeout(tick);
            let now = look();
            let waiting = matches!(
                now.1,
                IncomingPhase::Handshake | IncomingPhase::Precopy | IncomingPhase::Postcopy
            );
            if now != last || !waiting {
                (last, quiet) = (now, Duration::ZERO);
                continue;
            }
            quiet += tick;
            if quiet >= timeout {
                tracing::warn!("the source sent nothing for {timeout:?}: giving up on it");
                let streams = self.streams.lock().unwrap();
                self.silent.store(true, Ordering::Release);
                for s in streams.iter() {
                    let _ = s.shutdown(Shutdown::Read);
                }
                quiet = Duration::ZERO;
            }
        }
    }

    /// The VMM readies this destination before it listens ([`IncomingPhase::Preparing`]):
    /// `task` over `total_bytes`; [`crate::destination::listen`] ends the phase.
    pub fn preparing(&self, task: &str, total_bytes: u64) {
        self.update(|p| {
            p.phase = IncomingPhase::Preparing;
            p.preparing = Some(Preparing {
                task: task.into(),
                done_bytes: 0,
                total_bytes,
            });
        });
    }

    /// Gives a migration in postcopy-paused the listener its source reconnects to
    /// (`ferry migrate-recover`, `PUT /migration/recover`).
    pub fn recover_on(&self, listener: Box<dyn crate::transport::Listener>) {
        *self.recovery.lock().unwrap() = Some(listener);
    }

    pub(crate) fn take_recovery(&self) -> Option<Box<dyn crate::transport::Listener>> {
        self.recovery.lock().unwrap().take()
    }

    /// Breaks a postcopy migration's connections as a network failure would (`PUT
    /// /migration/pause` on the destination): they are shut down, and both sides pause. Only
    /// a migration in postcopy with recovery granted can be paused (any other would fail and
    /// give the guest up): false, and nothing done, otherwise.
    pub fn pause_postcopy(&self) -> bool {
        let streams = self.streams.lock().unwrap();
        let p = self.progress.lock().unwrap();
        if p.phase != IncomingPhase::Postcopy || !p.postcopy_recover {
            return false;
        }
        drop(p);
        for s in streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        true
    }

    pub fn progress(&self) -> IncomingProgress {
        let mut p = self.progress.lock().unwrap().clone();
        p.pages_received = self.pages.load(Ordering::Relaxed);
        p.zero_pages_received = self.zero_pages.load(Ordering::Relaxed);
        p.bytes_received = self.bytes.load(Ordering::Relaxed);
        p.elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
        p
    }

    /// Changes the published progress; a phase entered is logged in the same moment.
    pub(crate) fn update(&self, f: impl FnOnce(&mut IncomingProgress)) {
        let mut p = self.progress.lock().unwrap();
        let before = p.phase;
        f(&mut p);
        if let Some(events) = self.events.as_ref().filter(|_| p.phase != before) {
            events.push(crate::events::EventKind::Destination {
                phase: p.phase,
                error: p.error.clone(),
            });
        }
    }

    /// Counts a connection that was dropped, with why.
    pub(crate) fn reject(&self, why: String) {
        tracing::warn!("dropped a connection: {why}");
        self.update(|p| {
            p.rejected_connections += 1;
            p.last_rejection = Some(why);
        });
    }

    /// Registers a connection of the migration under way for [`IncomingControl::cancel`]. A
    /// cancel that came first shuts it at once.
    /// Every such connection also notices a source that vanished without a word within
    /// about the peer timeout (TCP keepalive).
    pub(crate) fn register(&self, stream: &dyn Stream) {
        if let Err(e) = stream.set_keepalive(self.peer_timeout()) {
            tracing::warn!("cannot enable keepalive on {}: {e}", stream.peer());
        }
        if let Ok(s) = stream.try_clone_stream() {
            let mut streams = self.streams.lock().unwrap();
            if self.cancelled() {
                let _ = s.shutdown(Shutdown::Read);
            }
            streams.push(s);
        }
    }

    /// Forgets the connections of a migration that ended (the next source brings its own).
    pub(crate) fn unregister_all(&self) {
        self.streams.lock().unwrap().clear();
    }

    /// The VM is ready for the switchover: the acknowledger says StateReady.
    pub(crate) fn say_state_ready(&self) {
        self.state_ready.store(true, Ordering::Release);
    }

    /// Whether [`IncomingControl::say_state_ready`] was called in this migration.
    pub(crate) fn state_ready(&self) -> bool {
        self.state_ready.load(Ordering::Acquire)
    }

    /// A new migration starts: its devices have said nothing yet.
    pub(crate) fn forget_state_ready(&self) {
        self.state_ready.store(false, Ordering::Release);
    }

    pub(crate) fn add(&self, counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}
