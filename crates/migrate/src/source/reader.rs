//! What comes back from the destination on the main connection, read as typed values by a
//! thread of its own while the session sends.
//!
//! The destination sends these records there: `Received` (only when the progress capability
//! was granted) as pages arrive, `Resumed` once the guest runs on its side, `Error` when it
//! gives up, with postcopy granted `PageRequest` (pages a vCPU waits for) and `Done` (every
//! page is in place), and with iterative state granted one `StateReady` (its devices are ready
//! for the switchover; folded into a flag, as `Received` into counters). [`Inbound`] has a
//! variant for each; anything else is a protocol violation and an error naming what was
//! expected.
//!
//! [`InboundReader`] is the thread. It folds every `Received` into the latest acknowledged
//! figures (only the newest matters, so they are two counters the session reads, not a queue
//! that could fill while the session is busy sending), queues page requests for the session to
//! take (bounded: [`MAX_QUEUED_REQUESTS`]), and hands the records that end a phase over a
//! channel: `Resumed` (which ends the reading unless postcopy was granted: then `Done` follows),
//! `Done`, `Error`, or the failure that stopped it.
//!
//! Invariants: a record's header is validated (kind and length, see `wire/`) before its
//! payload is read, so every payload decoded here has the size its kind prescribes; the
//! acknowledged byte count never goes backwards (a destination that says so is refused); once
//! the reader runs, nothing else reads the main connection.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::agreement::Agreement;
use super::forward::{Lane, Requested};
use super::wakeup::Wakeup;
use crate::conn::Conn;
use crate::error::{Bound, MigrateError, ProtocolError, Rule};
use crate::transport::Stream;
use crate::wire::{self, Kind, Latencies, Received, ResumedRecord};

/// Page request runs the reader holds for the session: 16 MiB of runs. A destination asks for
/// a page once, when a vCPU first faults on it, so a queue this long means it asks for
/// everything at once or asks again and again; either is refused.
pub const MAX_QUEUED_REQUESTS: usize = 1 << 20;

/// A record from the destination on the main connection.
#[derive(Clone, Debug, PartialEq)]
pub enum Inbound {
    /// The destination loaded the state and runs the guest.
    Resumed(ResumedRecord),
    /// The destination gave up, and says why.
    Error(String),
    /// What the destination has taken in so far (progress capability only).
    Received(Received),
    /// Runs `(gpa, pages)` a vCPU on the destination waits for (postcopy only).
    PageRequest(Vec<(u64, u64)>),
    /// Every page is in place on the destination, with its request latencies (postcopy only).
    Done(Box<Latencies>),
    /// The destination's devices with iterative state are ready for the switchover
    /// (iterative state only; folded by the reader, never an ending).
    StateReady,
}

impl Inbound {
    /// The kind of record it came in.
    pub fn kind(&self) -> Kind {
        match self {
            Inbound::Resumed(_) => Kind::Resumed,
            Inbound::Error(_) => Kind::Error,
            Inbound::Received(_) => Kind::Received,
            Inbound::PageRequest(_) => Kind::PageRequest,
            Inbound::Done(_) => Kind::Done,
            Inbound::StateReady => Kind::StateReady,
        }
    }
}

/// What the session is waiting for, for its errors: `during` names the wait when the
/// connection fails, `expected` the records it accepts when another one comes.
#[derive(Clone, Copy, Debug)]
pub struct Awaiting {
    pub during: &'static str,
    pub expected: &'static str,
}

