//! A second mapping of guest RAM's backing file, for postcopy over memory the destination
//! already holds (minor faults, `destination/postcopy.rs`): the guest's own mapping loses its
//! page table entries for the pages that must come again (`Ram::unmap_pages`), while the file
//! keeps its pages; a received page is copied into the file through this mapping, where the
//! page is already allocated, and `UFFDIO_CONTINUE` maps it for the guest. No page is freed
//! and allocated again, which on this project's machines costs 2-3 µs a page against 0.35 µs
//! for a copy into allocated memory.
//!
//! Soundness: the alias maps each region's range of its file, shared, for as long as the
//! [`Alias`] lives (unmapped on drop); it is written only through raw pointers, into pages the
//! writer claimed and that no guest mapping shows (their entries were removed and the guest's
//! mapping is registered for minor faults, so a touch waits until the page is continued).

use std::io;

use super::{Ram, RamError};
use crate::wire::PAGE_SIZE;

/// Guest RAM mapped a second time, through its regions' files.
#[derive(Debug)]
pub(crate) struct Alias {
    /// Per region (in `Ram`'s order): its guest address, size and where the alias maps it.
    maps: Vec<(u64, u64, usize)>,
}

impl Alias {
    /// Maps every region of `ram` again, shared, from its file.
    pub(crate) fn new(ram: &Ram) -> io::Result<Alias> {
        let mut alias = Alias { maps: Vec::new() };
        for r in ram.regions() {
            // SAFETY: a new shared mapping of the region's file range, at an address the
            // kernel picks (no existing mapping is replaced); `r.fd` is the file behind the
            // region (`Ram`'s contract), and an invalid one only fails the call.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    r.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    r.fd,
                    r.file_offset as libc::off_t,
                )
            };
            if addr == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            alias.maps.push((r.gpa, r.size, addr as usize));
        }
        Ok(alias)
    }

    /// The alias address of `pages` pages at `gpa`, checked to lie in one region.
    fn at(&self, gpa: u64, pages: u64) -> Result<usize, RamError> {
        if !gpa.is_multiple_of(PAGE_SIZE) {
            return Err(RamError::Unaligned { gpa });
        }
        self.maps
            .iter()
            .find(|&&(start, size, _)| gpa >= start && gpa - start < size)
            .filter(|&&(start, size, _)| pages <= (start + size - gpa) / PAGE_SIZE)
            .map(|&(start, _, addr)| addr + (gpa - start) as usize)
            .ok_or(RamError::NotInOneRegion { gpa, pages })
    }

    /// Allocates the file's pages of `pages` pages at `gpa` where they are holes, and maps
    /// them here (`MADV_POPULATE_WRITE`), so that a copy into them later faults on nothing.
    pub(crate) fn populate(&self, gpa: u64, pages: u64) -> io::Result<()> {
        let addr = self.at(gpa, pages).map_err(io::Error::other)?;
        // SAFETY: pages of the alias (checked above), mapped while `self` lives; populating
        // changes no byte a holder can see (a hole reads as zeros, and so does the page
        // allocated for it).
        unsafe { super::madvise(addr, pages, libc::MADV_POPULATE_WRITE) }
    }

    /// Writes `data` (whole pages) into the file at `gpa`: pages the caller claimed, which no
    /// guest mapping shows yet.
    pub(crate) fn write(&self, gpa: u64, data: &[u8]) -> Result<(), RamError> {
        let addr = self.at(gpa, data.len() as u64 / PAGE_SIZE)?;
        // SAFETY: `data.len()` bytes at `addr` lie inside one region's alias (checked above),
        // mapped writable for as long as `self` lives; they do not overlap `data` (a buffer of
        // the caller's, not guest memory), and the pages are the caller's alone.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }

    /// Reads one page per address of `gpas` (strictly increasing) from `stream`: those `mine`
    /// marks straight into the file through the alias, as [`Alias::write`] would write them,
    /// the others into `scratch` and dropped (another copy of them is the one written). One
    /// `readv` per as many pages as the stream has ready: a page is copied once, from the
    /// socket into the file, where a read into a buffer and [`Alias::write`] copy it twice.
    ///
    /// Contract (crate-internal): the pages `mine` marks are the caller's alone (claimed) and
    /// no guest mapping shows them, as for [`Alias::write`]; on an error they hold any bytes.
    pub(crate) fn read_pages(
        &self,
        stream: &mut dyn io::Read,
        gpas: &[u64],
        mine: &[bool],
        scratch: &mut Vec<u8>,
    ) -> io::Result<()> {
        assert_eq!(gpas.len(), mine.len());
        let page = PAGE_SIZE as usize;
        let mut hosts = Vec::with_capacity(gpas.len());
        for (w, &gpa) in gpas.iter().enumerate() {
            if w > 0 && gpas[w - 1] >= gpa {
                return Err(io::Error::other(
                    "page addresses must be strictly increasing",
                ));
            }
            hosts.push(self.at(gpa, 1).map_err(io::Error::other)?);
        }
        let others = mine.iter().filter(|m| !**m).count();
        if scratch.len() < others * page {
            scratch.resize(others * page, 0);
        }
        let mut spare = scratch.chunks_exact_mut(page);
        let mut slices: Vec<io::IoSliceMut<'_>> = Vec::with_capacity(gpas.len());
        for (&host, &m) in hosts.iter().zip(mine) {
            if !m {
                slices.push(io::IoSliceMut::new(spare.next().expect("sized above")));
                continue;
            }
            // SAFETY: one page of the alias (checked by `at`), mapped writable while `self`
            // lives; the addresses are distinct (strictly increasing), so no two slices
            // overlap, and none overlaps `scratch`; the page is the caller's alone and no
            // guest mapping shows it (this function's contract), so no other reference to
            // it exists while the slice lives.
            let bytes = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, page) };
            slices.push(io::IoSliceMut::new(bytes));
        }
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match stream.read_vectored(rest) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => io::IoSliceMut::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes zeros over `pages` pages at `gpa`, as [`Alias::write`].
    pub(crate) fn zero(&self, gpa: u64, pages: u64) -> Result<(), RamError> {
        let addr = self.at(gpa, pages)?;
        // SAFETY: as in `write`.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, (pages * PAGE_SIZE) as usize) };
        Ok(())
    }
}

impl Drop for Alias {
    fn drop(&mut self) {
        for &(_, size, addr) in &self.maps {
            // SAFETY: unmaps exactly the mapping `new` made, which nothing else refers to.
            unsafe { libc::munmap(addr as *mut libc::c_void, size as usize) };
        }
    }
}
