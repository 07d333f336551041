//! Where the generation records (the working set's, then the disk's) and the working set go,
//! given the RAM ranges of the memory map. The host sizes guests with [`ferry_guest_abi::layout`]; this is the guest's side of
//! the same arithmetic, with the actual ranges.

use ferry_guest_abi::PAGE_SIZE;
use ferry_guest_abi::layout::{Footprint, MAX_EXTENTS};

/// A run of working-set pages: indices `first_index..first_index + pages` live at frames
/// `first_pfn..first_pfn + pages`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    pub first_index: u64,
    pub first_pfn: u64,
    pub pages: u64,
}

/// The guest's placement of its record and working set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Guest-physical address of the `u32` generation record, one entry per working-set page.
    pub record: u64,
    pub extents: [Extent; MAX_EXTENTS],
    pub extent_count: usize,
    pub pages: u64,
    /// Guest-physical address of the disk's `u32` generation record (one entry per 4 KiB
    /// block of `disk=`), right after the working set's records; the boot vCPU's, whole in
    /// every vCPU's share.
    pub disk_record: u64,
    /// First byte after all the records.
    pub records_end: u64,
}

/// Why no plan fits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// `needed` bytes were asked for but only `free` are available.
    NotEnoughMemory { needed: u64, free: u64 },
    /// The working set would span more than [`MAX_EXTENTS`] RAM ranges.
    TooFragmented,
}

/// Bytes of `ranges` (half-open `(start, end)` pairs in address order) at or above `floor`,
/// counted in whole pages.
pub fn free_bytes(ranges: &[(u64, u64)], floor: u64) -> u64 {
    clipped(ranges, floor).map(|(s, e)| e - s).sum()
}

/// Places what `f` asks for in `ranges` above `floor`: its generation records (one, or one per
/// vCPU that shares the pages, then the disk's) in one range, and the working set.
pub fn plan(ranges: &[(u64, u64)], floor: u64, f: Footprint) -> Result<Plan, PlanError> {
    let ws_bytes = f.ws_bytes;
    let record_bytes = f.record_bytes();
    let needed = record_bytes + ws_bytes;
    let free = free_bytes(ranges, floor);
    let not_enough = PlanError::NotEnoughMemory { needed, free };
    let (rs, _) = clipped(ranges, floor)
        .find(|(s, e)| e - s >= record_bytes)
        .ok_or(not_enough)?;
    let mut plan = Plan {
        record: rs,
        pages: ws_bytes / PAGE_SIZE,
        disk_record: rs + f.records * ferry_guest_abi::layout::record_bytes(ws_bytes),
        records_end: rs + record_bytes,
        ..Plan::default()
    };
    let mut index = 0;
    for (mut s, e) in clipped(ranges, floor) {
        if s == rs {
            s += record_bytes;
        }
        let pages = ((e - s) / PAGE_SIZE).min(plan.pages - index);
        if pages == 0 {
            continue;
        }
        if plan.extent_count == MAX_EXTENTS {
            return Err(PlanError::TooFragmented);
        }
        plan.extents[plan.extent_count] = Extent {
            first_index: index,
            first_pfn: s / PAGE_SIZE,
            pages,
        };
        plan.extent_count += 1;
        index += pages;
        if index == plan.pages {
            return Ok(plan);
        }
    }
    Err(not_enough)
}

impl Plan {
    /// The frame of working-set page `index` (which must be below `self.pages`).
    #[inline(always)]
    pub fn pfn(&self, index: u64) -> u64 {
        let mut i = 0;
        while i + 1 < self.extent_count && index >= self.extents[i + 1].first_index {
            i += 1;
        }
        let e = &self.extents[i];
        e.first_pfn + (index - e.first_index)
    }

    /// First byte after everything the plan placed: the records and the working set.
    pub fn end(&self) -> u64 {
        self.extents()
            .iter()
            .map(|e| (e.first_pfn + e.pages) * PAGE_SIZE)
            .fold(self.records_end, u64::max)
    }

    pub fn extents(&self) -> &[Extent] {
        &self.extents[..self.extent_count]
    }

    /// vCPU `k`'s view when every vCPU writes every page (`shared=1`): the whole working set,
    /// with the `k`th of the records the plan placed.
    pub fn lane(&self, k: u64) -> Plan {
        Plan {
            record: self.record + k * ferry_guest_abi::layout::record_bytes(self.pages * PAGE_SIZE),
            ..*self
        }
    }

    /// vCPU `k`'s share of `n`: the pages with indices `pages * k / n .. pages * (k + 1) / n`,
    /// as a plan of their own (indices from 0, its record the matching slice of this one's),
    /// so a vCPU runs the one-vCPU workload on it unchanged and no two vCPUs share a page.
    pub fn share(&self, k: u64, n: u64) -> Plan {
        let (lo, hi) = (self.pages * k / n, self.pages * (k + 1) / n);
        let mut share = Plan {
            record: self.record + lo * ferry_guest_abi::layout::RECORD_ENTRY_BYTES,
            pages: hi - lo,
            disk_record: self.disk_record,
            records_end: self.records_end,
            ..Plan::default()
        };
        for e in self.extents() {
            let (s, t) = (e.first_index.max(lo), (e.first_index + e.pages).min(hi));
            if s < t {
                share.extents[share.extent_count] = Extent {
                    first_index: s - lo,
                    first_pfn: e.first_pfn + (s - e.first_index),
                    pages: t - s,
                };
                share.extent_count += 1;
            }
        }
        share
    }
}

