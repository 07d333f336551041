//! One descriptor chain of a split virtqueue, walked strictly (virtio 1.2 §2.7.5).
//!
//! Why not virtio-queue's `DescriptorChain` iterator: it bounds a chain (a budget of one queue
//! size, one level of indirection, a total length that fits a u32), which is right, but it ends
//! silently at a descriptor it cannot read and yields a loop's descriptors again and again
//! until the budget is spent. A device that *records* what a buffer describes (a balloon
//! hinting free pages) must tell a broken chain from a short one and must not count a range
//! twice, so chains are walked here and any defect refuses the whole chain. The rings
//! themselves (available and used) stay virtio-queue's.
//!
//! Invariants: a walk reads at most `queue size` descriptors, plus at most `queue size` more
//! from one indirect table, all through the tracked guest memory view (reads only); it never
//! loops, never allocates more than that many entries, and returns every descriptor with an
//! `addr + len` that does not wrap. It does not check that buffers lie in guest RAM: the device
//! reading or recording a buffer does that for the bytes it uses.

#![forbid(unsafe_code)]

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use crate::memory::TrackedMemory;

/// The driver may use indirect descriptor tables (virtio 1.2 §6, bit 28).
pub const VIRTIO_F_INDIRECT_DESC: u64 = 1 << 28;
/// `struct virtq_desc` is 16 bytes (virtio 1.2 §2.7.5).
const DESC_SIZE: u64 = 16;
/// Descriptor flags (virtio 1.2 §2.7.5).
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

/// One buffer of a chain: `len` bytes at guest address `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (an "in" buffer to the driver).
    pub writable: bool,
}

/// A walked chain: the head the driver made available, and its buffers in order (readable
/// ones first, as the spec requires of the driver).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub head: u16,
    pub descs: Vec<Desc>,
}

/// Why a chain was refused. Each is a driver bug (or a hostile driver); the device returns the
/// buffer unused and counts it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    #[error("descriptor {index} is outside its table of {size}")]
    Index { index: u16, size: u16 },
    #[error("the chain is longer than the {max} descriptors its table holds (a loop?)")]
    TooLong { max: u16 },
    #[error("the descriptor table entry at {gpa:#x} is not in guest RAM")]
    Unreadable { gpa: u64 },
    #[error("the buffer of {len} bytes at {addr:#x} wraps around the address space")]
    Wraps { addr: u64, len: u32 },
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    #[error("an indirect descriptor, but VIRTIO_F_INDIRECT_DESC was not negotiated")]
    IndirectNotNegotiated,
    #[error("an indirect descriptor inside an indirect table or with NEXT set")]
    IndirectNested,
    #[error("an indirect table of {len} bytes is not 1 to {max} whole descriptors")]
    IndirectSize { len: u32, max: u16 },
}

/// Walks the chain at `head` of the descriptor table at `table` (a queue of `size`), for a
/// driver that negotiated `features`.
pub fn walk(
    mem: &TrackedMemory,
    (table, size): (u64, u16),
    head: u16,
    features: u64,
) -> Result<Chain, ChainError> {
    let queue_size = size;
    let (mut table, mut size, mut index) = (table, size, head);
    let mut budget = size;
    let mut indirect = false;
    let mut descs = Vec::new();
    loop {
        if index >= size {
            return Err(ChainError::Index { index, size });
        }
        if budget == 0 {
            return Err(ChainError::TooLong { max: size });
        }
        budget -= 1;
        let gpa = table.checked_add(u64::from(index) * DESC_SIZE);
        let d: Descriptor = gpa
            .and_then(|gpa| mem.read_obj(GuestAddress(gpa)).ok())
            .ok_or(ChainError::Unreadable {
                gpa: gpa.unwrap_or(u64::MAX),
            })?;
        let flags = d.flags();
        if flags & F_INDIRECT != 0 {
            if features & VIRTIO_F_INDIRECT_DESC == 0 {
                return Err(ChainError::IndirectNotNegotiated);
            }
            if indirect || flags & F_NEXT != 0 {
                return Err(ChainError::IndirectNested);
            }
            let entries = u64::from(d.len()) / DESC_SIZE;
            if !u64::from(d.len()).is_multiple_of(DESC_SIZE)
                || entries == 0
                || entries > u64::from(queue_size)
            {
                return Err(ChainError::IndirectSize {
                    len: d.len(),
                    max: queue_size,
                });
            }
            (table, size, index) = (d.addr().0, entries as u16, 0);
            budget = size;
            indirect = true;
            continue;
        }
        let (addr, len) = (d.addr().0, d.len());
        if addr.checked_add(u64::from(len)).is_none() {
            return Err(ChainError::Wraps { addr, len });
        }
        let writable = flags & F_WRITE != 0;
        if !writable && descs.last().is_some_and(|p: &Desc| p.writable) {
            return Err(ChainError::ReadableAfterWritable);
        }
        descs.push(Desc {
            addr,
            len,
            writable,
        });
        if flags & F_NEXT == 0 {
            return Ok(Chain { head, descs });
        }
        index = d.next();
    }
}

impl Chain {
    /// Bytes the device may read.
    pub fn readable_len(&self) -> u64 {
        self.readable().map(|d| u64::from(d.len)).sum()
    }

    pub fn readable(&self) -> impl Iterator<Item = &Desc> {
        self.descs.iter().filter(|d| !d.writable)
    }

    pub fn writable(&self) -> impl Iterator<Item = &Desc> {
        self.descs.iter().filter(|d| d.writable)
    }

