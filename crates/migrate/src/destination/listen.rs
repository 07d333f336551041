//! Waiting for a source: every connection is screened on a thread of its own before anything
//! of the destination's is touched. Until a source has completed a valid main hello, a
//! connection that sends garbage, has not sent its whole hello (a TLS handshake included)
//! [`HELLO_TIMEOUT`] after it was accepted, or is not a main connection is dropped with a
//! logged reason (counted in the progress) and the destination keeps listening. While a
//! migration is under way, a second source and a data connection naming another migration are
//! refused with a reply hello that says why, and the migration does not notice. What does
//! reach the session is judged by the protocol's rules.
//!
//! A postcopy recovery listener is screened the same way ([`Screening`], [`Gate::Recovery`]):
//! only this migration's Resume reaches the paused session, then its channels; whatever else
//! comes is dropped and counted, and the guest waits on unharmed.
//!
//! At most [`MAX_PENDING_HELLOS`] connections are at their hello at once; a newcomer beyond
//! that evicts the one that has been at it longest, so a flood of slow talkers cannot keep a
//! source out: a real source says its hello at once.

#![forbid(unsafe_code)]

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::arrival::{Arrival, Arrivals, HELLO_TIMEOUT, read_hello};
use super::progress::{IncomingControl, IncomingPhase};
use super::session::{ReceiveStats, Session};
use crate::error::MigrateError;
use crate::transport::{Listener, Stream};
use crate::vm::DestinationVm;
use crate::wire::{self, Hello, MAX_CHANNELS, Refusal, Role};

/// Connections whose hello is being read at once. A source needs 1 + its channels (at most
/// 65); beyond this, a newcomer evicts the connection that has been at its hello longest.
const MAX_PENDING_HELLOS: usize = 2 * MAX_CHANNELS as usize + 1;
/// How often the waiting loop looks at cancellation and the caller's `keep_waiting`.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Who may come in now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// No migration: the next valid main hello starts one.
    Open,
    /// A paused postcopy migration waits for its source's recovery: the next Resume hello
    /// with this uuid goes to the session.
    Recovery { uuid: [u8; 16] },
    /// A main hello is being judged or its migration runs; data connections with its uuid
    /// belong to it while `data` is true.
    Busy { uuid: [u8; 16], data: bool },
    /// The migration ended; whoever comes now is turned away.
    Closed,
}

/// A connection at its hello: a handle to cut it, and when it was accepted.
#[derive(Debug)]
struct Pending {
    id: u64,
    since: Instant,
    stream: Box<dyn Stream>,
    peer: String,
}

/// What the screening threads share.
#[derive(Debug)]
struct Screen {
    gate: Mutex<Gate>,
    control: Arc<IncomingControl>,
    main: SyncSender<Arrival>,
    data: SyncSender<Arrival>,
    pending: Mutex<Vec<Pending>>,
    next_id: AtomicU64,
}

impl Screen {
    fn new(
        gate: Gate,
        control: Arc<IncomingControl>,
    ) -> (Arc<Self>, Receiver<Arrival>, Receiver<Arrival>) {
        let (main, main_rx) = sync_channel(1);
        let (data, data_rx) = sync_channel(usize::from(MAX_CHANNELS) + 1);
        let screen = Arc::new(Self {
            gate: Mutex::new(gate),
            control,
            main,
            data,
            pending: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
        });
        (screen, main_rx, data_rx)
    }

    /// Registers a connection that starts its hello; when [`MAX_PENDING_HELLOS`] are at theirs
    /// already, the one that has been at it longest is cut (its reader sees the cut and drops
    /// it, counted).
    fn admit(&self, stream: &dyn Stream) -> std::io::Result<u64> {
        let handle = stream.try_clone_stream()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut pending = self.pending.lock().unwrap();
        if pending.len() >= MAX_PENDING_HELLOS {
            let oldest = pending
                .iter()
                .enumerate()
                .min_by_key(|(_, p)| p.since)
                .map(|(i, _)| i)
                .expect("the list is full");
            let evicted = pending.swap_remove(oldest);
            let _ = evicted.stream.shutdown(Shutdown::Both);
            tracing::debug!(
                "{}: evicted: {MAX_PENDING_HELLOS} connections were at their hello",
                evicted.peer
            );
        }
        pending.push(Pending {
            id,
            since: Instant::now(),
            peer: stream.peer(),
            stream: handle,
        });
        Ok(id)
    }

