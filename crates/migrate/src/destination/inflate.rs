//! A receiver's side of page compression (`compress.rs`): reads a CompressedPages record,
//! checks it, and decodes its frame into whole pages for the sink.

#![forbid(unsafe_code)]

use std::io::Read;

use crate::compress;
use crate::error::{MigrateError, ProtocolError};
use crate::stats::thread_cpu_ns;
use crate::wire::{self, Header};

/// One receiver's zstd context and buffers, made at its first compressed record.
pub(super) struct Inflater {
    ctx: zstd::bulk::Decompressor<'static>,
    payload: Vec<u8>,
    pages: Vec<u8>,
    /// CPU spent decoding frames, and the records decoded.
    pub(super) cpu_ns: u64,
    pub(super) records: u64,
}

impl Inflater {
    pub(super) fn new() -> Result<Inflater, MigrateError> {
        let ctx = zstd::bulk::Decompressor::new()
            .map_err(|e| MigrateError::io("setting up decompression", e))?;
        Ok(Inflater {
            ctx,
            payload: Vec::new(),
            pages: Vec::new(),
            cpu_ns: 0,
            records: 0,
        })
    }

    /// Reads the payload of the CompressedPages record `h` (its length bounded by the header's
    /// validation), checks its checksum and its addresses' order, and decodes the frame:
    /// the addresses and their pages' data, `h.count` pages of it exactly.
    pub(super) fn read(
        &mut self,
        stream: &mut dyn Read,
        h: &Header,
    ) -> Result<(Vec<u64>, &[u8]), MigrateError> {
        self.payload.resize(h.len as usize, 0);
        stream
            .read_exact(&mut self.payload)
            .map_err(|e| MigrateError::io("receiving compressed pages", e))?;
        h.check(wire::crc(&self.payload), "the whole payload")?;
        let (words, frame) = self.payload.split_at(h.count as usize * 8);
        let gpas: Vec<u64> = wire::decode_addresses(words).collect();
        if gpas.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ProtocolError::AddressesNotIncreasing.into());
        }
        let started = thread_cpu_ns();
        let decoded = compress::decompress(&mut self.ctx, frame, gpas.len(), &mut self.pages);
        self.cpu_ns += thread_cpu_ns() - started;
        decoded.map_err(|why| ProtocolError::Compressed {
            pages: h.count,
            why,
        })?;
        self.records += 1;
        Ok((gpas, &self.pages))
    }
}
