//! Records over a byte stream: the only place the sessions touch the socket.

#![forbid(unsafe_code)]

use std::io::{BufReader, BufWriter, Read, Write};

use crate::error::MigrateError;
use crate::transport::Stream;
use crate::wire::{HEADER_SIZE, HELLO_SIZE, Header, Hello, Kind, SectionHeader};

/// Send buffer: a few records, so small records (zero pages, pass ends) are coalesced while a
/// 2 MiB Pages record mostly goes straight to the socket.
const WRITE_BUFFER: usize = 4 << 20;
/// Receive buffer: many 4 KiB page reads are served from one socket read.
const READ_BUFFER: usize = 1 << 20;

/// One migration connection.
#[derive(Debug)]
pub struct Conn {
    reader: BufReader<Box<dyn Stream>>,
    writer: BufWriter<Box<dyn Stream>>,
    /// Payload and header bytes written.
    pub bytes_written: u64,
}

impl Conn {
    pub fn new(stream: Box<dyn Stream>) -> std::io::Result<Conn> {
        stream.set_low_latency()?;
        Ok(Conn {
            reader: BufReader::with_capacity(READ_BUFFER, stream.try_clone_stream()?),
            writer: BufWriter::with_capacity(WRITE_BUFFER, stream),
            bytes_written: 0,
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
            writer: BufWriter::with_capacity(HEADER_SIZE, self.stream().try_clone_stream()?),
            bytes_written: 0,
        })
    }

    pub fn stream(&self) -> &dyn Stream {
        self.writer.get_ref().as_ref()
    }

    pub fn write_hello(&mut self, hello: &Hello) -> Result<(), MigrateError> {
        self.write_all(&hello.encode(), "sending the hello")?;
        self.flush("sending the hello")
    }

    pub fn read_hello(&mut self) -> Result<Hello, MigrateError> {
        let mut b = [0u8; HELLO_SIZE];
        self.read_exact(&mut b, "reading the hello")?;
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

    pub fn flush(&mut self, during: &'static str) -> Result<(), MigrateError> {
        self.writer.flush().map_err(|e| MigrateError::io(during, e))
    }

    /// Writes a record with its payload.
    pub fn write_record(&mut self, h: &Header, payload: &[u8]) -> Result<(), MigrateError> {
        debug_assert_eq!(h.len, payload.len() as u64);
        self.write_header(h)?;
        self.write_all(payload, "sending a record")
    }

    /// Writes a DeviceState record: the section's header, then its data.
    pub fn write_section(
        &mut self,
        section: SectionHeader,
        data: &[u8],
        during: &'static str,
    ) -> Result<(), MigrateError> {
        self.write_all(&Header::device_state(data.len() as u64).encode(), during)?;
        self.write_all(&section.encode(), during)?;
        self.write_all(data, during)
    }

    /// Reads and validates the next header.
    pub fn read_header(&mut self, during: &'static str) -> Result<Header, MigrateError> {
        let mut b = [0u8; HEADER_SIZE];
        self.read_exact(&mut b, during)?;
        Ok(Header::decode(&b)?)
    }

    pub fn read_exact(&mut self, buf: &mut [u8], during: &'static str) -> Result<(), MigrateError> {
        self.reader
            .read_exact(buf)
            .map_err(|e| MigrateError::io(during, e))
    }

    /// Reads a payload of `len` bytes (already bounded by the header's validation).
    pub fn read_payload(
        &mut self,
        len: u64,
        during: &'static str,
    ) -> Result<Vec<u8>, MigrateError> {
        let mut v = vec![0u8; len as usize];
        self.read_exact(&mut v, during)?;
        Ok(v)
    }

    /// Sends an Error record, best effort (the connection may already be gone).
    pub fn send_error(&mut self, message: &str) {
        let bytes = &message.as_bytes()[..message.len().min(crate::wire::MAX_ERROR_BYTES as usize)];
        let _ = self.write_record(&Header::new(Kind::Error, 0, bytes.len() as u64), bytes);
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
                .read_payload(h.len, "reading the peer's error")
                .unwrap_or_default();
            String::from_utf8_lossy(&p).into_owned()
        })
    }
}