fn clipped(ranges: &[(u64, u64)], floor: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    ranges.iter().filter_map(move |&(s, e)| {
        let s = s.max(floor).next_multiple_of(PAGE_SIZE);
        let e = e / PAGE_SIZE * PAGE_SIZE;
        (s < e).then_some((s, e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;
    const GB: u64 = 1 << 30;

    /// The footprint of a working set of `ws_bytes` with `records` records and no disk.
    fn ws(ws_bytes: u64, records: u64) -> Footprint {
        Footprint {
            ws_bytes,
            records,
            disk_bytes: 0,
        }
    }

    #[test]
    fn small_guest_gets_one_extent_after_the_record() {
        let ranges = [(0, 0x9fc00), (MB, 64 * MB)];
        let p = plan(&ranges, 3 * MB, ws(16 * MB, 1)).unwrap();
        assert_eq!(p.record, 3 * MB);
        assert_eq!(
            p.extents(),
            &[Extent {
                first_index: 0,
                first_pfn: (3 * MB + 16 * 1024) / PAGE_SIZE,
                pages: 4096
            }]
        );
        assert_eq!(p.pfn(4095), p.extents[0].first_pfn + 4095);
    }

    #[test]
    fn working_set_continues_above_the_hole() {
        let ranges = [(MB, 3 * GB), (4 * GB, 6 * GB)];
        let p = plan(&ranges, 2 * MB, ws(4 * GB, 1)).unwrap();
        assert_eq!(p.extent_count, 2);
        assert_eq!(p.end(), 4 * GB + p.extents[1].pages * PAGE_SIZE);
        let low = p.extents[0].pages;
        assert_eq!(p.pfn(low - 1), p.extents[0].first_pfn + low - 1);
        assert_eq!(p.pfn(low), 4 * GB / PAGE_SIZE);
        assert_eq!(p.extents[1].pages + low, 4 * GB / PAGE_SIZE);
    }

    #[test]
    fn too_big_a_working_set_is_refused_with_the_numbers() {
        let ranges = [(MB, 64 * MB)];
        assert_eq!(
            plan(&ranges, 2 * MB, ws(256 * MB, 1)),
            Err(PlanError::NotEnoughMemory {
                needed: 256 * MB + 256 * 1024,
                free: 62 * MB
            })
        );
    }

    #[test]
    fn floor_and_unaligned_ranges_are_respected() {
        let ranges = [(0x1234, 0x9fc00), (MB + 1, 8 * MB - 1)];
        assert_eq!(free_bytes(&ranges, 2 * MB), 6 * MB - PAGE_SIZE);
        assert_eq!(
            free_bytes(&ranges, 0),
            0x9f000 - 0x2000 + 7 * MB - 2 * PAGE_SIZE
        );
    }

    #[test]
    fn shares_split_the_working_set_without_overlap_and_keep_their_records() {
        let ranges = [(MB, 3 * GB), (4 * GB, 6 * GB)];
        let p = plan(&ranges, 2 * MB, ws(4 * GB, 1)).unwrap();
        let n = 7;
        let mut next_index = 0;
        for k in 0..n {
            let share = p.share(k, n);
            assert_eq!(
                share.record,
                p.record + next_index * ferry_guest_abi::layout::RECORD_ENTRY_BYTES
            );
            for i in [0, share.pages / 2, share.pages - 1] {
                assert_eq!(share.pfn(i), p.pfn(next_index + i), "vCPU {k} page {i}");
            }
            assert_eq!(share.extents()[0].first_index, 0);
            next_index += share.pages;
        }
        assert_eq!(next_index, p.pages);
        assert_eq!(
            p.share(2, 3).extent_count,
            2,
            "the last share spans the hole"
        );
        assert_eq!(p.share(0, 1), p);
    }

    #[test]
    fn records_for_shared_pages_come_one_after_another_before_the_working_set() {
        let ranges = [(MB, 64 * MB)];
        let p = plan(&ranges, 2 * MB, ws(16 * MB, 4)).unwrap();
        assert_eq!(p.extents[0].first_pfn * PAGE_SIZE, 2 * MB + 4 * 16 * 1024);
        assert_eq!(p.lane(3).record, 2 * MB + 3 * 16 * 1024);
        assert_eq!((p.lane(3).pages, p.lane(3).extents), (p.pages, p.extents));
    }

    #[test]
    fn the_disk_record_follows_the_working_sets_records() {
        let ranges = [(MB, 64 * MB)];
        let f = Footprint {
            disk_bytes: 2 * GB,
            ..ws(16 * MB, 2)
        };
        let p = plan(&ranges, 2 * MB, f).unwrap();
        assert_eq!(p.disk_record, 2 * MB + 2 * 16 * 1024);
        assert_eq!(p.records_end, p.disk_record + 2 * MB);
        assert_eq!(p.extents[0].first_pfn * PAGE_SIZE, p.records_end);
        assert_eq!(p.end(), p.records_end + 16 * MB);
        assert_eq!(p.share(1, 2).disk_record, p.disk_record);
        let huge = Footprint {
            disk_bytes: 64 * GB,
            ..f
        };
        assert!(matches!(
            plan(&ranges, 2 * MB, huge),
            Err(PlanError::NotEnoughMemory { .. })
        ));
    }

    #[test]
    fn many_small_ranges_are_too_fragmented() {
        let ranges: [(u64, u64); 6] = core::array::from_fn(|i| {
            let s = (i as u64 + 1) * 16 * MB;
            (s, s + 8 * MB)
        });
        assert_eq!(
            plan(&ranges, 0, ws(40 * MB, 1)),
            Err(PlanError::TooFragmented)
        );
    }
}