/// Reads the next record from the destination.
pub fn read(conn: &mut Conn, awaiting: Awaiting) -> Result<Inbound, MigrateError> {
    let h = conn.read_header(awaiting.during)?;
    let payload = conn.read_payload(&h, "reading the destination's answer")?;
    match h.kind {
        Kind::Resumed => Ok(Inbound::Resumed(ResumedRecord::decode(h.count, &payload)?)),
        Kind::Error => Ok(Inbound::Error(
            String::from_utf8_lossy(&payload).into_owned(),
        )),
        Kind::Received => Ok(Inbound::Received(Received::decode(&payload)?)),
        Kind::PageRequest => {
            let w: Vec<u64> = wire::decode_addresses(&payload).collect();
            Ok(Inbound::PageRequest(
                w.chunks_exact(2).map(|r| (r[0], r[1])).collect(),
            ))
        }
        Kind::Done => Ok(Inbound::Done(Box::new(Latencies::decode(&payload)?))),
        Kind::StateReady => Ok(Inbound::StateReady),
        k => Err(MigrateError::misplaced(
            k,
            Rule::Awaiting(awaiting.expected),
        )),
    }
}

/// What the reader thread reads while the migration runs.
const AWAITING_ANY: Awaiting = Awaiting {
    during: "reading the destination's records",
    expected: "Received, StateReady, Resumed or Error",
};

/// Where the connection the reader reads stands in the migration. What the destination may
/// send on it is what was agreed ([`Agreement`]: Received records with progress; PageRequest
/// and Done, and reading on after Resumed, with postcopy) and where it opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opening {
    /// The migration's main connection, after the handshake: Resumed comes once.
    Handshake,
    /// A postcopy recovery's connection: the guest runs on the destination already, so no
    /// Resumed comes, Done may, and page requests are in order from the first byte (the
    /// destination asks again for what it was waiting for as soon as it sent Resume). Nor
    /// does a Received: the destination acknowledges nothing once the guest runs there.
    Recovery,
}

/// The record that ended the reader's reading, or why it stopped.
pub type Ending = Result<Inbound, MigrateError>;

/// The thread that reads the main connection from the handshake to the end of the migration.
#[derive(Debug)]
pub struct InboundReader {
    acked_bytes: Arc<AtomicU64>,
    acked_pages: Arc<AtomicU64>,
    state_ready: Arc<AtomicBool>,
    requests: Arc<Requests>,
    ending: Receiver<Ending>,
    /// A handle to shut the read side with, so that the thread's blocked read returns.
    stream: Box<dyn Stream>,
    thread: Option<JoinHandle<()>>,
}

