//! The main connection's write side in postcopy, shared by the fault thread (page requests)
//! and the session (Done, a recovery's first records): one lock orders every write.

use std::sync::Mutex;

use crate::error::MigrateError;
use crate::transport::Stream;
use crate::wire::Header;

/// The main connection's write side, shared by the fault thread (page requests) and the
/// session (Done, a recovery's first records). One lock orders every write, and a recovery
/// swaps the connection under it only after its first records are written, so no page request
/// can overtake them on the new connection.
#[derive(Debug)]
pub(crate) struct Outbox(pub(crate) Mutex<Box<dyn Stream>>);

impl Outbox {
    pub(crate) fn write(&self, header: &Header, payload: &[u8]) -> Result<(), MigrateError> {
        write_sealed(self.0.lock().unwrap().as_mut(), header, payload)
    }

    pub(crate) fn replace_after(
        &self,
        mut out: Box<dyn Stream>,
        first: &[(Header, Vec<u8>)],
    ) -> Result<(), MigrateError> {
        let mut current = self.0.lock().unwrap();
        for (header, payload) in first {
            write_sealed(out.as_mut(), header, payload)?;
        }
        *current = out;
        Ok(())
    }
}

/// Writes one record, its header sealed over its payload, and flushes.
fn write_sealed(out: &mut dyn Stream, header: &Header, payload: &[u8]) -> Result<(), MigrateError> {
    out.write_all(&header.seal(payload).encode())
        .and_then(|()| out.write_all(payload))
        .and_then(|()| out.flush())
        .map_err(|e| MigrateError::io("writing to the source", e))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::Outbox;
    use crate::wire::{self, HEADER_SIZE, Header, Kind};

    /// Reads records (header kinds) off `s` until it ends.
    fn kinds(mut s: UnixStream) -> Vec<Kind> {
        let mut out = Vec::new();
        let mut h = [0u8; HEADER_SIZE];
        while s.read_exact(&mut h).is_ok() {
            let header = Header::decode(&h).expect("a valid header");
            let mut payload = vec![0u8; header.len as usize];
            s.read_exact(&mut payload).unwrap();
            out.push(header.kind);
        }
        out
    }

    #[test]
    fn a_request_written_while_a_recovery_swaps_connections_comes_after_its_first_records() {
        for _ in 0..50 {
            let (old, mut old_peer) = UnixStream::pair().unwrap();
            // The broken connection's other end keeps reading, so no write blocks on it.
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while matches!(old_peer.read(&mut b), Ok(n) if n > 0) {}
            });
            let outbox = Arc::new(Outbox(Mutex::new(Box::new(old))));
            let stop = Arc::new(AtomicBool::new(false));
            // A fault thread that writes requests as fast as it can, through the swap.
            let writer = {
                let (outbox, stop) = (outbox.clone(), stop.clone());
                std::thread::spawn(move || {
                    let run = wire::encode_runs(&[(0x1000, 1)]);
                    while !stop.load(Ordering::Relaxed) {
                        let _ = outbox.write(&Header::runs(Kind::PageRequest, 1), &run);
                    }
                })
            };
            let (new, new_peer) = UnixStream::pair().unwrap();
            let reading = std::thread::spawn(move || kinds(new_peer));
            let missing = wire::encode_runs(&[(0x2000, 4)]);
            outbox
                .replace_after(
                    Box::new(new),
                    &[
                        (Header::runs(Kind::Missing, 1), missing),
                        (Header::new(Kind::Resume, 0, 0), Vec::new()),
                    ],
                )
                .unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1));
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            // Dropping the outbox closes the new connection's write side.
            drop(outbox);
            let seen = reading.join().unwrap();
            assert_eq!(
                seen[..2],
                [Kind::Missing, Kind::Resume],
                "{:?}",
                &seen[..4.min(seen.len())]
            );
            assert!(seen[2..].iter().all(|k| *k == Kind::PageRequest));
        }
    }
}
