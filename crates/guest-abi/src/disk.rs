//! The disk block stamp: what a 4 KiB block of the guest's disk workload (`disk=`) holds after
//! a write, and the check that tells a good block from a stale, misplaced, zeroed or corrupt
//! one. Pure, so the guest and any host-side tool that reads a disk image agree on it.
//!
//! Block `n` after its `generation`-th write holds the stamp `n << 32 | generation` in word 0
//! and [`block_word`]`(stamp, i)` in word `i` (1..512): every word depends on the block number
//! and the generation, so a block that a migration lost (an older generation), wrote to the
//! wrong place (another number) or tore (some words of another write) is caught whichever
//! word it shows. Generation 0 means never written, as for pages
//! ([`crate::stamp::NEVER_WRITTEN`]): what such a block holds is unknown (the image may
//! come from an earlier run), so it is never checked.

use crate::stamp::{NEVER_WRITTEN, fill_word};

/// Bytes of a block the workload writes: a page, so a block is a page-sized buffer in the
/// guest and a whole number of the 512-byte sectors virtio-blk counts in.
pub const BLOCK_SIZE: u64 = crate::PAGE_SIZE;
/// 64-bit words in a block.
pub const BLOCK_WORDS: usize = (BLOCK_SIZE / 8) as usize;
/// Sectors (virtio-blk's 512-byte unit) in a block.
pub const SECTORS_PER_BLOCK: u64 = BLOCK_SIZE / crate::virtio::blk::SECTOR_SIZE;

/// Mixed into the words after the stamp, so that a disk block never reads as a memory page
/// of `fill=random` with the same stamp (a page copied to the disk by mistake is misplaced).
const DISK_SALT: u64 = 0x6469_736b_626c_6b00; // "diskblk\0"

/// Word 0 of block `block` after the write of `generation` (non-zero).
pub fn block_stamp(block: u64, generation: u32) -> u64 {
    block << 32 | u64::from(generation)
}

/// Word `i` (1..512) of a block whose stamp is `stamp`.
#[inline(always)]
pub fn block_word(stamp: u64, i: usize) -> u64 {
    fill_word(stamp ^ DISK_SALT, i as u64)
}

/// Fills `out` with what block `block` holds after the write of `generation`.
pub fn fill_block(block: u64, generation: u32, out: &mut [u64; BLOCK_WORDS]) {
    let stamp = block_stamp(block, generation);
    out[0] = stamp;
    for (i, w) in out.iter_mut().enumerate().skip(1) {
        *w = block_word(stamp, i);
    }
}

/// What a block read back holds, against the generation the guest recorded for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockCheck {
    /// Its last write, whole (or a block never written, which is not checked).
    Good,
    /// Zeros where a write was made: a block the disk never got.
    Zero,
    /// This block's stamp, but of another generation: a write lost (an older one) or the
    /// guest's record gone back (a newer one).
    Stale { generation: u32 },
    /// Another block's stamp: data at the wrong place.
    Misplaced { block: u64, generation: u32 },
    /// The right stamp with a wrong word after it (`word` the first): a torn or corrupted
    /// block.
    Corrupt { word: usize },
}

/// Checks what block `block` holds (`data`) against its recorded `generation`.
pub fn check_block(block: u64, generation: u32, data: &[u64; BLOCK_WORDS]) -> BlockCheck {
    if generation == NEVER_WRITTEN {
        return BlockCheck::Good;
    }
    let (found_block, found_gen) = (data[0] >> 32, data[0] as u32);
    if data[0] == 0 {
        return match data.iter().all(|w| *w == 0) {
            true => BlockCheck::Zero,
            false => BlockCheck::Corrupt { word: 0 },
        };
    }
    if found_block != block {
        return BlockCheck::Misplaced {
            block: found_block,
            generation: found_gen,
        };
    }
    if found_gen != generation {
        return BlockCheck::Stale {
            generation: found_gen,
        };
    }
    match (1..BLOCK_WORDS).find(|&i| data[i] != block_word(data[0], i)) {
        Some(word) => BlockCheck::Corrupt { word },
        None => BlockCheck::Good,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(n: u64, generation: u32) -> [u64; BLOCK_WORDS] {
        let mut b = [0; BLOCK_WORDS];
        fill_block(n, generation, &mut b);
        b
    }

    #[test]
    fn a_block_checks_against_its_own_generation_only() {
        let b = block(7, 3);
        assert_eq!(b[0], 7 << 32 | 3);
        assert_eq!(check_block(7, 3, &b), BlockCheck::Good);
        assert_eq!(
            check_block(7, 4, &b),
            BlockCheck::Stale { generation: 3 },
            "the next write was lost"
        );
        assert_eq!(
            check_block(8, 3, &b),
            BlockCheck::Misplaced {
                block: 7,
                generation: 3
            }
        );
        assert_eq!(check_block(7, 1, &[0; BLOCK_WORDS]), BlockCheck::Zero);
    }

    #[test]
    fn a_never_written_block_is_not_checked() {
        assert_eq!(
            check_block(7, NEVER_WRITTEN, &block(9, 9)),
            BlockCheck::Good
        );
        assert_eq!(
            check_block(7, NEVER_WRITTEN, &[0; BLOCK_WORDS]),
            BlockCheck::Good
        );
    }

    #[test]
    fn any_torn_word_is_found() {
        for word in [1, 2, 255, BLOCK_WORDS - 1] {
            let mut b = block(5, 2);
            // Half a block of the previous write: the tail of a torn write.
            b[word] = block(5, 1)[word];
            assert_eq!(check_block(5, 2, &b), BlockCheck::Corrupt { word });
        }
        let mut b = [0; BLOCK_WORDS];
        b[100] = 1;
        assert_eq!(check_block(5, 2, &b), BlockCheck::Corrupt { word: 0 });
    }

    #[test]
    fn words_depend_on_block_and_generation() {
        let (a, b, c) = (block(1, 1), block(2, 1), block(1, 2));
        assert!((1..BLOCK_WORDS).all(|i| a[i] != b[i] && a[i] != c[i]));
        assert!((2..BLOCK_WORDS).all(|i| a[i] != a[i - 1]));
        // Not a `fill=random` page of the same stamp.
        let page_word = crate::stamp::fill_word(a[0], 1);
        assert_ne!(a[1], page_word);
        assert_eq!(SECTORS_PER_BLOCK, 8);
    }
}
