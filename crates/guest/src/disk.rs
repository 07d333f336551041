//! Which block the disk workload (`disk=`) touches next and whether it reads or writes it:
//! writes go where `disk-pattern=` says, and `disk-read=`% of accesses read back a block that
//! was written (its generation in the record is not 0), so that every read is checkable.
//! The kernel's driver does the I/O (`kernel/disk.rs`); this is the pure part, tested here.

use ferry_guest_abi::params::{Params, Pattern};
use ferry_guest_abi::stamp::NEVER_WRITTEN;

use crate::pattern::{Picker, Rng};

/// Record entries a read looks at from a random block on for one that was written, before it
/// settles for the block written last: a random block of a disk a tenth written is a written
/// one within 64 looks but for a chance of 0.9^64 = 0.1%, and the looks are reads of the
/// record in RAM, nothing next to a request.
const READ_PROBES: usize = 64;

/// Wait between flushes while the workload writes: a journaling filesystem commits about every
/// few seconds and a database at every transaction; 100 ms puts several flushes inside every
/// migration's switchover window, so that a flush in flight at the pause is met, at a cost of
/// ten requests a second.
pub const FLUSH_INTERVAL_NS: u64 = 100_000_000;

/// One access of the disk workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Write the next generation of this block.
    Write(u64),
    /// Read this block back and check it against its recorded generation.
    Read(u64),
}

/// Whether the disk may be written: a read-only device (`VIRTIO_BLK_F_RO`) is only read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writable {
    Yes,
    ReadOnly,
}

/// Chooses the disk workload's accesses.
#[derive(Clone, Copy, Debug)]
pub struct Chooser {
    pattern: Pattern,
    blocks: u64,
    /// The next block of `disk-pattern=seq`.
    cursor: u64,
    picker: Picker,
    /// Decides which accesses read, apart from the picker, so the blocks written are the same
    /// whatever `disk-read=` is.
    reads: Rng,
    read_percent: u8,
    writable: Writable,
    last_written: Option<u64>,
}

impl Chooser {
    /// A chooser over `p.disk_blocks()` blocks (at least one), seeded from `p.seed`.
    pub fn new(p: &Params, writable: Writable) -> Chooser {
        let blocks = p.disk_blocks().max(1);
        let seed = p.seed ^ 0x6469_736b; // "disk": not the memory picker's sequence
        Chooser {
            pattern: p.disk_pattern,
            blocks,
            cursor: 0,
            picker: Picker::new(Pattern::Random, blocks, 100, seed),
            reads: Rng::new(seed ^ 0x7265_6164),
            read_percent: p.disk_read_percent,
            writable,
            last_written: None,
        }
    }

    /// The next access, given the generation `record` (one entry per block). A read that
    /// finds nothing written yet is a write instead; on a read-only disk every access is a
    /// read, of any block (none was written, so none is checked).
    pub fn next(&mut self, record: &[u32]) -> Access {
        if self.writable == Writable::ReadOnly {
            return Access::Read(self.write_target());
        }
        let read = self.read_percent != 0 && self.reads.below(100) < u64::from(self.read_percent);
        if let Some(block) = read.then(|| self.written_block(record)).flatten() {
            return Access::Read(block);
        }
        let block = self.write_target();
        self.last_written = Some(block);
        Access::Write(block)
    }

    fn write_target(&mut self) -> u64 {
        match self.pattern {
            Pattern::Sequential => {
                let block = self.cursor;
                self.cursor = (self.cursor + 1) % self.blocks;
                block
            }
            Pattern::Random | Pattern::HotCold => self.picker.next_index(),
        }
    }

    /// A written block at random: the first written one from a random block on, within
    /// [`READ_PROBES`], else the block written last.
    fn written_block(&mut self, record: &[u32]) -> Option<u64> {
        let len = record.len().min(self.blocks as usize);
        if len == 0 {
            return None;
        }
        let start = self.reads.below(len as u64) as usize;
        (0..READ_PROBES.min(len))
            .map(|k| (start + k) % len)
            .find(|&b| record[b] != NEVER_WRITTEN)
            .map(|b| b as u64)
            .or(self.last_written)
    }
}

/// Whether a flush is due at `now_ns`: writes were made since the last flush, which was
/// [`FLUSH_INTERVAL_NS`] ago or more.
pub fn flush_due(now_ns: u64, last_flush_ns: u64, writes_since_flush: u64) -> bool {
    writes_since_flush > 0 && now_ns.saturating_sub(last_flush_ns) >= FLUSH_INTERVAL_NS
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use ferry_guest_abi::params::parse;

    fn run(
        line: &str,
        writable: Writable,
        n: usize,
    ) -> (std::vec::Vec<Access>, std::vec::Vec<u32>) {
        let p = parse(line).unwrap();
        let mut c = Chooser::new(&p, writable);
        let mut record = std::vec![0u32; p.disk_blocks() as usize];
        let accesses = (0..n)
            .map(|_| {
                let a = c.next(&record);
                if let Access::Write(b) = a {
                    record[b as usize] += 1;
                }
                a
            })
            .collect();
        (accesses, record)
    }

    #[test]
    fn sequential_writes_walk_the_disk_and_wrap() {
        let (a, record) = run("disk=16K disk-pattern=seq disk-read=0", Writable::Yes, 9);
        let blocks: std::vec::Vec<u64> = a
            .iter()
            .map(|a| match a {
                Access::Write(b) => *b,
                Access::Read(_) => panic!("no reads asked for"),
            })
            .collect();
        assert_eq!(blocks, [0, 1, 2, 3, 0, 1, 2, 3, 0]);
        assert_eq!(record, [3, 2, 2, 2]);
    }

    #[test]
    fn reads_take_their_share_and_only_read_written_blocks() {
        let (a, record) = run("disk=4M disk-read=30", Writable::Yes, 20_000);
        let reads: std::vec::Vec<u64> = a
            .iter()
            .filter_map(|a| match a {
                Access::Read(b) => Some(*b),
                Access::Write(_) => None,
            })
            .collect();
        assert!((5_500..6_500).contains(&reads.len()), "{}", reads.len());
        // A block read was written before the read (the record only grows here).
        assert!(reads.iter().all(|&b| record[b as usize] > 0));
        assert!(a.iter().all(|a| match a {
            Access::Read(b) | Access::Write(b) => *b < 1024,
        }));
    }

    #[test]
    fn the_first_access_writes_even_when_reads_are_all_asked_for() {
        let (a, _) = run("disk=4M disk-read=100", Writable::Yes, 3);
        assert!(matches!(a[0], Access::Write(_)), "nothing to read yet");
        assert!(matches!(a[1], Access::Read(_)));
        assert_eq!(
            a[1],
            Access::Read(match a[0] {
                Access::Write(b) | Access::Read(b) => b,
            })
        );
    }

    #[test]
    fn a_read_only_disk_is_only_read() {
        let (a, record) = run("disk=4M disk-read=0", Writable::ReadOnly, 100);
        assert!(a.iter().all(|a| matches!(a, Access::Read(_))));
        assert!(record.iter().all(|g| *g == 0));
    }

    #[test]
    fn flushes_follow_writes_at_their_interval() {
        assert!(!flush_due(FLUSH_INTERVAL_NS, 0, 0), "nothing written");
        assert!(!flush_due(FLUSH_INTERVAL_NS - 1, 0, 5));
        assert!(flush_due(FLUSH_INTERVAL_NS, 0, 5));
    }
}
