//! How the guest lays out the RAM it is given, so the host can tell before boot whether a
//! working set fits and where the guest will put it.
//!
//! Above the end of its own image the guest takes, in address order from the RAM entries of
//! the PVH memory map: the page-directory pages that map RAM above 4 GiB (at CPL0), then the
//! generation record (one `u32` per working-set page, contiguous; one per vCPU with
//! `shared=1`), right after it the disk's generation record (one `u32` per 4 KiB block of
//! `disk=`, none without a disk workload), then the working set itself,
//! which may span up to [`MAX_EXTENTS`] RAM ranges (below the 32-bit MMIO hole and above it).
//! The records are guest RAM like the working set, so they migrate with the VM: a destination
//! guest knows which generation each page and block must hold.

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

/// Bytes of the disk's generation record for a disk workload of `disk_bytes` (`disk=`): a
/// `u32` per 4 KiB block, as a page's entry.
pub fn disk_record_bytes(disk_bytes: u64) -> u64 {
    (disk_bytes / crate::disk::BLOCK_SIZE * RECORD_ENTRY_BYTES).next_multiple_of(PAGE_SIZE)
}

/// What the guest keeps in RAM above its image besides page tables, from its command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Working-set bytes.
    pub ws_bytes: u64,
    /// Generation records of the working set: one, or one per vCPU with `shared=1`.
    pub records: u64,
    /// Bytes of the disk the disk workload uses (`disk=`), whose record is in RAM too.
    pub disk_bytes: u64,
}

impl Footprint {
    /// The footprint of `p` with a working set of `ws_bytes` (`ws=`, or the default).
    pub fn of(p: &crate::params::Params, ws_bytes: u64) -> Footprint {
        Footprint {
            ws_bytes,
            records: p.records(),
            disk_bytes: p.disk,
        }
    }

    /// Bytes of all the records, contiguous: the working set's, then the disk's.
    pub fn record_bytes(&self) -> u64 {
        self.records * record_bytes(self.ws_bytes) + disk_record_bytes(self.disk_bytes)
    }
}

/// Page-directory pages the guest allocates to map RAM between 4 GiB and `ram_top` (RAM below
/// 4 GiB is mapped by directories inside the image).
pub fn high_page_directories(ram_top: u64) -> u64 {
    ram_top.saturating_sub(4 << 30).div_ceil(1 << 30)
}

/// Bytes the guest needs above its image for `f` (its working set, the records of it and of
/// the disk) when RAM ends at `ram_top`.
pub fn required_bytes(f: Footprint, ram_top: u64) -> u64 {
    high_page_directories(ram_top) * PAGE_SIZE + f.record_bytes() + f.ws_bytes
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
    fn the_disk_record_is_counted_beside_the_working_sets() {
        assert_eq!(disk_record_bytes(0), 0);
        assert_eq!(disk_record_bytes(4096), PAGE_SIZE);
        // 2 GiB of 4 KiB blocks: 512 Ki entries of 4 bytes.
        assert_eq!(disk_record_bytes(2 << 30), 2 << 20);
        let p = crate::params::parse("vcpus=4 shared=1 disk=2G").unwrap();
        let f = Footprint::of(&p, 256 << 20);
        assert_eq!(f.record_bytes(), 4 * (256 << 10) + (2 << 20));
        assert_eq!(
            required_bytes(f, 6 << 30),
            2 * PAGE_SIZE + (1 << 20) + (2 << 20) + (256 << 20)
        );
        let none = Footprint::default();
        assert_eq!(required_bytes(none, 2 << 30), 0);
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
