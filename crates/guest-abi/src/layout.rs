//! How the guest lays out the RAM it is given, so the host can tell before boot whether a
//! working set fits and where the guest will put it.
//!
//! Above the end of its own image the guest takes, in address order from the RAM entries of
//! the PVH memory map: the page-directory pages that map RAM above 4 GiB (at CPL0), then the
//! generation record (one `u32` per working-set page, contiguous; one per vCPU with
//! `shared=1`), then the working set itself,
//! which may span up to [`MAX_EXTENTS`] RAM ranges (below the 32-bit MMIO hole and above it).

use crate::PAGE_SIZE;

/// Most RAM ranges the working set may span. A PC memory map has RAM below the MMIO hole and
/// above 4 GiB; four leaves room for firmware that splits either.
pub const MAX_EXTENTS: usize = 4;

/// Lowest address the guest takes memory from: RAM below 1 MiB holds the boot data (PVH
/// start_info, memory map, command line) and legacy firmware areas.
pub const LOW_RAM_END: u64 = 1 << 20;

/// Identity mapping granule: one page-directory entry maps 2 MiB.
pub const LARGE_PAGE: u64 = 2 << 20;

/// Highest guest-physical address the guest maps: one PML4 entry (512 GiB), which keeps the
/// page-table setup at CPL0 to a page of PDPT plus one page directory per GiB.
pub const MAX_RAM_TOP: u64 = 512 << 30;

/// Bytes of one working-set page's entry in the generation record (a `u32`).
pub const RECORD_ENTRY_BYTES: u64 = 4;

/// Bytes of the generation record for a working set of `ws_bytes`.
pub fn record_bytes(ws_bytes: u64) -> u64 {
    (ws_bytes / PAGE_SIZE * RECORD_ENTRY_BYTES).next_multiple_of(PAGE_SIZE)
}

/// Page-directory pages the guest allocates to map RAM between 4 GiB and `ram_top` (RAM below
/// 4 GiB is mapped by directories inside the image).
pub fn high_page_directories(ram_top: u64) -> u64 {
    ram_top.saturating_sub(4 << 30).div_ceil(1 << 30)
}

/// Bytes the guest needs above its image for a working set of `ws_bytes` with `records`
/// generation records (one, or one per vCPU with `shared=1`) when RAM ends at `ram_top`.
pub fn required_bytes(ws_bytes: u64, records: u64, ram_top: u64) -> u64 {
    high_page_directories(ram_top) * PAGE_SIZE + records * record_bytes(ws_bytes) + ws_bytes
}

/// The working set used when `ws=` is not given, for `free` bytes of RAM above the image:
/// [`crate::params::DEFAULT_WORKING_SET`], or less on a small guest so the record and some
/// headroom still fit.
pub fn default_working_set(free: u64) -> u64 {
    let half = free / 2 / PAGE_SIZE * PAGE_SIZE;
    crate::params::DEFAULT_WORKING_SET.min(half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_is_four_bytes_per_page_rounded_to_pages() {
        assert_eq!(record_bytes(256 << 20), 256 << 10);
        assert_eq!(record_bytes(PAGE_SIZE), PAGE_SIZE);
    }

    #[test]
    fn page_directories_cover_ram_above_4g() {
        assert_eq!(high_page_directories(2 << 30), 0);
        assert_eq!(high_page_directories(4 << 30), 0);
        assert_eq!(high_page_directories((4 << 30) + 1), 1);
        assert_eq!(high_page_directories(65 << 30), 61);
    }

    #[test]
    fn default_working_set_shrinks_on_small_guests() {
        assert_eq!(default_working_set(4 << 30), 256 << 20);
        assert_eq!(default_working_set(60 << 20), 30 << 20);
        assert_eq!(default_working_set(0), 0);
    }
}
