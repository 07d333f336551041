//! Records over a byte stream: the only place the sessions touch the socket.

#![forbid(unsafe_code)]

use std::io::{BufReader, IoSlice, Read, Write};
use std::time::Duration;

use crate::error::MigrateError;
use crate::transport::Stream;
use crate::wire::{self, HEADER_SIZE, HELLO_SIZE, Header, Hello, Kind, SectionHeader};

/// Send buffer: a few records, so small records (zero runs, pass ends, record headers) are
/// coalesced; page data does not pass through it ([`Conn::write_with_pages`]).
const WRITE_BUFFER: usize = 4 << 20;
/// Receive buffer: many 4 KiB page reads are served from one socket read.
const READ_BUFFER: usize = 1 << 20;

/// What a connection closed at the hello most likely met.
const CLOSED_AT_HELLO: &str = "reading the answer to the hello (a destination that requires TLS closes a plaintext connection at once; give this source --tls-dir then)";

/// One migration connection.
#[derive(Debug)]
pub struct Conn {
    reader: BufReader<Box<dyn Stream>>,
    writer: Writer,
    /// Payload and header bytes written.
    pub bytes_written: u64,
    /// The peer reads an Error record's count ([`crate::wire::Capabilities::ERROR_CODES`]).
    pub error_codes: bool,
}

/// The write side: bytes gathered in `pending` until it fills, a flush, or a vectored write
/// that takes them along (a `BufWriter` cannot hand its buffer to a `writev` and then drop it).
#[derive(Debug)]
struct Writer {
    stream: Box<dyn Stream>,
    pending: Vec<u8>,
    capacity: usize,
}

impl Writer {
    fn new(capacity: usize, stream: Box<dyn Stream>) -> Writer {
        Writer {
            stream,
            pending: Vec::new(),
            capacity,
        }
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.pending.len() + bytes.len() > self.capacity {
            self.write_pending()?;
        }
        if bytes.len() >= self.capacity {
            self.stream.write_all(bytes)
        } else {
            self.pending.extend_from_slice(bytes);
            Ok(())
        }
    }

    fn write_pending(&mut self) -> std::io::Result<()> {
        self.stream.write_all(&self.pending)?;
        self.pending.clear();
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.write_pending()?;
        self.stream.flush()
    }

