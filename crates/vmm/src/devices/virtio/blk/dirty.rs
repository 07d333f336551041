//! Which parts of the image the guest wrote, for a migration that copies the disk itself
//! (no shared storage): one bit per [`DIRTY_CHUNK`] of the image, set by every request that
//! changes data (OUT, DISCARD, WRITE_ZEROES), taken and cleared by the copier.
//!
//! Invariant: a chunk is marked after its write reached the file, so a copier that takes the
//! bits and then reads the chunks sees every write either in what it reads or in its next take.
//! Writes happen under the transport's lock, as do takes, so no write falls between the two.

#![forbid(unsafe_code)]

/// The unit the copier sends again when any byte of it is written: a 4 KiB block, the
/// guest's own unit, so a guest writing random blocks costs the link what it writes (a 256 KiB
/// unit sent 64 times that, and a 10 MB/s writer's copy never settled). The price is the
/// bitmap, kept only while a copy runs: 32 KiB per GiB of disk (32 MiB for 1 TiB).
pub const DIRTY_CHUNK: u64 = 4 << 10;

/// A bitmap of an image's chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirtyChunks {
    words: Vec<u64>,
    chunks: u64,
}

impl DirtyChunks {
    /// A clean bitmap of an image of `bytes` bytes.
    pub fn new(bytes: u64) -> DirtyChunks {
        let chunks = bytes.div_ceil(DIRTY_CHUNK);
        DirtyChunks {
            words: vec![0; chunks.div_ceil(64) as usize],
            chunks,
        }
    }

    /// Marks every chunk `[offset, offset + len)` touches; a range past the image is cut.
    pub fn mark(&mut self, offset: u64, len: u64) {
        let end = offset
            .saturating_add(len)
            .min(self.chunks.saturating_mul(DIRTY_CHUNK));
        if offset >= end {
            return;
        }
        for chunk in offset / DIRTY_CHUNK..=(end - 1) / DIRTY_CHUNK {
            self.words[(chunk / 64) as usize] |= 1 << (chunk % 64);
        }
    }

    /// How many chunks are marked.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The marked chunks' indices, ascending, and clears them.
    pub fn take(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        for (i, word) in self.words.iter_mut().enumerate() {
            let mut w = std::mem::take(word);
            while w != 0 {
                out.push(i as u64 * 64 + u64::from(w.trailing_zeros()));
                w &= w - 1;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_cover_every_touched_chunk_and_take_clears() {
        let mut d = DirtyChunks::new(64 * DIRTY_CHUNK + 1);
        d.mark(0, 1);
        d.mark(DIRTY_CHUNK - 1, 2);
        d.mark(63 * DIRTY_CHUNK, DIRTY_CHUNK + 1);
        d.mark(5 * DIRTY_CHUNK, 0);
        assert_eq!(d.take(), [0, 1, 63, 64]);
        assert_eq!(d.take(), Vec::<u64>::new());
    }

    #[test]
    fn ranges_past_the_image_are_cut() {
        let mut d = DirtyChunks::new(2 * DIRTY_CHUNK);
        d.mark(DIRTY_CHUNK, u64::MAX);
        d.mark(10 * DIRTY_CHUNK, 5);
        assert_eq!(d.take(), [1]);
        let mut empty = DirtyChunks::new(0);
        empty.mark(0, 512);
        assert!(empty.take().is_empty());
    }
}
