//! The receiving side of a migration.
//!
//! - [`listen`] is what a VMM calls: it waits on a [`Listener`](crate::transport::Listener),
//!   screens every connection's hello on a thread of its own (garbage, silence, a second source
//!   or a stranger's data channel are dropped and counted, and the destination keeps
//!   listening), and hands a valid main connection to a [`Session`].
//! - [`Session`] is one migration, in phases: handshake (the main hello), channels (the
//!   announced data connections), precopy (pass ends on the main channel while receivers write
//!   pages), state and resume. From the main hello on, every byte is hostile and the first bad
//!   one ends the migration with the error that names it; the guest starts only after every
//!   mandatory section loaded.
//! - [`receive`] runs one session on a main connection the caller already accepted (tests, and
//!   VMMs that dispatch connections themselves).
//! - [`IncomingControl`] is the handle the API holds: progress, and cancel.
//! - `acker` (internal): the thread that tells the source how much arrived, when it asked.
//! - `arrival` (internal): what every connection starts with, below both the screening and
//!   the session: the hello read within its bound, [`Arrival`], [`Arrivals`], the time bounds.
//! - `order` (internal): the record order of the main channel (`next`) and of the data and
//!   preempt connections (`next_data`) as pure state machines, table-tested; the session and
//!   the receivers do what they say.
//! - `receiver` (internal): a data channel's receiver thread; `barrier` (internal), the
//!   per-pass barrier with its page-claim bitmap.
//! - `sink` (internal) is how precopy's pages land in memory: straight into mapped RAM or
//!   through the backing file, as the VMM's [`PageLanding`](crate::PageLanding) says.
//!   Postcopy's are installed atomically through userfaultfd by `postcopy` (internal), whose
//!   fault thread asks the source for the pages a vCPU waits on.

#![forbid(unsafe_code)]

mod acker;
mod arrival;
pub(crate) mod assemble;
mod barrier;
pub(crate) mod gate;
mod inflate;
mod listen;
mod order;
mod outbox;
pub(crate) mod postcopy;
mod progress;
mod receiver;
pub(crate) mod sections;
mod session;
pub(crate) mod sink;

use std::time::Instant;

pub use arrival::{Arrival, Arrivals, CHANNEL_TIMEOUT, HELLO_TIMEOUT, RECORD_TIMEOUT, read_hello};
pub use listen::listen;
pub use progress::{IncomingControl, IncomingPhase, IncomingProgress, Preparing};
pub use session::{PostcopyReceived, ReceiveStats, Session};

use crate::error::MigrateError;
use crate::transport::Stream;

/// Arrivals from a caller's accept function, each hello read here.
struct Accepted<'a, S> {
    accept: &'a mut dyn FnMut(Instant) -> std::io::Result<S>,
}

impl<S: Stream + 'static> Arrivals for Accepted<'_, S> {
    fn next(&mut self, deadline: Instant) -> Result<Option<Arrival>, MigrateError> {
        let mut stream: Box<dyn Stream> = match (self.accept)(deadline) {
            Ok(s) => Box::new(s),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(MigrateError::io("accepting a data channel", e)),
        };
        let hello = read_hello(stream.as_mut(), CHANNEL_TIMEOUT)?;
        Ok(Some(Arrival { stream, hello }))
    }

    fn close(&mut self) {}
}

/// Receives a migration whose main connection is `stream`; `accept(deadline)` yields the data
/// connections (an error of kind `TimedOut` or `WouldBlock` once the deadline passed). On
/// success the guest runs; on error nothing runs and the caller discards the VM.
pub fn receive<S: Stream + 'static>(
    vm: &mut dyn crate::vm::DestinationVm,
    stream: S,
    accept: &mut dyn FnMut(Instant) -> std::io::Result<S>,
) -> Result<ReceiveStats, MigrateError> {
    receive_with(vm, stream, accept, std::sync::Arc::default())
}

/// [`receive`] under `control`: watch its progress, cancel it, pause or recover its postcopy.
pub fn receive_with<S: Stream + 'static>(
    vm: &mut dyn crate::vm::DestinationVm,
    stream: S,
    accept: &mut dyn FnMut(Instant) -> std::io::Result<S>,
    control: std::sync::Arc<IncomingControl>,
) -> Result<ReceiveStats, MigrateError> {
    let mut stream: Box<dyn Stream> = Box::new(stream);
    let hello = match read_hello(stream.as_mut(), RECORD_TIMEOUT) {
        Ok(h) => h,
        Err(e) => {
            if let Ok(mut conn) = crate::conn::Conn::new(stream) {
                conn.send_error(&format!("destination: {e}"));
            }
            return Err(e);
        }
    };
    let session = Session::new(vm, Arrival { stream, hello }, control)?;
    let session = session.handshake()?;
    session.run(&mut Accepted { accept })
}
