//! Balloon pages: PFN arrays (inflate, deflate), reported free ranges, and the one rule that
//! decides which guest bytes count as a page: whole 4 KiB pages inside guest RAM.
//!
//! Invariant: [`ram_pages`] yields only page-aligned ranges that lie inside one RAM region, so
//! nothing here punches or records a byte that is not guest RAM, whatever the driver sent.

#![forbid(unsafe_code)]

use super::spec::BalloonCounters;
use crate::devices::virtio::chain::Chain;
use crate::memory::GuestRam;

/// A balloon page: PFNs and hinted or reported ranges count 4 KiB pages whatever the guest's
/// own page size (virtio 1.2 §5.5.6: `VIRTIO_BALLOON_PFN_SHIFT` is 12).
pub const PAGE: u64 = 4096;
/// The largest PFN array read from one buffer. Linux sends at most 256 PFNs per buffer
/// (`VIRTIO_BALLOON_ARRAY_PFNS_MAX`, 1 KiB); 64 times that leaves room for other drivers and
/// bounds what a hostile driver makes the device copy.
const MAX_PFN_BYTES: usize = 64 << 10;

/// The whole pages of `[gpa, gpa + len)` that are guest RAM, one range per RAM region it
/// touches: its start rounded up and its end rounded down to a page, the parts in the MMIO hole
/// or beyond RAM cut off. An `gpa + len` past the address space ends at the top of it.
pub fn ram_pages(ram: &GuestRam, gpa: u64, len: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
    let end = gpa.saturating_add(len);
    ram.regions().iter().filter_map(move |r| {
        let start = gpa.max(r.gpa).checked_next_multiple_of(PAGE)?;
        let stop = end.min(r.gpa + r.size) & !(PAGE - 1);
        (start < stop).then(|| (start, stop - start))
    })
}

/// Consecutive pages gathered into runs, so one `punch_hole` covers a run.
#[derive(Debug, Default)]
struct Runs {
    run: Option<(u64, u64)>,
}

impl Runs {
    /// Adds the page at `gpa`; returns the run it ended, if it did not extend it.
    fn push(&mut self, gpa: u64) -> Option<(u64, u64)> {
        match &mut self.run {
            Some((start, len)) if *start + *len == gpa => {
                *len += PAGE;
                None
            }
            run => run.replace((gpa, PAGE)),
        }
    }
}

/// Inflate or deflate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Inflate,
    Deflate,
}

/// What the page buffers change: the balloon's counters, and whether pages may go back to the
/// host now (`Balloon::may_discard`).
#[derive(Debug)]
pub(super) struct PageBuffers<'a> {
    pub(super) counters: &'a mut BalloonCounters,
    pub(super) may_discard: bool,
}

impl PageBuffers<'_> {
    /// Gives `[gpa, gpa + len)` (whole pages in one RAM region) back to the host.
    fn discard(&mut self, ram: &GuestRam, (gpa, len): (u64, u64)) {
        match ram.punch_hole(gpa, len) {
            Ok(()) => self.counters.discarded_pages += len / PAGE,
            Err(e) => tracing::warn!("virtio-balloon: cannot discard {len} bytes at {gpa:#x}: {e}"),
        }
    }

    pub(super) fn inflate(&mut self, chain: &Chain, ram: &GuestRam) {
        self.pfns(chain, ram, Direction::Inflate);
    }

    pub(super) fn deflate(&mut self, chain: &Chain, ram: &GuestRam) {
        self.pfns(chain, ram, Direction::Deflate);
    }

    /// One buffer of le32 PFNs. Deflation is only counted (MUST_TELL_HOST is not offered, so
    /// the guest may touch deflated pages at once, and a touched hole simply fills again).
    fn pfns(&mut self, chain: &Chain, ram: &GuestRam, direction: Direction) {
        let bytes = match chain.readable_len() {
            n if n > MAX_PFN_BYTES as u64 => None,
            n => chain.read(ram.memory(), n as usize),
        };
        let Some(bytes) = bytes else {
            tracing::warn!("virtio-balloon: a PFN buffer is too large or not in guest RAM");
            self.counters.malformed_buffers += 1;
            return;
        };
        let discard = direction == Direction::Inflate && self.may_discard;
        let mut runs = Runs::default();
        for pfn in bytes.chunks_exact(4) {
            let gpa = u64::from(u32::from_le_bytes(pfn.try_into().unwrap())) * PAGE;
            if ram_pages(ram, gpa, PAGE).next().is_none() {
                self.counters.ignored_pfns += 1;
                continue;
            }
            match direction {
                Direction::Inflate => self.counters.inflated_pages += 1,
                Direction::Deflate => self.counters.deflated_pages += 1,
            }
            if discard && let Some(run) = runs.push(gpa) {
                self.discard(ram, run);
            }
        }
        if let Some(run) = runs.run {
            self.discard(ram, run);
        }
    }

    /// One buffer of free page reporting (virtio 1.2 §5.5.6.6): each device-writable
    /// descriptor is a free range; its whole pages in RAM are counted and, when allowed, given
    /// back. Readable descriptors mean nothing here and are skipped.
    pub(super) fn report(&mut self, chain: &Chain, ram: &GuestRam) {
        let discard = self.may_discard;
        for d in chain.writable() {
            for range in ram_pages(ram, d.addr, d.len.into()) {
                self.counters.reported_pages += range.1 / PAGE;
                if discard {
                    self.discard(ram, range);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_cut_to_whole_pages_of_ram() {
        let ram = GuestRam::new(64 << 20).unwrap();
        let top = 64 << 20;
        assert_eq!(
            ram_pages(&ram, 0x1000, 0x2000).collect::<Vec<_>>(),
            [(0x1000, 0x2000)]
        );
        assert_eq!(
            ram_pages(&ram, 0x1001, 0x2000).collect::<Vec<_>>(),
            [(0x2000, 0x1000)]
        );
        assert_eq!(
            ram_pages(&ram, 0x1001, 0x1ffe).count(),
            0,
            "no whole page inside"
        );
        assert_eq!(
            ram_pages(&ram, 0x1001, 0x1fff).collect::<Vec<_>>(),
            [(0x2000, 0x1000)]
        );
        assert_eq!(
            ram_pages(&ram, top - 0x1000, 0x10000).collect::<Vec<_>>(),
            [(top - 0x1000, 0x1000)],
            "cut at the end of RAM"
        );
        assert_eq!(ram_pages(&ram, u64::MAX - 0x10, 0x1000).count(), 0);
        assert_eq!(ram_pages(&ram, top, 0x1000).count(), 0);
    }

    #[test]
    fn ranges_across_the_mmio_hole_keep_only_ram() {
        // 4 GiB of RAM: 3 GiB below the hole and 1 GiB from 4 GiB (sparse: nothing allocated).
        let ram = GuestRam::new(4 << 30).unwrap();
        let got: Vec<_> = ram_pages(&ram, (3 << 30) - 0x1000, (1 << 30) + 0x3000).collect();
        assert_eq!(got, [((3 << 30) - 0x1000, 0x1000), (4 << 30, 0x2000)]);
    }

    #[test]
    fn runs_coalesce_consecutive_pages_only() {
        let mut r = Runs::default();
        assert_eq!(r.push(0x1000), None);
        assert_eq!(r.push(0x2000), None);
        assert_eq!(r.push(0x5000), Some((0x1000, 0x2000)));
        assert_eq!(r.push(0x4000), Some((0x5000, 0x1000)));
        assert_eq!(r.run, Some((0x4000, 0x1000)));
    }
}
