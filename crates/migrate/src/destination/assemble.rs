//! Postcopy over huge pages: a receiver gathers the 512 wire pages of a 2 MiB host page, from
//! its Pages and ZeroRuns records, in a buffer of its own, and places the huge page with one
//! `UFFDIO_COPY` once every page is in (userfaultfd cannot place part of a huge page).
//!
//! Each receiver assembles what its own connection carries, so a huge page the source sends
//! twice (in the background, and again on the preempt connection when a vCPU waits for it) is
//! assembled twice, and the first to complete is placed; the other finds it there. A huge page
//! is never held behind another connection's half-sent one: nothing here is shared between
//! receivers.
//!
//! The source sends a huge page's pages together on one connection (one batch: its zero runs,
//! then its data pages), so a connection has one huge page open at a time; a few more are
//! allowed, and beyond [`MAX_OPEN_UNITS`] the stream is refused rather than buffered.

#![forbid(unsafe_code)]

use std::io::Read;

use super::postcopy::Postcopy;
use crate::error::{MigrateError, ProtocolError, Twice};
use crate::wire::PAGE_SIZE;

/// Huge pages one connection may have in progress: 4 × 2 MiB of buffer per receiver. The
/// source keeps one open (see the module doc); the slack lets a source batch differently
/// without making a hostile one able to make this side buffer much.
pub(crate) const MAX_OPEN_UNITS: usize = 4;

/// Where assembled huge pages go: postcopy's state (a trait so that the assembly's rules are
/// tested without a userfaultfd over hugetlbfs).
pub(crate) trait Units {
    /// Fails unless the page at `gpa` is RAM and on the discard list.
    fn check_needed(&self, gpa: u64) -> Result<(), MigrateError>;
    /// Places a whole huge page from its first page's address and its bytes.
    fn place(&self, base: u64, data: &[u8]) -> Result<(), MigrateError>;
    /// Places a whole huge page of zeros.
    fn place_zero(&self, base: u64) -> Result<(), MigrateError>;
}

impl Units for Postcopy {
    fn check_needed(&self, gpa: u64) -> Result<(), MigrateError> {
        self.needed_index(gpa).map(|_| ())
    }
    fn place(&self, base: u64, data: &[u8]) -> Result<(), MigrateError> {
        self.place_unit(base, data)
    }
    fn place_zero(&self, base: u64) -> Result<(), MigrateError> {
        self.place_zero_unit(base)
    }
}

/// A receiver's huge pages in progress.
#[derive(Debug)]
pub(crate) struct Assembler {
    unit_pages: u64,
    open: Vec<Open>,
    /// Buffers of placed units, kept for the next ones: a fresh 2 MiB buffer costs ~1 ms of
    /// first-touch page faults, a reused one nothing.
    spare: Vec<Vec<u8>>,
}

/// One huge page in progress.
#[derive(Debug)]
struct Open {
    /// Guest address of its first page.
    base: u64,
    data: Vec<u8>,
    /// Which of its pages arrived.
    have: Vec<u64>,
    count: u64,
}

impl Assembler {
    pub(crate) fn new(unit_pages: u64) -> Assembler {
        Assembler {
            unit_pages,
            open: Vec::new(),
            spare: Vec::new(),
        }
    }

    /// Huge pages started and not complete.
    pub(crate) fn open_units(&self) -> usize {
        self.open.len()
    }

    /// Reads the data of a Pages record whose addresses `gpas` are strictly increasing RAM
    /// pages (the receiver checked), after checking that each is needed.
    pub(crate) fn pages(
        &mut self,
        pc: &dyn Units,
        stream: &mut dyn Read,
        gpas: &[u64],
    ) -> Result<(), MigrateError> {
        for &gpa in gpas {
            pc.check_needed(gpa)?;
        }
        let unit = self.unit_pages * PAGE_SIZE;
        let mut k = 0;
        while k < gpas.len() {
            // The longest run of adjacent pages from k inside one unit: one read.
            let base = gpas[k] - gpas[k] % unit;
            let mut n = 1;
            while k + n < gpas.len()
                && gpas[k + n] == gpas[k] + n as u64 * PAGE_SIZE
                && gpas[k + n] < base + unit
            {
                n += 1;
            }
            let slot = self.slot(base)?;
            let o = &mut self.open[slot];
            let at = (gpas[k] - base) as usize;
            stream
                .read_exact(&mut o.data[at..at + n * PAGE_SIZE as usize])
                .map_err(|e| MigrateError::io("receiving postcopy pages", e))?;
            o.mark(gpas[k], n as u64)?;
            k += n;
        }
        // Only now, with the record read whole (and its checksum, when it covers page data,
        // checked by the read that ended it), does any of it reach the guest.
        while let Some(slot) = self.open.iter().position(|o| o.count >= self.unit_pages) {
            self.place_if_complete(pc, slot)?;
        }
        Ok(())
    }

