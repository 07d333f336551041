//! The source's side of a disk copy: a first pass over the image's allocated ranges (found
//! with `SEEK_DATA`/`SEEK_HOLE`, so a sparse image's holes cost nothing), then the granules the
//! guest wrote since they were read, as the device marked them, until none is left. A range
//! that reads as zeros goes as a header alone.
//!
//! Invariant: the device marks a granule after its write reached the image, and a granule is
//! taken (its mark cleared) before it is read; so a write that lands after a granule's read
//! leaves a mark, and the granule goes again. With the guest paused nothing is marked any
//! more, and the copy ends when the marks taken then are sent.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use super::chunk;

/// The granule the device marks writes in, bytes.
pub const GRANULE: u64 = crate::devices::virtio::blk::DIRTY_CHUNK;
const SECTOR: u64 = ferry_guest_abi::virtio::blk::SECTOR_SIZE;

/// The marks of granules written since they were taken: the device's.
pub trait Written {
    /// The granules marked (their indices, offset / [`GRANULE`]), in order; the marks are
    /// cleared.
    fn take(&mut self) -> Vec<u64>;
    /// How many granules are marked now.
    fn count(&self) -> u64;
    /// Holds the guest's writers from now on while more than `lag` granules are marked
    /// (`blk::WriteLog`): the copy is not gaining on them. Called again as the lag changes.
    fn mirror(&mut self, lag: u64);
}

/// The smallest lag, granules: a request's worth.
const LAG_LEAST: u64 = 16;

/// What a copy sent, counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CopyStats {
    /// Chunks sent, and the bytes of the ranges they carried with data and as zeros.
    pub chunks: u64,
    pub data_bytes: u64,
    pub zero_bytes: u64,
    /// Granules sent again because the guest wrote them after they were read.
    pub granules_again: u64,
    /// Passes over the granules the guest wrote (takes of the device's marks that found
    /// some), after the first pass over the image.
    pub dirty_passes: u64,
    /// Whether the mirror is on (`blk::WriteLog`).
    pub mirror: bool,
}

/// A disk copy (`disk_copy`) from this VM, as `GET /migration` shows it under `disk`: while
/// it runs, and its last figures once it ended; read back from `ferry migrate --stats-out`'s
/// file by `ferry report`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DiskCopyStatus {
    /// What went: chunks, bytes with data and as zeros, granules sent again, dirty passes,
    /// whether the mirror is on.
    pub stats: CopyStats,
    /// Bytes still to send: of the first pass, and granules written since they went.
    pub pending_bytes: u64,
    /// How long the mirror held the guest's writers, ms.
    pub writers_held_ms: f64,
}

impl DiskCopyStatus {
    /// Fills a migration's job statistics' `disk_*` (libvirt's `VIR_DOMAIN_JOB_DISK_*`) with
    /// this copy's figures: the ranges sent (with data or as zeros), what is pending, their
    /// sum. `disk_bps` stays `null`: the copy shares the migration's connections and its rate
    /// is not measured apart.
    pub fn fill_job(&self, job: &mut ferry_migrate::job::JobStats) {
        let processed = self.stats.data_bytes + self.stats.zero_bytes;
        job.disk_processed_bytes = Some(processed);
        job.disk_remaining_bytes = Some(self.pending_bytes);
        job.disk_total_bytes = Some(processed + self.pending_bytes);
    }
}

/// The source's copy of one disk.
#[derive(Debug)]
pub struct SourceCopy {
    image: File,
    capacity: u64,
    /// Where the first pass reads next; `None` once it reached the end.
    first: Option<u64>,
    /// Allocated bytes the first pass has still to read, as found at the start.
    first_left: u64,
    /// Granules taken from the device's marks and not sent yet.
    again: VecDeque<u64>,
    /// The size of the last take, and what the pause could carry as last told
    /// (`mirror_if_behind`).
    last_take: Option<u64>,
    allowance: Option<u64>,
    pub stats: CopyStats,
}

impl SourceCopy {
    /// A copy of `image` (a descriptor of the device's own), `capacity` bytes. The device
    /// marks writes from before this call on.
    pub fn start(image: File, capacity: u64) -> std::io::Result<SourceCopy> {
        let mut allocated = 0;
        let mut at = 0;
        while let Some((start, end)) =
            ferry_migrate::ram::next_data_in_file(image.as_raw_fd(), at, capacity)?
        {
            let end = end.min(capacity);
            allocated += end - start;
            at = end;
        }
        Ok(SourceCopy {
            image,
            capacity,
            first: Some(0),
            first_left: allocated,
            again: VecDeque::new(),
            last_take: None,
            allowance: None,
            stats: CopyStats::default(),
        })
    }

