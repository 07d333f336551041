//! How received pages land in guest memory: the seam between the receivers (which validate,
//! claim and order pages) and the memory they fill.
//!
//! Precopy needs nothing more than writing into the mapped RAM ([`DirectSink`]): no vCPU runs
//! on the destination until every page arrived. Postcopy will need another sink, because the
//! guest runs while pages arrive: a page must appear whole and at once (userfaultfd's
//! `UFFDIO_COPY` into a missing page, `UFFDIO_ZEROPAGE` for a zero one) and wake the vCPU that
//! faulted on it. The receivers do not change for it; only the sink the session hands them.
//!
//! Contract for every sink: the caller has claimed each page for the current pass (the pass
//! barrier's claim bitmap), so no other thread touches it meanwhile, and the addresses of a
//! call are RAM (checked by [`Ram::page_index`] or [`Ram::check_run`]) and strictly increasing.

#![forbid(unsafe_code)]

use std::io::Read;

use crate::ram::Ram;

/// Where received pages go.
pub(crate) trait PageSink: Send + Sync + std::fmt::Debug {
    /// Reads `gpas.len()` pages of data from `stream`, in order, into the pages at `gpas`.
    fn receive_pages(&self, stream: &mut dyn Read, gpas: &[u64]) -> std::io::Result<()>;

    /// Makes `pages` pages from `gpa` read as zero (they hold data from an earlier pass).
    fn zero(&self, gpa: u64, pages: u64) -> std::io::Result<()>;
}

/// Precopy's sink: page data is read from the socket straight into the mapped guest RAM.
#[derive(Clone, Debug)]
pub(crate) struct DirectSink {
    pub(crate) ram: Ram,
}

impl PageSink for DirectSink {
    fn receive_pages(&self, stream: &mut dyn Read, gpas: &[u64]) -> std::io::Result<()> {
        // The caller claimed every page (this module's contract), which is `read_pages`'s.
        let mut stream = stream;
        self.ram.read_pages(&mut stream, gpas)
    }

    fn zero(&self, gpa: u64, pages: u64) -> std::io::Result<()> {
        self.ram.zero_run(gpa, pages)
    }
}
