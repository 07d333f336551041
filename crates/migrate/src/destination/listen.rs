//! Waiting for a source: every connection is screened on a thread of its own before anything
//! of the destination's is touched. Until a source has completed a valid main hello, a
//! connection that sends garbage, says nothing for [`HELLO_TIMEOUT`], or is not a main
//! connection is dropped with a logged reason (counted in the progress) and the destination
//! keeps listening. While a migration is under way, a second source and a data connection
//! naming another migration are refused with a reply hello that says why, and the migration
//! does not notice. What does reach the session is judged by the protocol's rules.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{
    Arrival, Arrivals, HELLO_TIMEOUT, IncomingControl, IncomingPhase, ReceiveStats, Session,
    read_hello,
};
use crate::error::MigrateError;
use crate::transport::{Listener, Stream};
use crate::vm::DestinationVm;
use crate::wire::{self, Hello, MAX_CHANNELS, Refusal, Role};

/// Connections whose hello is being read at once. A source needs 1 + its channels (at most
/// 65); beyond this, a flood of silent connections is dropped at once instead of holding a
/// thread each for [`HELLO_TIMEOUT`].
const MAX_PENDING_HELLOS: usize = 2 * MAX_CHANNELS as usize + 1;
/// How often the waiting loop looks at cancellation and the caller's `keep_waiting`.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Who may come in now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// No migration: the next valid main hello starts one.
    Open,
    /// A main hello is being judged or its migration runs; data connections with its uuid
    /// belong to it while `data` is true.
    Busy { uuid: [u8; 16], data: bool },
    /// The migration ended; whoever comes now is turned away.
    Closed,
}

/// What the screening threads share.
#[derive(Debug)]
struct Screen {
    gate: Mutex<Gate>,
    control: Arc<IncomingControl>,
    main: SyncSender<Arrival>,
    data: SyncSender<Arrival>,
    pending: AtomicUsize,
}

impl Screen {
    /// Decides where a connection that sent `hello` goes.
    fn route(&self, mut stream: Box<dyn Stream>, hello: Hello) {
        let peer = stream.peer();
        let mut gate = self.gate.lock().unwrap();
        let refusal = match (*gate, hello.role) {
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
    if screen.pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_HELLOS {
        screen.pending.fetch_sub(1, Ordering::AcqRel);
        screen.control.reject(format!(
            "{peer}: more than {MAX_PENDING_HELLOS} connections are waiting to say hello"
        ));
        return;
    }
    let s = screen.clone();
    let spawned = std::thread::Builder::new()
        .name("hello".into())
        .spawn(move || {
            match read_hello(stream.as_mut(), HELLO_TIMEOUT) {
                Ok(hello) => s.route(stream, hello),
                Err(e) => s.control.reject(format!("{peer}: {e}")),
            }
            s.pending.fetch_sub(1, Ordering::AcqRel);
        });
    if let Err(e) = spawned {
        screen.pending.fetch_sub(1, Ordering::AcqRel);
        screen
            .control
            .reject(format!("cannot start a thread to read a hello: {e}"));
    }
}

/// The data connections the screen let through to the session.
struct Screened<'a> {
    rx: &'a Receiver<Arrival>,
    screen: &'a Screen,
    uuid: [u8; 16],
}

impl Arrivals for Screened<'_> {
    fn next(&mut self, deadline: Instant) -> Result<Option<Arrival>, MigrateError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(wait) {
            Ok(a) => Ok(Some(a)),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => Ok(None),
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
    let (main_tx, main_rx) = sync_channel(1);
    let (data_tx, data_rx) = sync_channel(usize::from(MAX_CHANNELS));
    let screen = Arc::new(Screen {
        gate: Mutex::new(Gate::Open),
        control: control.clone(),
        main: main_tx,
        data: data_tx,
        pending: AtomicUsize::new(0),
    });
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let accepting = std::thread::Builder::new()
            .name("accept".into())
            .spawn_scoped(scope, || {
                while !stop.load(Ordering::Acquire) {
                    match listener.accept_within(WAIT_SLICE) {
                        Ok(Some(stream)) => screen_hello(&screen, stream),
                        Ok(None) => {}
                        Err(e) => {
                            control.reject(format!("accepting a connection failed: {e}"));
                            std::thread::sleep(WAIT_SLICE);
                        }
                    }
                }
            })
            .map_err(|e| MigrateError::io("starting the accept thread", e))?;
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
        match Session::new(vm, arrival, control.clone())?.handshake() {
            Ok(session) => {
                let mut arrivals = Screened {
                    rx: data_rx,
                    screen,
                    uuid,
                };
                return session.run(&mut arrivals);
            }
            Err(e) => {
                // Not a valid hello: this source is refused (its reply says why) and the
                // destination keeps waiting for one that fits.
                control.reject(format!("{peer}: {e}"));
                while data_rx.try_recv().is_ok() {}
                control.update(|p| {
                    p.phase = IncomingPhase::Waiting;
                    p.source = None;
                    p.channels_announced = 0;
                });
                screen.set(Gate::Open);
            }
        }
    }
}