    /// The next chunk of at most `max_bytes` (header included), encoded: the first pass's
    /// next allocated range, else a run of granules written since they were read; `None` when
    /// neither is left now.
    pub fn next(
        &mut self,
        max_bytes: usize,
        written: &mut dyn Written,
    ) -> std::io::Result<Option<Vec<u8>>> {
        let most = (max_bytes.saturating_sub(chunk::HEADER) as u64).min(chunk::MAX_RANGE) / SECTOR
            * SECTOR;
        assert!(most >= GRANULE, "a chunk holds a granule");
        if let Some(range) = self.first_range(most)? {
            let (offset, len) = range;
            self.first_left = self.first_left.saturating_sub(len);
            return self.read(offset, len).map(Some);
        }
        if self.again.is_empty() {
            let taken = written.take();
            self.mirror_if_behind(taken.len() as u64, written);
            self.again.extend(taken);
        }
        // A run of adjacent granules goes as one range (the marks come in order).
        let Some(first) = self.again.pop_front() else {
            return Ok(None);
        };
        let mut last = first;
        while (last + 1 - first) * GRANULE < most && self.again.front() == Some(&(last + 1)) {
            last += 1;
            self.again.pop_front();
        }
        self.stats.granules_again += last + 1 - first;
        let offset = first * GRANULE;
        let len = ((last + 1) * GRANULE)
            .min(self.capacity)
            .saturating_sub(offset);
        if len == 0 {
            // A mark past the end: the device never makes one.
            return Ok(None);
        }
        self.read(offset, len).map(Some)
    }

    /// Bytes still to send: what the first pass has left, and every granule marked or taken.
    pub fn pending(&self, written: &dyn Written) -> u64 {
        self.first_left + (self.again.len() as u64 + written.count()) * GRANULE
    }

    /// The first pass's next range, at most `most` bytes, moving it on; `None` once it is done.
    /// What of the disk the pause could carry now (`SourceVm::state_allowance`): the mirror
    /// keeps what is pending within half of it.
    pub fn set_allowance(&mut self, bytes: u64) {
        self.allowance = Some(bytes);
    }

    /// Turns the mirror on at a take after the first pass that is more than half of what the
    /// pause could carry and no smaller than the one before: the guest writes as fast as the
    /// copy sends, and the switchover would never come. Each take then sets the lag to a
    /// quarter of that allowance (at most the device's [`MIRROR_LAG`]), so the lag and the
    /// take on its way fit in half of it.
    ///
    /// [`MIRROR_LAG`]: crate::devices::virtio::blk::MIRROR_LAG
    fn mirror_if_behind(&mut self, taken: u64, written: &mut dyn Written) {
        if taken == 0 {
            return;
        }
        self.stats.dirty_passes += 1;
        let half = self.allowance.map_or(0, |a| a / 2 / GRANULE);
        if !self.stats.mirror && taken > half && self.last_take.is_some_and(|last| taken >= last) {
            self.stats.mirror = true;
        }
        self.last_take = Some(taken);
        if self.stats.mirror {
            let quarter = self.allowance.map_or(u64::MAX, |a| a / 4 / GRANULE);
            written.mirror(quarter.max(LAG_LEAST));
        }
    }

    fn first_range(&mut self, most: u64) -> std::io::Result<Option<(u64, u64)>> {
        let Some(at) = self.first else {
            return Ok(None);
        };
        let found =
            ferry_migrate::ram::next_data_in_file(self.image.as_raw_fd(), at, self.capacity)?;
        let Some((start, end)) = found else {
            self.first = None;
            self.first_left = 0;
            return Ok(None);
        };
        let start = start.max(at);
        let end = end.min(self.capacity).min(start + most);
        self.first = Some(end);
        Ok(Some((start, end - start)))
    }

    /// The range read straight into its chunk, after the header: one copy out of the file.
    fn read(&mut self, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        let mut out = vec![0u8; chunk::HEADER + len as usize];
        self.image
            .read_exact_at(&mut out[chunk::HEADER..], offset)?;
        self.stats.chunks += 1;
        let zeros = is_zero(&out[chunk::HEADER..]);
        match zeros {
            true => {
                self.stats.zero_bytes += len;
                out.truncate(chunk::HEADER);
            }
            false => self.stats.data_bytes += len,
        }
        chunk::write_header(&mut out, self.capacity, offset, len, zeros);
        Ok(out)
    }
}

/// Whether every byte of `bytes` is zero, a word at a time.
fn is_zero(bytes: &[u8]) -> bool {
    let (words, rest) = bytes.split_at(bytes.len() / 8 * 8);
    words
        .chunks_exact(8)
        .all(|w| u64::from_ne_bytes(w.try_into().unwrap()) == 0)
        && rest.iter().all(|&b| b == 0)
}
