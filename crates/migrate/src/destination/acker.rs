//! Progress acknowledgements: while pages arrive, tell the source how much this side has taken
//! in, so that it predicts the switchover's downtime from what is still in flight rather than
//! from what it wrote into its socket buffers (`docs/protocol.md`, "Received").
//!
//! An [`Acker`] is a thread of its own that wakes every [`ACK_INTERVAL`], reads the counters the
//! receivers and the session already keep in [`IncomingControl`], and writes one `Received`
//! record on the main connection when they moved. The receivers never wait for it: they only
//! add to atomics, so a source that stops reading can block this thread, never the receive
//! path.
//!
//! Invariants:
//! - **One writer at a time on the main connection.** The session writes its hello reply before
//!   it starts the acker and writes Error or Resumed only after [`Acker::stop`] returned (the
//!   thread has been joined), so records never interleave.
//! - **Bounded.** Every write has [`ACK_WRITE_TIMEOUT`]; a write that does not complete ends
//!   the thread with an error, which ends the migration at the session's next step (a source
//!   that asked for progress must read it). Nothing is buffered: the thread holds one record.

#![forbid(unsafe_code)]

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use super::IncomingControl;
use crate::error::{Internal, MigrateError};
use crate::transport::Stream;
use crate::wire::{HEADER_SIZE, Header, Kind, RECEIVED_SIZE, Received};

/// How often the destination acknowledges, at most: 100 records of 32 bytes a second is
/// nothing on the return path, and the source learns of the destination's progress within
/// 10 ms, which at this machine's ~1.3 GB/s of landing pages is ~13 MB, well inside any
/// downtime limit (a stale acknowledgement only makes the source wait a little longer before
/// it pauses the guest, never pause it earlier). An idle interval sends nothing: a record is
/// written only when the counters moved, so the last bytes of a pass are acknowledged within
/// one interval of their arrival however few they are.
pub const ACK_INTERVAL: Duration = Duration::from_millis(10);
/// How long one acknowledgement may wait for room in the socket: a source that reads its main
/// connection drains 32 bytes at once, so only a source that stopped reading (with the
/// destination's send buffer and its own receive buffer full, thousands of records) reaches
/// it.
pub const ACK_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The acknowledging thread of one migration.
#[derive(Debug)]
pub struct Acker {
    stop: SyncSender<()>,
    thread: JoinHandle<Result<(), MigrateError>>,
}

impl Acker {
    /// Starts acknowledging on a second handle to the main connection `main`.
    pub fn start(main: &dyn Stream, control: Arc<IncomingControl>) -> Result<Acker, MigrateError> {
        let io = |e| MigrateError::io("starting progress acknowledgements", e);
        let stream = main.try_clone_stream().map_err(io)?;
        stream
            .set_write_timeout(Some(ACK_WRITE_TIMEOUT))
            .map_err(io)?;
        let (stop, stopped) = sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("acks".into())
            .spawn(move || run(stream, &control, &stopped))
            .map_err(io)?;
        Ok(Acker { stop, thread })
    }

    /// Stops the thread and says how its writes went. When this returns, the main
    /// connection's write side is the session's again.
    pub fn stop(self) -> Result<(), MigrateError> {
        // The thread may have ended on a failed write already; then nobody receives this.
        let _ = self.stop.try_send(());
        self.thread.join().map_err(|_| {
            MigrateError::from(Internal::Panicked {
                thread: "the progress acknowledgement thread",
            })
        })?
    }
}