    /// The hello of connection `id` was read (or failed): no longer watched.
    fn done(&self, id: u64) {
        self.pending.lock().unwrap().retain(|p| p.id != id);
    }

    /// Cuts every connection that has not said its whole hello within [`HELLO_TIMEOUT`] of its
    /// accept, however it trickled its bytes; its reader drops it, counted.
    fn cut_late(&self) {
        let now = Instant::now();
        self.pending.lock().unwrap().retain(|p| {
            let late = now.duration_since(p.since) >= HELLO_TIMEOUT;
            if late {
                let _ = p.stream.shutdown(Shutdown::Both);
            }
            !late
        });
    }

    /// Decides where a connection that sent `hello` goes.
    fn route(&self, mut stream: Box<dyn Stream>, hello: Hello) {
        let peer = stream.peer();
        let mut gate = self.gate.lock().unwrap();
        let refusal = match (*gate, hello.role) {
            (Gate::Recovery { uuid }, Role::Resume) if uuid == hello.uuid => {
                *gate = Gate::Busy { uuid, data: true };
                drop(gate);
                // The session answers; it reopens the gate if the recovery fails.
                let _ = self.main.send(Arrival { stream, hello });
                return;
            }
            (Gate::Recovery { .. }, Role::Resume) => (
                Refusal::UnknownMigration,
                "a recovery for another migration",
            ),
            (Gate::Recovery { .. }, _) => (
                Refusal::Role,
                "a connection other than the source's recovery while a postcopy migration is paused",
            ),
            (Gate::Open, Role::Main) => {
                *gate = Gate::Busy {
                    uuid: hello.uuid,
                    data: true,
                };
                drop(gate);
                // The session judges the rest of the hello; the waiting loop reopens the
                // gate if it refuses.
                let _ = self.main.send(Arrival { stream, hello });
                return;
            }
            (Gate::Busy { uuid, data: true }, Role::Data | Role::Preempt) if uuid == hello.uuid => {
                drop(gate);
                let _ = self.data.send(Arrival { stream, hello });
                return;
            }
            (Gate::Open, _) => (
                Refusal::Role,
                "a data connection while no migration is under way (the main connection comes first)",
            ),
            (Gate::Busy { .. }, Role::Resume) => {
                (Refusal::Busy, "a second recovery while one is under way")
            }
            (Gate::Busy { .. }, Role::Main) => (
                Refusal::Busy,
                "a second source while a migration is under way",
            ),
            (Gate::Busy { uuid, .. }, Role::Data | Role::Preempt) if uuid == hello.uuid => (
                Refusal::ChannelId,
                "a data connection after every announced channel connected",
            ),
            (Gate::Busy { .. }, _) => (
                Refusal::UnknownMigration,
                "a data connection for a migration that is not under way",
            ),
            (Gate::Closed, _) => (Refusal::Busy, "a connection after the migration ended"),
        };
        drop(gate);
        // Counted before the reply, so that a peer that reads its refusal finds it counted.
        self.control.reject(format!("{peer}: {}", refusal.1));
        let reply = Hello {
            status: refusal.0 as u32,
            capabilities: wire::Capabilities::NONE,
            postcopy_page_shift: 0,
            ..hello
        };
        let _ = std::io::Write::write_all(&mut stream, &reply.encode());
    }

    fn set(&self, gate: Gate) {
        *self.gate.lock().unwrap() = gate;
    }
}