    /// A zero run (checked to be RAM in one region): whole huge pages not in progress are
    /// placed as zeros at once, the rest assembled.
    pub(crate) fn zero(
        &mut self,
        pc: &dyn Units,
        gpa: u64,
        pages: u64,
    ) -> Result<(), MigrateError> {
        for k in 0..pages {
            pc.check_needed(gpa + k * PAGE_SIZE)?;
        }
        let unit = self.unit_pages * PAGE_SIZE;
        let end = gpa + pages * PAGE_SIZE;
        let mut at = gpa;
        while at < end {
            let base = at - at % unit;
            let stop = end.min(base + unit);
            let whole = at == base && stop == base + unit;
            if whole && !self.open.iter().any(|o| o.base == base) {
                pc.place_zero(base)?;
            } else {
                let slot = self.slot(base)?;
                let o = &mut self.open[slot];
                o.data[(at - base) as usize..(stop - base) as usize].fill(0);
                o.mark(at, (stop - at) / PAGE_SIZE)?;
                self.place_if_complete(pc, slot)?;
            }
            at = stop;
        }
        Ok(())
    }

    /// The open unit at `base`, opened if need be.
    fn slot(&mut self, base: u64) -> Result<usize, MigrateError> {
        if let Some(i) = self.open.iter().position(|o| o.base == base) {
            return Ok(i);
        }
        if self.open.len() >= MAX_OPEN_UNITS {
            return Err(ProtocolError::OpenHugePages {
                max: MAX_OPEN_UNITS,
                next: base,
            }
            .into());
        }
        let bytes = (self.unit_pages * PAGE_SIZE) as usize;
        let data = self.spare.pop().unwrap_or_else(|| vec![0; bytes]);
        self.open.push(Open {
            base,
            data,
            have: vec![0; self.unit_pages.div_ceil(64) as usize],
            count: 0,
        });
        Ok(self.open.len() - 1)
    }

    fn place_if_complete(&mut self, pc: &dyn Units, slot: usize) -> Result<(), MigrateError> {
        if self.open[slot].count < self.unit_pages {
            return Ok(());
        }
        let o = self.open.swap_remove(slot);
        pc.place(o.base, &o.data)?;
        self.spare.push(o.data);
        Ok(())
    }
}

