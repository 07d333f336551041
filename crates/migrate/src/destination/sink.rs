//! How received pages land in guest memory: the seam between the receivers (which validate,
//! claim and order pages) and the memory they fill.
//!
//! Precopy has two sinks, and the VMM picks one per migration with
//! [`DestinationVm::page_landing`](crate::vm::DestinationVm::page_landing), by whether its RAM
//! is populated and how many channels write ([`PageLanding`] has the measurements):
//! [`DirectSink`] reads from the socket straight into the mapped RAM, [`FileSink`] stages a
//! record in the receiver's buffer and `pwrite`s it to the backing file. Both are sound for
//! the same reason: no vCPU runs on the destination until every page arrived. Postcopy's pages
//! do not come through a sink: the guest runs while they arrive, so a page must appear whole
//! and at once (userfaultfd's `UFFDIO_COPY` into a missing page, `UFFDIO_ZEROPAGE` for a zero
//! one, `UFFDIO_CONTINUE` over memory held here) and wake the vCPU that faulted on it. A
//! receiver that passed the postcopy gate hands them to `postcopy.rs`'s `Postcopy` instead
//! (`install_pages`, `install_zero`; huge pages through `assemble.rs`).
//!
//! Contract for every sink: the caller has claimed each page for the current pass (the pass
//! barrier's claim bitmap), so no other thread touches it meanwhile, and the addresses of a
//! call are RAM (checked by [`Ram::page_index`] or [`Ram::check_run`]) and strictly increasing.
//! A sink reads exactly the pages' bytes from the stream, whatever it does with them.

#![forbid(unsafe_code)]

use std::io::Read;
use std::sync::{Arc, Mutex};

use crate::ram::Ram;
use crate::vm::PageLanding;
use crate::wire::PAGE_SIZE;

/// Where received pages go.
pub(crate) trait PageSink: Send + Sync + std::fmt::Debug {
    /// Reads `gpas.len()` pages of data from `stream`, in order, into the pages at `gpas`.
    /// `buffer` is the calling receiver's own, reused across calls, for a sink that stages
    /// the data (it grows to the largest record, at most 2 MiB by the wire's cap).
    fn receive_pages(
        &self,
        stream: &mut dyn Read,
        gpas: &[u64],
        buffer: &mut Vec<u8>,
    ) -> std::io::Result<()>;

    /// Makes `pages` pages from `gpa` read as zero (they hold data from an earlier pass).
    fn zero(&self, gpa: u64, pages: u64) -> std::io::Result<()>;
}

/// The sink for `landing` over `ram`.
pub(crate) fn for_landing(landing: PageLanding, ram: &Ram) -> Arc<dyn PageSink> {
    match landing {
        PageLanding::Mapping => Arc::new(DirectSink { ram: ram.clone() }),
        PageLanding::File => Arc::new(FileSink {
            ram: ram.clone(),
            writing: Mutex::new(()),
        }),
    }
}

/// Page data read from the socket straight into the mapped guest RAM ([`PageLanding::Mapping`]).
#[derive(Clone, Debug)]
pub(crate) struct DirectSink {
    pub(crate) ram: Ram,
}

impl PageSink for DirectSink {
    fn receive_pages(
        &self,
        stream: &mut dyn Read,
        gpas: &[u64],
        _buffer: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        // The caller claimed every page (this module's contract), which is `read_pages`'s.
        let mut stream = stream;
        self.ram.read_pages(&mut stream, gpas)
    }

    fn zero(&self, gpa: u64, pages: u64) -> std::io::Result<()> {
        self.ram.zero_run(gpa, pages)
    }
}

/// Page data read into the receiver's buffer, then written to the backing file at the pages'
/// offsets ([`PageLanding::File`]). The whole record is read before any page is written, so a
/// stream cut inside a record leaves the pages as they were.
///
/// The receivers write one at a time, under `writing`. A shmem file takes its inode lock for
/// every write, and a second writer spins on it while the first copies (24% of two
/// receivers' time in a profile of a 2-channel migration): the core it spins on is one the
/// source's threads need on a shared host. Waiting here sleeps instead. Measured with two
/// loopback streams writing 4 GiB into one memfd (one run each): 994 MB/s and 7.1-7.6 µs of a
/// receiver's CPU per page without the lock, 2,135 MB/s and 2.1-2.4 µs with it; in `ferry
/// bench ingest`'s "2 ch, sparse, forced File" row, the destination's CPU was 1.3-2.6 s/GiB in
/// four runs without it and 1.0-1.8 in seven with it.
#[derive(Debug)]
pub(crate) struct FileSink {
    pub(crate) ram: Ram,
    writing: Mutex<()>,
}

impl PageSink for FileSink {
    fn receive_pages(
        &self,
        stream: &mut dyn Read,
        gpas: &[u64],
        buffer: &mut Vec<u8>,
    ) -> std::io::Result<()> {
        let len = gpas.len() * PAGE_SIZE as usize;
        if buffer.len() < len {
            buffer.resize(len, 0);
        }
        stream.read_exact(&mut buffer[..len])?;
        // A receiver that panicked while writing left no state behind the lock to distrust.
        let _one_writer = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        // The caller claimed every page (this module's contract), which is `write_pages`'s.
        self.ram.write_pages(gpas, &buffer[..len])
    }

    /// Stale pages are cleared through the mapping, as [`DirectSink`] does: a page written
    /// through the file is in the page cache already, so the clear costs a minor fault and a
    /// store per page (stale pages are few: those the guest zeroed after they were sent).
    fn zero(&self, gpa: u64, pages: u64) -> std::io::Result<()> {
        self.ram.zero_run(gpa, pages)
    }
}