/// Acknowledges every [`ACK_INTERVAL`] in which the counters moved, until told to stop.
fn run(
    mut stream: Box<dyn Stream>,
    control: &IncomingControl,
    stop: &Receiver<()>,
) -> Result<(), MigrateError> {
    let mut last = Received::default();
    let mut ready_said = false;
    loop {
        match stop.recv_timeout(ACK_INTERVAL) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
        }
        if !ready_said && control.state_ready() {
            let header = Header::new(Kind::StateReady, 0, 0).seal(&[]);
            stream
                .write_all(&header.encode())
                .map_err(|e| MigrateError::io("telling the source its state is ready", e))?;
            ready_said = true;
        }
        let now = taken_in(control);
        if now == last {
            continue;
        }
        let payload = now.encode();
        let header = Header::new(Kind::Received, 0, RECEIVED_SIZE).seal(&payload);
        let mut record = [0u8; HEADER_SIZE + RECEIVED_SIZE as usize];
        record[..HEADER_SIZE].copy_from_slice(&header.encode());
        record[HEADER_SIZE..].copy_from_slice(&payload);
        stream
            .write_all(&record)
            .map_err(|e| MigrateError::io("acknowledging progress to the source", e))?;
        last = now;
    }
}

/// What the destination has taken in: record bytes read on every connection (a receiver counts
/// a record once its header is validated, so this leads the pages landed by at most one record
/// per channel) and pages written or zeroed.
fn taken_in(control: &IncomingControl) -> Received {
    Received {
        bytes: control.bytes.load(Ordering::Relaxed),
        pages: control.pages.load(Ordering::Relaxed) + control.zero_pages.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::time::Instant;

    use super::*;
    use crate::wire::{HEADER_SIZE, Header};

    #[test]
    fn acknowledges_when_the_counters_move_and_only_then() {
        let (ours, mut source) = UnixStream::pair().unwrap();
        let control = Arc::new(IncomingControl::default());
        control.add(&control.bytes, 4104 * 3 + 16);
        control.add(&control.pages, 3);
        let acker = Acker::start(&ours, control.clone()).unwrap();
        let mut record = [0u8; HEADER_SIZE + RECEIVED_SIZE as usize];
        source.read_exact(&mut record).unwrap();
        let h = Header::decode(record[..HEADER_SIZE].try_into().unwrap()).unwrap();
        assert_eq!(
            h,
            Header::new(Kind::Received, 0, RECEIVED_SIZE).seal(&record[HEADER_SIZE..])
        );
        assert_eq!(
            Received::decode(&record[HEADER_SIZE..]).unwrap(),
            Received {
                bytes: 4104 * 3 + 16,
                pages: 3
            }
        );
        // Nothing moved: nothing is sent.
        source.set_read_timeout(Some(ACK_INTERVAL * 5)).unwrap();
        assert!(
            source.read(&mut record).is_err(),
            "an idle interval sent a record"
        );
        control.add(&control.zero_pages, 10);
        source.set_read_timeout(None).unwrap();
        source.read_exact(&mut record).unwrap();
        assert_eq!(Received::decode(&record[HEADER_SIZE..]).unwrap().pages, 13);
        acker.stop().unwrap();
    }

    /// A source that never reads: the acker's writes fill the socket, time out, and the thread
    /// ends with an error instead of holding the session (the receivers never wait for it).
    #[test]
    fn a_source_that_never_reads_cannot_hold_the_destination() {
        let (ours, _deaf) = UnixStream::pair().unwrap();
        let control = Arc::new(IncomingControl::default());
        // Fill the socket so that the next write blocks.
        let mut filler = ours.try_clone().unwrap();
        filler.set_nonblocking(true).unwrap();
        while filler.write(&[0u8; 4096]).is_ok() {}
        filler.set_nonblocking(false).unwrap();
        control.add(&control.bytes, 1);
        let acker = Acker::start(&ours, control.clone()).unwrap();
        // Shorten the wait for the test: the timeout is a property of the socket.
        ours.set_write_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let t = Instant::now();
        while !acker.thread.is_finished() {
            assert!(t.elapsed() < Duration::from_secs(5), "the acker is stuck");
            std::thread::sleep(Duration::from_millis(5));
        }
        let e = acker.stop().unwrap_err();
        assert!(e.to_string().contains("acknowledging progress"), "{e}");
    }
}