impl Open {
    /// Marks `pages` pages from `gpa` as arrived; a page that arrived already on this
    /// connection is refused.
    fn mark(&mut self, gpa: u64, pages: u64) -> Result<(), MigrateError> {
        let first = (gpa - self.base) / PAGE_SIZE;
        for p in first..first + pages {
            let (w, bit) = ((p / 64) as usize, 1u64 << (p % 64));
            if self.have[w] & bit != 0 {
                return Err(ProtocolError::PageTwice {
                    gpa: self.base + p * PAGE_SIZE,
                    twice: Twice::OnConnection,
                }
                .into());
            }
            self.have[w] |= bit;
        }
        self.count += pages;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    const UNIT: u64 = 512;
    const HUGE: u64 = UNIT * PAGE_SIZE;

    /// Records what was placed: (base, first byte of each page, or None for a zero unit).
    #[derive(Default)]
    struct Placed(RefCell<Vec<(u64, Option<Vec<u8>>)>>);

    impl Units for Placed {
        fn check_needed(&self, gpa: u64) -> Result<(), MigrateError> {
            if gpa >= 8 * HUGE {
                return Err(crate::vm::VmError::failed(
                    "check_needed",
                    format!("{gpa:#x} not listed"),
                )
                .into());
            }
            Ok(())
        }
        fn place(&self, base: u64, data: &[u8]) -> Result<(), MigrateError> {
            let firsts = data.chunks(PAGE_SIZE as usize).map(|p| p[0]).collect();
            self.0.borrow_mut().push((base, Some(firsts)));
            Ok(())
        }
        fn place_zero(&self, base: u64) -> Result<(), MigrateError> {
            self.0.borrow_mut().push((base, None));
            Ok(())
        }
    }

    /// Page data whose first byte names the page (its index in the unit, plus one).
    fn data(gpas: &[u64]) -> Vec<u8> {
        gpas.iter()
            .flat_map(|g| {
                let mut p = vec![0u8; PAGE_SIZE as usize];
                p[0] = (((g % HUGE) / PAGE_SIZE) as u8).wrapping_add(1);
                p
            })
            .collect()
    }

    fn pages(a: &mut Assembler, to: &Placed, gpas: &[u64]) -> Result<(), MigrateError> {
        a.pages(to, &mut data(gpas).as_slice(), gpas)
    }

    #[test]
    fn a_huge_page_is_placed_once_its_zero_runs_and_data_pages_are_all_in() {
        let to = Placed::default();
        let mut a = Assembler::new(UNIT);
        // As a source sends a batch: the zero runs first, then the data pages.
        a.zero(&to, HUGE, 10).unwrap();
        a.zero(&to, HUGE + 500 * PAGE_SIZE, 2).unwrap();
        let gpas: Vec<u64> = (10..500)
            .chain(502..512)
            .map(|k| HUGE + k * PAGE_SIZE)
            .collect();
        pages(&mut a, &to, &gpas[..100]).unwrap();
        assert!(
            to.0.borrow().is_empty(),
            "nothing placed before the last page"
        );
        pages(&mut a, &to, &gpas[100..]).unwrap();
        let placed = to.0.borrow();
        assert_eq!(placed.len(), 1);
        let (base, firsts) = &placed[0];
        assert_eq!(*base, HUGE);
        let firsts = firsts.as_ref().unwrap();
        assert_eq!(firsts[0], 0, "a zero page is zeros");
        assert_eq!(firsts[10], 11, "a data page holds its bytes");
        assert_eq!(firsts[501], 0);
        assert_eq!(firsts[511], 0, "page 511 came in a zero run");
        assert_eq!(a.open_units(), 0);
    }

    #[test]
    fn whole_zero_huge_pages_are_placed_at_once_and_buffers_are_reused() {
        let to = Placed::default();
        let mut a = Assembler::new(UNIT);
        a.zero(&to, 0, 2 * UNIT).unwrap();
        assert_eq!(*to.0.borrow(), vec![(0, None), (HUGE, None)]);
        let all: Vec<u64> = (0..UNIT).map(|k| 2 * HUGE + k * PAGE_SIZE).collect();
        pages(&mut a, &to, &all).unwrap();
        assert_eq!(a.spare.len(), 1, "the buffer is kept");
        let all: Vec<u64> = (0..UNIT).map(|k| 3 * HUGE + k * PAGE_SIZE).collect();
        pages(&mut a, &to, &all).unwrap();
        assert_eq!(a.spare.len(), 1, "and reused");
        assert_eq!(to.0.borrow().len(), 4);
    }

    #[test]
    fn hostile_orders_are_refused() {
        let to = Placed::default();
        let mut a = Assembler::new(UNIT);
        pages(&mut a, &to, &[HUGE]).unwrap();
        let e = a.zero(&to, HUGE, 1).unwrap_err().to_string();
        assert!(e.contains("arrived twice"), "{e}");

        let mut a = Assembler::new(UNIT);
        for u in 0..MAX_OPEN_UNITS as u64 {
            pages(&mut a, &to, &[u * HUGE]).unwrap();
        }
        let e = pages(&mut a, &to, &[7 * HUGE]).unwrap_err().to_string();
        assert!(e.contains("huge pages in progress"), "{e}");

        let mut a = Assembler::new(UNIT);
        let e = pages(&mut a, &to, &[8 * HUGE]).unwrap_err().to_string();
        assert!(e.contains("not listed"), "{e}");
        assert_eq!(a.open_units(), 0, "nothing is read for a page not listed");
    }
}
