//! The record of the VMM's own writes to guest memory: vm-memory's [`Bitmap`] trait over the
//! engine's [`PageBits`] (a bit per 4 KiB page and a summary bit per 64 pages), so that taking
//! what was written costs what was written, not what RAM is configured with: a 512 GiB guest
//! has 16 MiB of page bits but 256 KiB of summary, and a take walks the summary and swaps only
//! the words it names. A write sets its bits after its bytes landed (vm-memory marks after
//! the copy), which is the order a migration needs.

use ferry_migrate::pagebits::{PageBits, TakenWords};
use vm_memory::bitmap::{Bitmap, NewBitmap, RefSlice, WithBitmapSlice};

const PAGE: usize = ferry_guest_abi::PAGE_SIZE as usize;

/// Written pages of one guest memory region.
#[derive(Debug)]
pub struct WriteBitmap(PageBits);

impl WriteBitmap {
    /// A bitmap for `bytes` of guest memory (rounded up to whole pages).
    pub fn new(bytes: usize) -> WriteBitmap {
        WriteBitmap(PageBits::new(bytes.div_ceil(PAGE) as u64))
    }

    /// Takes every page written since the last take, clearing it.
    pub fn take(&self) -> TakenWords {
        self.0.take()
    }
}

impl Default for WriteBitmap {
    fn default() -> Self {
        WriteBitmap::new(0)
    }
}

impl<'a> WithBitmapSlice<'a> for WriteBitmap {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for WriteBitmap {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let (first, last) = (offset / PAGE, (offset + len - 1) / PAGE);
        self.0.set_range(first as u64, (last - first + 1) as u64);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        let page = (offset / PAGE) as u64;
        page < self.0.len() && self.0.get(page)
    }

    fn slice_at(&self, offset: usize) -> <Self as WithBitmapSlice<'_>>::S {
        RefSlice::new(self, offset)
    }
}

impl NewBitmap for WriteBitmap {
    fn with_len(len: usize) -> Self {
        WriteBitmap::new(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_mark_every_page_they_touch_and_a_take_clears_them() {
        let b = WriteBitmap::new(100 * PAGE);
        b.mark_dirty(5 * PAGE + 100, 1);
        b.mark_dirty(63 * PAGE + 1, PAGE); // pages 63 and 64
        b.mark_dirty(98 * PAGE, 10 * PAGE); // clipped at page 99
        b.mark_dirty(3 * PAGE, 0);
        assert!(b.dirty_at(64 * PAGE) && !b.dirty_at(65 * PAGE) && !b.dirty_at(3 * PAGE));
        assert!(!b.dirty_at(500 * PAGE), "past the end");
        let taken = b.take();
        assert_eq!(
            taken,
            vec![(0, (1 << 5) | (1 << 63)), (1, 1 | (0b11 << 34))]
        );
        assert_eq!(b.take(), Vec::new());
    }
}