    /// The first `max` readable bytes (fewer if the chain has fewer), read from guest RAM;
    /// `None` if any of them is not RAM.
    pub fn read(&self, mem: &TrackedMemory, max: usize) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(max.min(self.readable_len() as usize));
        for d in self.readable() {
            let take = (d.len as usize).min(max - out.len());
            let at = out.len();
            out.resize(at + take, 0);
            mem.read_slice(&mut out[at..], GuestAddress(d.addr)).ok()?;
            if out.len() == max {
                break;
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;

    const TABLE: u64 = 0x1000;
    const SIZE: u16 = 8;

    fn put(ram: &GuestRam, table: u64, i: u16, (addr, len, flags, next): (u64, u32, u16, u16)) {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..].copy_from_slice(&next.to_le_bytes());
        ram.write(table + u64::from(i) * DESC_SIZE, &b).unwrap();
    }

    fn walk0(ram: &GuestRam, features: u64) -> Result<Chain, ChainError> {
        walk(ram.memory(), (TABLE, SIZE), 0, features)
    }

    #[test]
    fn a_well_formed_chain_is_returned_in_order() {
        let ram = GuestRam::new(64 << 20).unwrap();
        put(&ram, TABLE, 0, (0x8000, 4, F_NEXT, 3));
        put(&ram, TABLE, 3, (0x9000, 4096, F_WRITE, 0));
        let c = walk0(&ram, 0).unwrap();
        assert_eq!(c.head, 0);
        assert_eq!(c.descs.len(), 2);
        assert_eq!(c.readable_len(), 4);
        assert_eq!(c.writable().next().unwrap().addr, 0x9000);
        ram.write(0x8000, &7u32.to_le_bytes()).unwrap();
        assert_eq!(c.read(ram.memory(), 16).unwrap(), 7u32.to_le_bytes());
    }

    #[test]
    fn loops_long_chains_and_bad_indices_are_refused() {
        let ram = GuestRam::new(64 << 20).unwrap();
        put(&ram, TABLE, 0, (0x8000, 4, F_NEXT | F_WRITE, 0));
        assert_eq!(walk0(&ram, 0), Err(ChainError::TooLong { max: SIZE }));
        put(&ram, TABLE, 0, (0x8000, 4, F_NEXT | F_WRITE, SIZE));
        assert_eq!(
            walk0(&ram, 0),
            Err(ChainError::Index {
                index: SIZE,
                size: SIZE
            })
        );
        assert!(walk(ram.memory(), (TABLE, SIZE), SIZE, 0).is_err());
        assert!(matches!(
            walk(ram.memory(), (0xffff_ffff_ffff_fff0, SIZE), 1, 0),
            Err(ChainError::Unreadable { .. })
        ));
        assert!(matches!(
            walk(ram.memory(), (64 << 20, SIZE), 0, 0),
            Err(ChainError::Unreadable { .. })
        ));
        put(&ram, TABLE, 0, (u64::MAX - 2, 4, F_WRITE, 0));
        assert!(matches!(walk0(&ram, 0), Err(ChainError::Wraps { .. })));
        put(&ram, TABLE, 0, (0x8000, 4, F_WRITE | F_NEXT, 1));
        put(&ram, TABLE, 1, (0x9000, 4, 0, 0));
        assert_eq!(walk0(&ram, 0), Err(ChainError::ReadableAfterWritable));
    }

    #[test]
    fn indirect_tables_only_when_negotiated_and_in_bounds() {
        let ram = GuestRam::new(64 << 20).unwrap();
        let indirect = 0x2000;
        put(&ram, TABLE, 0, (indirect, 2 * 16, F_INDIRECT, 0));
        put(&ram, indirect, 0, (0x8000, 4, F_NEXT, 1));
        put(&ram, indirect, 1, (0x9000, 8, F_WRITE, 0));
        assert_eq!(walk0(&ram, 0), Err(ChainError::IndirectNotNegotiated));
        let c = walk0(&ram, VIRTIO_F_INDIRECT_DESC).unwrap();
        assert_eq!(c.descs.len(), 2);

        for (addr, len) in [(indirect, 17), (indirect, 0), (indirect, 16 * 9)] {
            put(&ram, TABLE, 0, (addr, len, F_INDIRECT, 0));
            assert!(matches!(
                walk0(&ram, VIRTIO_F_INDIRECT_DESC),
                Err(ChainError::IndirectSize { .. })
            ));
        }
        put(&ram, TABLE, 0, (1 << 40, 32, F_INDIRECT, 0));
        assert!(matches!(
            walk0(&ram, VIRTIO_F_INDIRECT_DESC),
            Err(ChainError::Unreadable { .. })
        ));
        put(&ram, TABLE, 0, (indirect, 32, F_INDIRECT | F_NEXT, 1));
        assert_eq!(
            walk0(&ram, VIRTIO_F_INDIRECT_DESC),
            Err(ChainError::IndirectNested)
        );
        put(&ram, TABLE, 0, (indirect, 32, F_INDIRECT, 0));
        put(&ram, indirect, 1, (indirect, 16, F_INDIRECT, 0));
        assert_eq!(
            walk0(&ram, VIRTIO_F_INDIRECT_DESC),
            Err(ChainError::IndirectNested)
        );
        put(&ram, indirect, 1, (0x9000, 8, F_WRITE | F_NEXT, 0));
        assert_eq!(
            walk0(&ram, VIRTIO_F_INDIRECT_DESC),
            Err(ChainError::TooLong { max: 2 }),
            "a loop inside an indirect table"
        );
    }
}