/// Reads a connection's hello on a thread of its own and routes it.
fn screen_hello(screen: &Arc<Screen>, mut stream: Box<dyn Stream>) {
    let peer = stream.peer();
    let id = match screen.admit(stream.as_ref()) {
        Ok(id) => id,
        Err(e) => {
            screen.control.reject(format!("{peer}: {e}"));
            return;
        }
    };
    let s = screen.clone();
    let spawned = std::thread::Builder::new()
        .name("hello".into())
        .spawn(move || {
            let hello = read_hello(stream.as_mut(), HELLO_TIMEOUT);
            s.done(id);
            match hello {
                Ok(hello) => s.route(stream, hello),
                Err(e) => s.control.reject(format!(
                    "{peer}: {e} (a hello must be whole within {HELLO_TIMEOUT:?} of the accept)"
                )),
            }
        });
    if let Err(e) = spawned {
        screen.done(id);
        screen
            .control
            .reject(format!("cannot start a thread to read a hello: {e}"));
    }
}

/// Accepts on `listener` until `stop`, screening each connection, and cuts hellos that are
/// late.
fn accept_loop(listener: &dyn Listener, screen: &Arc<Screen>, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        screen.cut_late();
        match listener.accept_within(WAIT_SLICE) {
            Ok(Some(stream)) => screen_hello(screen, stream),
            Ok(None) => {}
            Err(e) => {
                screen
                    .control
                    .reject(format!("accepting a connection failed: {e}"));
                std::thread::sleep(WAIT_SLICE);
            }
        }
    }
}

/// Starts [`accept_loop`] on a thread of `scope`.
fn spawn_accept<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    listener: &'scope dyn Listener,
    screen: Arc<Screen>,
    stop: &'scope AtomicBool,
) -> Result<std::thread::ScopedJoinHandle<'scope, ()>, MigrateError> {
    std::thread::Builder::new()
        .name("accept".into())
        .spawn_scoped(scope, move || accept_loop(listener, &screen, stop))
        .map_err(|e| MigrateError::io("starting the accept thread", e))
}

/// A listener screened on a thread of its own while a paused postcopy session waits for its
/// recovery: [`Screening::next_resume`] yields this migration's Resume connections, and
/// [`Screening::channels`] the data connections that follow one. Dropping it stops the
/// screening (connections then wait in the listener's backlog).
pub(crate) struct Screening<'scope> {
    screen: Arc<Screen>,
    main_rx: Receiver<Arrival>,
    data_rx: Receiver<Arrival>,
    stop: &'scope AtomicBool,
}

impl<'scope> Screening<'scope> {
    /// Screens `listener` for the recovery of migration `uuid` on a thread of `scope`.
    pub(crate) fn recovery<'env>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        listener: &'scope dyn Listener,
        control: Arc<IncomingControl>,
        uuid: [u8; 16],
        stop: &'scope AtomicBool,
    ) -> Result<Self, MigrateError> {
        let (screen, main_rx, data_rx) = Screen::new(Gate::Recovery { uuid }, control);
        spawn_accept(scope, listener, screen.clone(), stop)?;
        Ok(Self {
            screen,
            main_rx,
            data_rx,
            stop,
        })
    }

    /// The next Resume connection of this migration, if one came within `wait`.
    pub(crate) fn next_resume(&self, wait: Duration) -> Option<Arrival> {
        self.main_rx.recv_timeout(wait).ok()
    }

    /// The data connections of the recovery whose main connection is `main`: its channels'
    /// wait ends at once if the source hangs up `main` (its recovery failed).
    pub(crate) fn channels(&self, uuid: [u8; 16], main: Box<dyn Stream>) -> Screened<'_> {
        Screened {
            rx: &self.data_rx,
            screen: &self.screen,
            uuid,
            main: Some(main),
        }
    }

    /// A recovery failed: the next Resume may come in; data connections left from the failed
    /// one are dropped.
    pub(crate) fn reopen(&self, uuid: [u8; 16]) {
        self.screen.set(Gate::Recovery { uuid });
        while self.data_rx.try_recv().is_ok() {}
    }
}

impl Drop for Screening<'_> {
    fn drop(&mut self) {
        self.screen.set(Gate::Closed);
        self.stop.store(true, Ordering::Release);
    }
}