    /// Writes what is pending and then `tail`, in as few `writev` calls as the socket takes.
    fn write_vectored_all(&mut self, tail: &[IoSlice<'_>]) -> std::io::Result<()> {
        let mut slices = Vec::with_capacity(tail.len() + 1);
        slices.push(IoSlice::new(&self.pending));
        slices.extend_from_slice(tail);
        let mut rest = &mut slices[..];
        IoSlice::advance_slices(&mut rest, 0);
        while !rest.is_empty() {
            match self.stream.write_vectored(rest) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.pending.clear();
        Ok(())
    }
}

impl Conn {
    pub fn new(stream: Box<dyn Stream>) -> std::io::Result<Conn> {
        stream.set_low_latency()?;
        Ok(Conn {
            reader: BufReader::with_capacity(READ_BUFFER, stream.try_clone_stream()?),
            writer: Writer::new(WRITE_BUFFER, stream),
            bytes_written: 0,
            error_codes: false,
        })
    }

    /// Hands the read side, with whatever it has already buffered, to a new `Conn` for a
    /// reader thread; this one keeps the write side and must not read again (its reader is a
    /// fresh handle, so a stray read would take bytes from the other thread).
    pub fn split_reader(&mut self) -> std::io::Result<Conn> {
        let fresh = BufReader::with_capacity(HEADER_SIZE, self.stream().try_clone_stream()?);
        let reader = std::mem::replace(&mut self.reader, fresh);
        Ok(Conn {
            reader,
            writer: Writer::new(HEADER_SIZE, self.stream().try_clone_stream()?),
            bytes_written: 0,
            error_codes: self.error_codes,
        })
    }

    pub fn stream(&self) -> &dyn Stream {
        self.writer.stream.as_ref()
    }

    pub fn write_hello(&mut self, hello: &Hello) -> Result<(), MigrateError> {
        self.write_all(&hello.encode(), "sending the hello")?;
        self.flush("sending the hello")
    }

    /// The destination's answer to a source's hello, within `within` (the peer timeout: a
    /// stopped destination answers nothing); reads wait for ever again afterwards.
    pub fn read_hello(&mut self, within: Option<Duration>) -> Result<Hello, MigrateError> {
        let during = "reading the answer to the hello";
        self.stream()
            .set_read_timeout(within)
            .map_err(|e| MigrateError::io(during, e))?;
        let mut b = [0u8; HELLO_SIZE];
        // A peer that closes at once (a TLS destination given plaintext) is read as an end of
        // stream, or as a reset when the hello was still unread in its socket: the same hint.
        self.read_exact(&mut b, during).map_err(|e| match e {
            MigrateError::Truncated { .. } => MigrateError::Truncated {
                during: CLOSED_AT_HELLO,
            },
            MigrateError::Io { ref source, .. }
                if source.kind() == std::io::ErrorKind::ConnectionReset =>
            {
                MigrateError::Truncated {
                    during: CLOSED_AT_HELLO,
                }
            }
            e => e,
        })?;
        self.stream()
            .set_read_timeout(None)
            .map_err(|e| MigrateError::io(during, e))?;
        Ok(Hello::decode(&b)?)
    }

    pub fn write_header(&mut self, h: &Header) -> Result<(), MigrateError> {
        self.write_all(&h.encode(), "sending a record")
    }

    pub fn write_all(&mut self, bytes: &[u8], during: &'static str) -> Result<(), MigrateError> {
        self.writer
            .write_all(bytes)
            .map_err(|e| MigrateError::io(during, e))?;
        self.bytes_written += bytes.len() as u64;
        Ok(())
    }

    /// Writes what is buffered and then `pages` (e.g. guest memory for a Pages record whose
    /// header and addresses were just written), without copying the pages into the buffer.
    pub fn write_with_pages(
        &mut self,
        pages: &[IoSlice<'_>],
        during: &'static str,
    ) -> Result<(), MigrateError> {
        self.writer
            .write_vectored_all(pages)
            .map_err(|e| MigrateError::io(during, e))?;
        self.bytes_written += pages.iter().map(|p| p.len() as u64).sum::<u64>();
        Ok(())
    }

    pub fn flush(&mut self, during: &'static str) -> Result<(), MigrateError> {
        self.writer.flush().map_err(|e| MigrateError::io(during, e))
    }

    /// Writes a record with its payload, and the payload's checksum in its header.
    pub fn write_record(&mut self, h: &Header, payload: &[u8]) -> Result<(), MigrateError> {
        self.write_header(&h.seal(payload))?;
        self.write_all(payload, "sending a record")
    }

    /// Writes a DeviceState record: the section's header, then its data.
    pub fn write_section(
        &mut self,
        section: SectionHeader,
        data: &[u8],
        during: &'static str,
    ) -> Result<(), MigrateError> {
        self.write_sectioned(Kind::DeviceState, section, data, during)
    }

    /// Writes a record of `kind` whose payload is a section header and `data` (DeviceState,
    /// StateChunk), its checksum over both.
    pub fn write_sectioned(
        &mut self,
        kind: Kind,
        section: SectionHeader,
        data: &[u8],
        during: &'static str,
    ) -> Result<(), MigrateError> {
        let section = section.encode();
        let crc = wire::crc_append(wire::crc(&section), data);
        let len = (section.len() + data.len()) as u64;
        let h = Header::new(kind, 0, len).with_crc(crc);
        self.write_all(&h.encode(), during)?;
        self.write_all(&section, during)?;
        self.write_all(data, during)
    }

    /// Writes what is pending, then `h` and `payload` with `fds` attached to their bytes
    /// (`SCM_RIGHTS`: a Unix socket only), flushed.
    pub fn write_record_with_fds(
        &mut self,
        h: &Header,
        payload: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
        during: &'static str,
    ) -> Result<(), MigrateError> {
        self.flush(during)?;
        let mut bytes = h.encode().to_vec();
        bytes.extend_from_slice(payload);
        let stream = &mut self.writer.stream;
        let sent = stream
            .send_with_fds(&bytes, fds)
            .and_then(|n| stream.write_all(&bytes[n..]))
            .and_then(|()| stream.flush());
        sent.map_err(|e| MigrateError::io(during, e))?;
        self.bytes_written += bytes.len() as u64;
        Ok(())
    }

    /// Reads a record header unbuffered, with the descriptors that came on its bytes. Nothing
    /// may be buffered before it: descriptors ride on a message, and a buffered read would
    /// have dropped them.
    pub fn read_header_with_fds(
        &mut self,
        during: &'static str,
    ) -> Result<(Header, Vec<std::os::fd::OwnedFd>), MigrateError> {
        if !self.reader.buffer().is_empty() {
            return Err(MigrateError::io(
                during,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "bytes came before the record that carries the descriptors",
                ),
            ));
        }
        let mut raw = [0u8; HEADER_SIZE];
        let mut fds = Vec::new();
        let mut got = 0;
        while got < HEADER_SIZE {
            match self
                .reader
                .get_ref()
                .recv_with_fds(&mut raw[got..], &mut fds)
            {
                Ok(0) => {
                    return Err(MigrateError::Truncated { during });
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(MigrateError::io(during, e)),
            }
        }
        Ok((Header::decode(&raw)?, fds))
    }

    /// Reads and validates the next header.
    pub fn read_header(&mut self, during: &'static str) -> Result<Header, MigrateError> {
        let mut b = [0u8; HEADER_SIZE];
        self.read_exact(&mut b, during)?;
        Ok(Header::decode(&b)?)
    }

    /// The read side, buffered, for a record whose payload is read in parts (a Pages record:
    /// its addresses, then its data into place).
    pub fn reader(&mut self) -> &mut dyn Read {
        &mut self.reader
    }

    pub fn read_exact(&mut self, buf: &mut [u8], during: &'static str) -> Result<(), MigrateError> {
        self.reader
            .read_exact(buf)
            .map_err(|e| MigrateError::io(during, e))
    }

    /// Reads the payload of `h` (its length already bounded by the header's validation) and
    /// checks it against the header's checksum before anyone uses it.
    pub fn read_payload(
        &mut self,
        h: &Header,
        during: &'static str,
    ) -> Result<Vec<u8>, MigrateError> {
        let mut v = vec![0u8; h.len as usize];
        self.read_exact(&mut v, during)?;
        h.check(wire::crc(&v), "the whole payload")?;
        Ok(v)
    }

    /// Sends an Error record, best effort (the connection may already be gone).
    pub fn send_error(&mut self, message: &str) {
        self.send_error_coded(message, crate::wire::ERROR_FAILED);
    }

    /// Sends the Error record that ends a migration with `e`, saying (to a peer that reads
    /// it) whether it was cancelled here or failed; best effort.
    pub fn send_ending(&mut self, e: &crate::MigrateError) {
        let code = match e {
            crate::MigrateError::Cancelled | crate::MigrateError::CancelledHere
                if self.error_codes =>
            {
                crate::wire::ERROR_CANCELLED
            }
            _ => crate::wire::ERROR_FAILED,
        };
        self.send_error_coded(&e.to_string(), code);
    }

    fn send_error_coded(&mut self, message: &str, code: u32) {
        let bytes = &message.as_bytes()[..message.len().min(crate::wire::MAX_ERROR_BYTES as usize)];
        let _ = self.write_record(&Header::new(Kind::Error, code, bytes.len() as u64), bytes);
        let _ = self.flush("sending an error");
    }

    /// After a failed write: the peer may have said why before closing. Reads one record with
    /// a short timeout and returns its message if it is an Error.
    pub fn peer_error(&mut self) -> Option<String> {
        let _ = self
            .reader
            .get_ref()
            .set_read_timeout(Some(std::time::Duration::from_millis(200)));
        let h = self.read_header("reading the peer's error").ok()?;
        (h.kind == Kind::Error).then(|| {
            let p = self
                .read_payload(&h, "reading the peer's error")
                .unwrap_or_default();
            String::from_utf8_lossy(&p).into_owned()
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A stream that takes at most 1000 bytes per write and one buffer per vectored write (the
    /// default `write_vectored`), as a slow or simple transport may.
    #[derive(Clone, Debug, Default)]
    struct Trickle(Arc<Mutex<Vec<u8>>>);

    impl Read for Trickle {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Ok(0)
        }
    }

    impl Write for Trickle {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let n = b.len().min(1000);
            self.0.lock().unwrap().extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Stream for Trickle {
        fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
            Ok(Box::new(self.clone()))
        }
        fn shutdown(&self, _: std::net::Shutdown) -> io::Result<()> {
            Ok(())
        }
        fn set_read_timeout(&self, _: Option<std::time::Duration>) -> io::Result<()> {
            Ok(())
        }
        fn set_write_timeout(&self, _: Option<std::time::Duration>) -> io::Result<()> {
            Ok(())
        }
        fn peer(&self) -> String {
            "trickle".into()
        }
        fn set_low_latency(&self) -> io::Result<()> {
            Ok(())
        }
        fn set_urgent(&self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn pages_written_in_short_writes_follow_the_buffered_bytes_in_order() {
        let wire = Trickle::default();
        let mut c = Conn::new(Box::new(wire.clone())).unwrap();
        let (a, b) = (vec![1u8; 5000], vec![2u8; 3000]);
        c.write_all(b"head", "test").unwrap();
        c.write_with_pages(&[IoSlice::new(&a), IoSlice::new(&b)], "test")
            .unwrap();
        c.write_all(b"tail", "test").unwrap();
        c.flush("test").unwrap();
        let expected = [&b"head"[..], &a, &b, b"tail"].concat();
        assert_eq!(*wire.0.lock().unwrap(), expected);
        assert_eq!(c.bytes_written, expected.len() as u64);
    }
}
