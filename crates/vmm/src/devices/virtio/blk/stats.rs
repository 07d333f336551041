//! What the block device did, for the VMM to show; the counters migrate with the device.

#![forbid(unsafe_code)]

/// Requests answered, by kind and outcome, since the device was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlockStats {
    /// IN requests completed.
    pub reads: u64,
    /// OUT requests completed.
    pub writes: u64,
    pub flushes: u64,
    /// DISCARD and WRITE_ZEROES requests completed.
    pub discards: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests answered S_IOERR: out of range, read-only, bad length, host I/O errors, or no
    /// image attached yet.
    pub errors: u64,
    /// Requests answered S_UNSUPP (unknown type or flags).
    pub unsupported: u64,
    /// Buffers returned unanswered: no status byte the device could write.
    pub malformed: u64,
}

impl BlockStats {
    pub(super) const WORDS: usize = 9;

    pub(super) fn words(&self) -> [u64; Self::WORDS] {
        [
            self.reads,
            self.writes,
            self.flushes,
            self.discards,
            self.bytes_read,
            self.bytes_written,
            self.errors,
            self.unsupported,
            self.malformed,
        ]
    }

    pub(super) fn from_words(w: [u64; Self::WORDS]) -> BlockStats {
        let [
            reads,
            writes,
            flushes,
            discards,
            bytes_read,
            bytes_written,
            errors,
            unsupported,
            malformed,
        ] = w;
        BlockStats {
            reads,
            writes,
            flushes,
            discards,
            bytes_read,
            bytes_written,
            errors,
            unsupported,
            malformed,
        }
    }
}