/// The data connections the screen let through to the session.
pub(crate) struct Screened<'a> {
    rx: &'a Receiver<Arrival>,
    screen: &'a Screen,
    uuid: [u8; 16],
    /// A recovery's main connection: the wait ends when the source hangs it up.
    main: Option<Box<dyn Stream>>,
}

impl Arrivals for Screened<'_> {
    fn next(&mut self, deadline: Instant) -> Result<Option<Arrival>, MigrateError> {
        loop {
            if self.main.as_ref().is_some_and(|m| m.hung_up()) {
                return Err(MigrateError::io(
                    "waiting for the recovery's channels",
                    std::io::Error::from(std::io::ErrorKind::ConnectionAborted),
                ));
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(WAIT_SLICE);
            match self.rx.recv_timeout(wait) {
                Ok(a) => return Ok(Some(a)),
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    return Ok(None);
                }
            }
        }
    }

    fn close(&mut self) {
        self.screen.set(Gate::Busy {
            uuid: self.uuid,
            data: false,
        });
    }
}

/// Waits on `listener` for a source and receives its migration into `vm`. Returns when a
/// migration completed (the guest runs), when one failed after its main hello was accepted
/// (nothing runs), when `control` is cancelled, or when `keep_waiting` says to stop waiting
/// before any source came.
pub fn listen(
    vm: &mut dyn DestinationVm,
    listener: &dyn Listener,
    control: &Arc<IncomingControl>,
    keep_waiting: &dyn Fn() -> bool,
) -> Result<ReceiveStats, MigrateError> {
    control.update(|p| {
        p.phase = IncomingPhase::Waiting;
        p.preparing = None;
        p.listening_on = listener.local();
    });
    let (screen, main_rx, data_rx) = Screen::new(Gate::Open, control.clone());
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let accepting = spawn_accept(scope, listener, screen.clone(), &stop)?;
        let result = wait_and_receive(vm, control, keep_waiting, &screen, &main_rx, &data_rx);
        screen.set(Gate::Closed);
        stop.store(true, Ordering::Release);
        let _ = accepting.join();
        result
    })
}

fn wait_and_receive(
    vm: &mut dyn DestinationVm,
    control: &Arc<IncomingControl>,
    keep_waiting: &dyn Fn() -> bool,
    screen: &Screen,
    main_rx: &Receiver<Arrival>,
    data_rx: &Receiver<Arrival>,
) -> Result<ReceiveStats, MigrateError> {
    loop {
        if control.cancelled() {
            control.update(|p| p.phase = IncomingPhase::Cancelled);
            return Err(MigrateError::CancelledHere);
        }
        if !keep_waiting() {
            return Err(MigrateError::Io {
                during: "waiting for the source to connect",
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "gave up waiting for a source",
                ),
            });
        }
        let arrival = match main_rx.recv_timeout(WAIT_SLICE) {
            Ok(a) => a,
            Err(_) => continue,
        };
        let uuid = arrival.hello.uuid;
        let peer = arrival.stream.peer();
        let reopened = std::cell::Cell::new(false);
        let reopen = || {
            while data_rx.try_recv().is_ok() {}
            control.update(|p| {
                p.phase = IncomingPhase::Waiting;
                p.source = None;
                p.channels_announced = 0;
            });
            screen.set(Gate::Open);
            reopened.set(true);
        };
        match Session::new(vm, arrival, control.clone())?.handshake_then(reopen) {
            Ok(session) => {
                let mut arrivals = Screened {
                    rx: data_rx,
                    screen,
                    uuid,
                    main: None,
                };
                return session.run(&mut arrivals);
            }
            Err(e) => {
                // Not a valid hello: this source is refused (its reply says why) and the
                // destination waits for one that fits. A refusal reopened before its reply
                // (the next source may already be through the gate); a failure before the
                // judgment reopens here.
                control.reject(format!("{peer}: {e}"));
                if !reopened.get() {
                    reopen();
                }
            }
        }
    }
}