impl InboundReader {
    /// Takes over the reading of `conn` (and what it has buffered); `agreed` and `opening` say
    /// which optional records the destination may send.
    pub fn start(
        conn: &mut Conn,
        agreed: Agreement,
        opening: Opening,
    ) -> Result<InboundReader, MigrateError> {
        let io = |e| MigrateError::io("starting the reader of the main connection", e);
        let mut reader = conn.split_reader().map_err(io)?;
        let stream = conn.stream().try_clone_stream().map_err(io)?;
        let acked_bytes = Arc::new(AtomicU64::new(0));
        let acked_pages = Arc::new(AtomicU64::new(0));
        let state_ready = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(Requests::default());
        if opening == Opening::Recovery {
            // Before the thread reads anything: a request may be the first record it reads.
            requests.allowed.store(true, Ordering::Release);
        }
        // Depth two: a Resumed that does not end the reading, then the ending; each is sent
        // once, so a send never blocks (nobody may be listening any more).
        let (tx, ending) = sync_channel(2);
        let into = Into {
            bytes: acked_bytes.clone(),
            pages: acked_pages.clone(),
            ready: state_ready.clone(),
            requests: requests.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("main-reader".into())
            .spawn(move || {
                let end = read_until_end(&mut reader, agreed, opening, &into, &|resumed| {
                    let _ = tx.try_send(Ok(resumed));
                });
                let _ = tx.try_send(end);
            })
            .map_err(io)?;
        Ok(InboundReader {
            acked_bytes,
            acked_pages,
            state_ready,
            requests,
            ending,
            stream,
            thread: Some(thread),
        })
    }

    /// The latest acknowledgement (zero before the first).
    pub fn acked(&self) -> Received {
        Received {
            bytes: self.acked_bytes.load(Ordering::Acquire),
            pages: self.acked_pages.load(Ordering::Relaxed),
        }
    }

    /// Whether the destination said its devices are ready for the switchover (StateReady).
    pub fn state_ready(&self) -> bool {
        self.state_ready.load(Ordering::Acquire)
    }

    /// Takes the page requests that arrived since the last call, oldest first, and when the
    /// oldest of them was read.
    pub(crate) fn take_requests(&self) -> (Vec<Requested>, Option<Instant>) {
        let mut q = self.requests.queue.lock().unwrap();
        (q.0.drain(..).collect(), q.1.take())
    }

    /// From now on the reader queues requested pages on `lane` itself (`forward.rs`).
    pub(crate) fn set_lane(&self, lane: Lane) {
        *self.requests.lane.lock().unwrap() = Some(lane);
    }

    /// From now on the reader also rings `wakeup` for every request it queues (the postcopy
    /// push waits on it for a request or room in a channel's queue, `wakeup.rs`).
    pub(crate) fn ring_on_requests(&self, wakeup: Wakeup) {
        *self.requests.wakeup.lock().unwrap() = Some(wakeup);
    }

    /// From now on the reader leaves every request to the migration thread.
    pub(crate) fn clear_lane(&self) {
        *self.requests.lane.lock().unwrap() = None;
    }

    /// From now on page requests are in order: the source sent Postcopy, and the destination
    /// may fault (while it loads the device state, too) before it resumes the guest.
    pub fn allow_requests(&self) {
        self.requests.allowed.store(true, Ordering::Release);
    }

    /// Waits up to `timeout` for a page request to be queued (returns at once if one is).
    pub fn wait_requests(&self, timeout: Duration) {
        let q = self.requests.queue.lock().unwrap();
        if q.0.is_empty() {
            let _ = self.requests.arrived.wait_timeout(q, timeout);
        }
    }

    /// The record or failure that ended the reading, if it came already. Returned once.
    pub fn poll(&self) -> Option<Ending> {
        self.ending.try_recv().ok()
    }

    /// Waits up to `timeout` for what ends the reading; `None` if nothing came in time.
    pub fn wait(&self, timeout: Duration) -> Option<Ending> {
        match self.ending.recv_timeout(timeout) {
            Ok(end) => Some(end),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => None,
        }
    }
}

impl Drop for InboundReader {
    /// Shuts the read side so that the thread's read returns, and joins it.
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Read);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Requested runs not taken yet, and when the oldest of them was read.
type Queued = (VecDeque<Requested>, Option<Instant>);

/// Page requests the reader queued for the session, and a condvar it signals on each.
#[derive(Debug, Default)]
struct Requests {
    queue: Mutex<Queued>,
    arrived: Condvar,
    /// Set by the session when it switched to postcopy; a request before is refused.
    allowed: std::sync::atomic::AtomicBool,
    /// Where the reader sends requested pages itself (`forward.rs`): the preempt connection,
    /// or the main connection during the push without one.
    lane: Mutex<Option<Lane>>,
    /// Rung, besides `arrived`, for every request queued, once the push waits on it.
    wakeup: Mutex<Option<Wakeup>>,
}

/// Where the reader puts what it folds and queues.
struct Into {
    bytes: Arc<AtomicU64>,
    pages: Arc<AtomicU64>,
    /// The destination said StateReady.
    ready: Arc<AtomicBool>,
    requests: Arc<Requests>,
}

/// Reads records, folding `Received` into the counters and queueing page requests, until one
/// that ends the reading; a Resumed under postcopy goes to `resumed` and the reading goes on.
fn read_until_end(
    conn: &mut Conn,
    agreed: Agreement,
    opening: Opening,
    into: &Into,
    resumed: &dyn Fn(Inbound),
) -> Ending {
    let (bytes, pages) = (&into.bytes, &into.pages);
    let mut seen_resumed = opening == Opening::Recovery;
    let progress = agreed.progress && opening == Opening::Handshake;
    loop {
        match read(conn, AWAITING_ANY)? {
            inbound @ (Inbound::PageRequest(_) | Inbound::Done(_)) if !agreed.postcopy => {
                return Err(MigrateError::misplaced(
                    inbound.kind(),
                    Rule::PostcopyRecordsNeedPostcopy,
                ));
            }
            Inbound::PageRequest(_) if !into.requests.allowed.load(Ordering::Acquire) => {
                return Err(MigrateError::misplaced(
                    Kind::PageRequest,
                    Rule::RequestsInPostcopy,
                ));
            }
            Inbound::Done(_) if !seen_resumed => {
                return Err(MigrateError::misplaced(Kind::Done, Rule::DoneAfterResumed));
            }
            Inbound::PageRequest(runs) => {
                let q = into.requests.queue.lock().unwrap();
                if q.0.len() + runs.len() > MAX_QUEUED_REQUESTS {
                    return Err(ProtocolError::OverBound {
                        bound: Bound::QueuedRequests,
                        max: MAX_QUEUED_REQUESTS as u64,
                    }
                    .into());
                }
                // Forwarded before the queue is locked again: on the main connection that
                // is a write, and the migration thread must not wait for it to take requests.
                drop(q);
                let now = Instant::now();
                let lane = into.requests.lane.lock().unwrap();
                let requested: Vec<Requested> = runs
                    .into_iter()
                    .map(|(gpa, pages)| Requested {
                        gpa,
                        pages,
                        forwarded: lane.as_ref().is_some_and(|l| l.forward(gpa, pages, now)),
                    })
                    .collect();
                drop(lane);
                let mut q = into.requests.queue.lock().unwrap();
                q.0.extend(requested);
                q.1.get_or_insert(now);
                into.requests.arrived.notify_all();
                drop(q);
                if let Some(w) = &*into.requests.wakeup.lock().unwrap() {
                    w.ring();
                }
            }
            Inbound::Resumed(_) if seen_resumed => {
                return Err(MigrateError::misplaced(Kind::Resumed, Rule::OneResumed));
            }
            Inbound::Resumed(r) if agreed.postcopy => {
                seen_resumed = true;
                resumed(Inbound::Resumed(r));
            }
            Inbound::StateReady if !agreed.iterative || into.ready.load(Ordering::Relaxed) => {
                return Err(MigrateError::misplaced(
                    Kind::StateReady,
                    Rule::OneStateReady,
                ));
            }
            Inbound::StateReady => into.ready.store(true, Ordering::Release),
            Inbound::Received(_) if !progress => {
                return Err(MigrateError::misplaced(
                    Kind::Received,
                    Rule::ReceivedNeedsProgress,
                ));
            }
            Inbound::Received(r) => {
                let before = bytes.load(Ordering::Relaxed);
                if r.bytes < before {
                    return Err(ProtocolError::ReceivedWentBack {
                        before,
                        now: r.bytes,
                    }
                    .into());
                }
                pages.store(r.pages, Ordering::Relaxed);
                bytes.store(r.bytes, Ordering::Release);
            }
            end => return Ok(end),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::wire::{Header, RECEIVED_SIZE, RESUMED_SIZE};

    /// The runs `reader` queued, as `(gpa, pages)`.
    fn taken(reader: &InboundReader) -> Vec<(u64, u64)> {
        let (runs, _) = reader.take_requests();
        runs.iter().map(|r| (r.gpa, r.pages)).collect()
    }

    const AWAITING: Awaiting = Awaiting {
        during: "waiting in a test",
        expected: "Resumed",
    };

    /// Reads one record from a connection the destination wrote `bytes` to and closed.
    fn read_from(bytes: &[u8]) -> Result<Inbound, MigrateError> {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(bytes).unwrap();
        drop(theirs);
        read(&mut Conn::new(Box::new(ours)).unwrap(), AWAITING)
    }

    fn record(h: Header, payload: &[u8]) -> Vec<u8> {
        // (Some cases cut the payload short: the checksum is of what is there.)
        [
            h.with_crc(crate::wire::crc(payload)).encode().as_slice(),
            payload,
        ]
        .concat()
    }

    fn resumed_payload(words: [u64; 3]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn records_from_the_destination() {
        let resumed = record(
            Header::new(Kind::Resumed, 0, RESUMED_SIZE),
            &resumed_payload([1_500, 2_000_000, u64::MAX]),
        );
        let error = record(Header::new(Kind::Error, 0, 9), b"no space\xff");
        let end_of_pass = record(Header::new(Kind::EndOfPass, 3, 0), &[]);
        let short_resumed = record(Header::new(Kind::Resumed, 0, 8), &[0; 8]);
        let received = record(
            Header::new(Kind::Received, 0, RECEIVED_SIZE),
            &Received {
                bytes: 1 << 30,
                pages: 7,
            }
            .encode(),
        );
        let long_received = record(Header::new(Kind::Received, 0, 24), &[0; 24]);
        // (name, bytes on the connection, what the read returns, or its error's text)
        let table: [(&str, Vec<u8>, Result<Inbound, &str>); 8] = [
            (
                "resumed",
                resumed,
                Ok(Inbound::Resumed(ResumedRecord {
                    load_ns: 1_500,
                    resume_ns: 2_000_000,
                    cpu_ns: u64::MAX,
                    parts: Vec::new(),
                })),
            ),
            (
                "error, lossy utf-8",
                error,
                Ok(Inbound::Error("no space\u{fffd}".into())),
            ),
            (
                "a record the destination never sends",
                end_of_pass,
                Err("expected Resumed from the destination, got EndOfPass"),
            ),
            (
                "a Resumed of the wrong size",
                short_resumed,
                Err("invalid migration stream"),
            ),
            (
                "received",
                received,
                Ok(Inbound::Received(Received {
                    bytes: 1 << 30,
                    pages: 7,
                })),
            ),
            (
                "a Received of the wrong size",
                long_received,
                Err("invalid migration stream"),
            ),
            ("closed", vec![], Err("while waiting in a test")),
            (
                "closed mid-payload",
                record(Header::new(Kind::Error, 0, 100), b"half"),
                Err("while reading the destination's answer"),
            ),
        ];
        for (name, bytes, want) in table {
            match (read_from(&bytes), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{name}"),
                (Err(e), Err(want)) => {
                    assert!(e.to_string().contains(want), "{name}: got '{e}'")
                }
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
    }

    fn received(bytes: u64) -> Vec<u8> {
        record(
            Header::new(Kind::Received, 0, RECEIVED_SIZE),
            &Received { bytes, pages: 0 }.encode(),
        )
    }

    /// Starts a reader on a connection the destination wrote `bytes` to and keeps open.
    fn reader_over(bytes: &[u8], progress: bool) -> (InboundReader, UnixStream) {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(bytes).unwrap();
        let mut conn = Conn::new(Box::new(ours)).unwrap();
        let agreed = Agreement {
            progress,
            ..Agreement::NONE
        };
        (
            InboundReader::start(&mut conn, agreed, Opening::Handshake).unwrap(),
            theirs,
        )
    }

    #[test]
    fn the_reader_folds_acknowledgements_and_hands_over_the_end() {
        let resumed = record(
            Header::new(Kind::Resumed, 0, RESUMED_SIZE),
            &resumed_payload([1, 2, 3]),
        );
        let bytes = [received(100), received(5_000), resumed].concat();
        let (reader, _theirs) = reader_over(&bytes, true);
        let end = reader.wait(Duration::from_secs(5)).expect("an ending");
        assert!(matches!(end, Ok(Inbound::Resumed(_))), "{end:?}");
        assert_eq!(reader.acked().bytes, 5_000);
        assert!(reader.poll().is_none(), "the ending is handed over once");
    }

    #[test]
    fn page_requests_are_taken_once_the_source_switched_and_refused_before() {
        let request = record(
            Header::runs(Kind::PageRequest, 1),
            &crate::wire::encode_runs(&[(0x2000, 1)]),
        );
        let postcopy = Agreement {
            postcopy: true,
            ..Agreement::NONE
        };
        let start = |allow: bool| {
            let (ours, theirs) = UnixStream::pair().unwrap();
            let mut conn = Conn::new(Box::new(ours)).unwrap();
            let reader = InboundReader::start(&mut conn, postcopy, Opening::Handshake).unwrap();
            if allow {
                reader.allow_requests();
            }
            (reader, theirs)
        };
        let (early, mut theirs) = start(false);
        theirs.write_all(&request).unwrap();
        let end = early.wait(Duration::from_secs(5)).expect("an ending");
        let e = end.expect_err("a request before the switch is refused");
        assert!(e.to_string().contains("before the source switched"), "{e}");

        // After the switch, a request is queued even before Resumed (a load that faults).
        let (switched, mut theirs) = start(true);
        theirs.write_all(&request).unwrap();
        switched.wait_requests(Duration::from_secs(5));
        assert_eq!(taken(&switched), vec![(0x2000, 1)]);
        assert!(switched.poll().is_none(), "nothing ended the reading");
    }

    /// A postcopy recovery's reader failed its migration when the destination's request for
    /// a page it still waited for, sent right after Resume, was read before the source allowed
    /// requests on the new connection (a CI run of the failure matrix): a resumed connection
    /// takes requests from its first byte.
    #[test]
    fn a_recovered_connection_takes_a_request_that_was_waiting_before_the_reader_started() {
        let request = record(
            Header::runs(Kind::PageRequest, 1),
            &crate::wire::encode_runs(&[(0x3000, 1)]),
        );
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(&request).unwrap();
        let mut conn = Conn::new(Box::new(ours)).unwrap();
        let agreed = Agreement {
            postcopy: true,
            ..Agreement::NONE
        };
        let reader = InboundReader::start(&mut conn, agreed, Opening::Recovery).unwrap();
        reader.wait_requests(Duration::from_secs(5));
        assert_eq!(taken(&reader), vec![(0x3000, 1)]);
        assert!(reader.poll().is_none(), "nothing ended the reading");
    }

    #[test]
    fn the_reader_refuses_what_the_destination_may_not_send() {
        // (name, bytes, progress granted, the error's text)
        let table = [
            (
                "acknowledgement not granted",
                received(100),
                false,
                "without the progress capability",
            ),
            (
                "acknowledgements going back",
                [received(100), received(99)].concat(),
                true,
                "went back from 100 to 99",
            ),
            (
                "a record only the source sends",
                record(Header::new(Kind::Complete, 0, 0), &[]),
                true,
                "expected Received, StateReady, Resumed or Error",
            ),
        ];
        for (name, bytes, progress, want) in table {
            let (reader, _theirs) = reader_over(&bytes, progress);
            match reader.wait(Duration::from_secs(5)) {
                Some(Err(e)) => assert!(e.to_string().contains(want), "{name}: {e}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_destination_error_ends_the_reading_at_once_and_dropping_stops_a_quiet_reader() {
        let error = record(Header::new(Kind::Error, 0, 4), b"full");
        let (reader, _theirs) = reader_over(&[received(1), error].concat(), true);
        match reader.wait(Duration::from_secs(5)) {
            Some(Ok(Inbound::Error(m))) => assert_eq!(m, "full"),
            other => panic!("{other:?}"),
        }
        // A destination that says nothing: the reader blocks until it is dropped.
        let (quiet, _theirs) = reader_over(&[], true);
        assert!(quiet.wait(Duration::from_millis(20)).is_none());
        drop(quiet);
    }
}
