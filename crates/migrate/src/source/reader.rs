//! What comes back from the destination on the main connection, read as typed values.
//!
//! Today the destination sends two records there: `Resumed` once the guest runs on its side,
//! and `Error` when it gives up. [`Inbound`] has a variant for each; a record the destination
//! may send later (postcopy's page requests) becomes one more variant, and the callers'
//! matches show where it must be handled. Anything else is a protocol violation and an error
//! naming what was expected.
//!
//! Invariant: a record's header is validated (kind and length, see `wire.rs`) before its
//! payload is read, so every payload decoded here has the size its kind prescribes.

#![forbid(unsafe_code)]

use crate::conn::Conn;
use crate::error::MigrateError;
use crate::wire::Kind;

/// A record from the destination on the main connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inbound {
    /// The destination loaded the state and runs the guest.
    Resumed(Resumed),
    /// The destination gave up, and says why.
    Error(String),
}

/// The destination's figures in its `Resumed` record, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resumed {
    /// Loading the device state.
    pub load_ns: u64,
    /// Resuming the guest's vCPUs.
    pub resume_ns: u64,
    /// The destination's migration CPU time.
    pub cpu_ns: u64,
}

impl Resumed {
    /// Decodes `load_ns:u64 resume_ns:u64 cpu_ns:u64`, little-endian; `payload` is
    /// `wire::RESUMED_SIZE` bytes, as the header's validation guarantees.
    fn decode(payload: &[u8]) -> Resumed {
        let word = |i: usize| u64::from_le_bytes(payload[8 * i..8 * i + 8].try_into().unwrap());
        Resumed {
            load_ns: word(0),
            resume_ns: word(1),
            cpu_ns: word(2),
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
    let payload = conn.read_payload(h.len, "reading the destination's answer")?;
    match h.kind {
        Kind::Resumed => Ok(Inbound::Resumed(Resumed::decode(&payload))),
        Kind::Error => Ok(Inbound::Error(
            String::from_utf8_lossy(&payload).into_owned(),
        )),
        k => Err(MigrateError::order(format!(
            "expected {} from the destination, got {k:?}",
            awaiting.expected
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::wire::{Header, RESUMED_SIZE};

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
        [h.encode().as_slice(), payload].concat()
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
        // (name, bytes on the connection, what the read returns, or its error's text)
        let table: [(&str, Vec<u8>, Result<Inbound, &str>); 6] = [
            (
                "resumed",
                resumed,
                Ok(Inbound::Resumed(Resumed {
                    load_ns: 1_500,
                    resume_ns: 2_000_000,
                    cpu_ns: u64::MAX,
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
}
