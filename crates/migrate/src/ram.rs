//! Guest RAM as the engine sees it: regions of host-mapped memory backed by a file (the VMM's
//! memfd), and the few raw operations migration needs: scan a page for zeros in place and hand
//! pages to a socket without copying them (the source), give a page's bytes to read from a
//! socket into, clear back to zero, and find populated ranges with
//! `SEEK_DATA`/`SEEK_HOLE`.
//!
//! With `zero.rs` (SIMD) and `uffd.rs`, this is the engine's `unsafe` module. Its soundness
//! rests on one invariant of [`Ram`]: **every region of a `Ram` is mapped, readable (and, on a
//! destination, writable) for as long as the `Ram` and its clones live.** A [`RamRegion`] is
//! inert data (its fields are public and [`RamRegion::for_test`] makes one with no mapping);
//! nothing dereferences its `host_addr` until it is inside a `Ram`, and a `Ram` is built only
//! under a contract someone vouched for in an `unsafe` block or impl:
//!
//! - [`Ram::from_regions`] is `unsafe`: its caller states the mappings.
//! - The engine's own sessions build theirs (crate-internal `Ram::new`) from
//!   [`crate::vm::SourceVm::ram`] or [`crate::vm::DestinationVm::ram`], whose traits are
//!   `unsafe` to implement for exactly this promise, and keep the VM borrowed while the `Ram`
//!   lives.
//!
//! A destination may also write pages through the backing file (`Ram::write_pages`, `pwrite`
//! at the region's `file_offset`), for the same invariant plus one: each region's `fd` is the
//! file behind its mapping, so what lands in the file is what the mapping shows and nothing
//! outside the region's range of the file is touched.
//!
//! The writing operations (`Ram::read_pages`, `Ram::write_pages`, `Ram::zero_run`) also need the pages to be the
//! caller's alone while they run. That is the receivers' page claim (a page is claimed once per
//! pass before it is written), so the two are crate-internal rather than `unsafe`: marking them
//! `unsafe` would move `unsafe` blocks into `receiver.rs`, which keeps `forbid(unsafe_code)`.

use std::os::fd::{BorrowedFd, RawFd};

use crate::wire::{LocalRegion, PAGE_SIZE};

pub(crate) mod alias;

/// `madvise(advice)` over `pages` pages at `addr`.
///
/// # Safety
///
/// The pages must be mapped, and what `advice` does to them must change no byte that a Rust
/// reference or another holder relies on.
unsafe fn madvise(addr: usize, pages: u64, advice: libc::c_int) -> std::io::Result<()> {
    // SAFETY: the caller's promise.
    let ret = unsafe {
        libc::madvise(
            addr as *mut libc::c_void,
            (pages * PAGE_SIZE) as usize,
            advice,
        )
    };
    if ret != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A byte count as a person writes it and `--memory` takes it: `64K`, `10M`, `64G`, or
/// bytes when not a whole KiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            b if b != 0 && b.is_multiple_of(1 << 40) => write!(f, "{}T", b >> 40),
            b if b != 0 && b.is_multiple_of(1 << 30) => write!(f, "{}G", b >> 30),
            b if b != 0 && b.is_multiple_of(1 << 20) => write!(f, "{}M", b >> 20),
            b if b != 0 && b.is_multiple_of(1 << 10) => write!(f, "{}K", b >> 10),
            b => write!(f, "{b} bytes"),
        }
    }
}

/// One contiguous range of guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRegion {
    /// Guest-physical address, page aligned.
    pub gpa: u64,
    /// Bytes, a multiple of the page size.
    pub size: u64,
    /// Where the region is mapped in this process.
    pub host_addr: usize,
    /// The file backing the region (e.g. a memfd), for hole detection.
    pub fd: RawFd,
    /// The region's offset in `fd`.
    pub file_offset: u64,
}

impl RamRegion {
    /// A region with no mapping (`host_addr` 0, no file), for pure tests of bitmaps and
    /// layouts. Safe: a region is a description; only a [`Ram`] reads through one, and building
    /// a `Ram` is where the mapping is vouched for.
    pub fn for_test(gpa: u64, size: u64) -> RamRegion {
        RamRegion {
            gpa,
            size,
            host_addr: 0,
            fd: -1,
            file_offset: 0,
        }
    }

    fn contains(&self, gpa: u64) -> bool {
        gpa >= self.gpa && gpa - self.gpa < self.size
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RamError {
    #[error("guest address {gpa:#x} is not page aligned")]
    Unaligned { gpa: u64 },
    #[error("guest address {gpa:#x} is outside guest RAM")]
    OutOfRange { gpa: u64 },
    #[error("zero run of {pages} pages at {gpa:#x} is empty, too long or leaves its RAM region")]
    BadRun { gpa: u64, pages: u64 },
    #[error("{pages} pages at {gpa:#x} are not inside one RAM region")]
    NotInOneRegion { gpa: u64, pages: u64 },
    #[error("RAM region at {gpa:#x} of {size} bytes is not page aligned or overlaps another")]
    BadRegion { gpa: u64, size: u64 },
    #[error(
        "RAM region at {gpa:#x} is backed by no file, so it cannot be handed over; migrate without --local"
    )]
    NoFile { gpa: u64 },
}

/// A VM's RAM regions, sorted and checked, each mapped for as long as this value and its
/// clones live (the module's invariant).
#[derive(Clone, Debug)]
pub struct Ram {
    regions: Vec<RamRegion>,
    size: u64,
}

impl Ram {
    /// Sorts and checks `regions` (page aligned, non-empty, non-overlapping).
    ///
    /// # Safety
    ///
    /// Every region's `size` bytes from `host_addr` must be mapped and readable (and writable,
    /// if the `Ram` is written through: `Ram::read_pages`, `Ram::zero_run`) for as long as the
    /// returned `Ram` or any clone of it is used to reach guest memory (the source's zero scan
    /// and page slices, and the writers); `fd` must be the file backing the mapping at
    /// `file_offset`, open as long as the mappings are, and open for writing if the `Ram` is written through the file
    /// (`Ram::write_pages`). A wrong fd gives wrong answers from [`Ram::next_data`] and,
    /// written through, puts guest pages into a file that is not guest RAM.
    pub unsafe fn from_regions(mut regions: Vec<RamRegion>) -> Result<Ram, RamError> {
        regions.sort_by_key(|r| r.gpa);
        let mut end = 0;
        for r in &regions {
            if !r.gpa.is_multiple_of(PAGE_SIZE)
                || !r.size.is_multiple_of(PAGE_SIZE)
                || r.size == 0
                || r.gpa < end
            {
                return Err(RamError::BadRegion {
                    gpa: r.gpa,
                    size: r.size,
                });
            }
            end = r.gpa + r.size;
        }
        let size = regions.iter().map(|r| r.size).sum();
        Ok(Ram { regions, size })
    }

    /// [`Ram::from_regions`] for the engine's sessions, whose only arguments are a VM's
    /// `ram()`: the source's setup and the destination's session call it with `vm.ram()` of the
    /// VM they borrow for their whole life, and keep the `Ram` no longer.
    pub(crate) fn new(regions: Vec<RamRegion>) -> Result<Ram, RamError> {
        // SAFETY: the regions come from `SourceVm::ram` or `DestinationVm::ram` (this function's
        // contract with its two callers), which the VMM's `unsafe impl` promises are mapped,
        // readable and writable, backed by `fd`, for as long as the VM lives; the session that
        // owns the returned `Ram` borrows the VM for longer than it keeps the `Ram`.
        unsafe { Ram::from_regions(regions) }
    }

    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// The regions as `(gpa, size)`: the layout a snapshot records and a restore checks.
    pub fn layout(&self) -> Vec<(u64, u64)> {
        self.regions.iter().map(|r| (r.gpa, r.size)).collect()
    }

    /// The regions as a LocalRam record lays them out, each naming one of the descriptors
    /// returned with them (a file that backs several regions is named once): what a local
    /// handover passes to the destination, and what the conformance suite
    /// (`ferry_migrate_testkit::conformance`) hands a destination's `adopt_ram` as one does.
    pub fn local_layout(&self) -> Result<(Vec<LocalRegion>, Vec<BorrowedFd<'_>>), RamError> {
        if let Some(r) = self.regions.iter().find(|r| r.fd < 0) {
            return Err(RamError::NoFile { gpa: r.gpa });
        }
        let mut files: Vec<RawFd> = Vec::new();
        let regions = self
            .regions
            .iter()
            .map(|r| {
                let fd = files.iter().position(|&f| f == r.fd).unwrap_or_else(|| {
                    files.push(r.fd);
                    files.len() - 1
                });
                LocalRegion {
                    gpa: r.gpa,
                    size: r.size,
                    file_offset: r.file_offset,
                    fd: fd as u32,
                }
            })
            .collect();
        let fds = files
            .into_iter()
            // SAFETY: every region's `fd` is open for as long as this `Ram` lives
            // (`Ram::from_regions`' contract), not -1 (refused above), and the borrow is tied
            // to `&self`.
            .map(|fd| unsafe { BorrowedFd::borrow_raw(fd) })
            .collect();
        Ok((regions, fds))
    }

    /// Total bytes of RAM.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Checks that `gpa` is a page inside RAM and returns its host address.
    pub fn page(&self, gpa: u64) -> Result<usize, RamError> {
        if !gpa.is_multiple_of(PAGE_SIZE) {
            return Err(RamError::Unaligned { gpa });
        }
        self.regions
            .iter()
            .find(|r| r.contains(gpa))
            .map(|r| r.host_addr + (gpa - r.gpa) as usize)
            .ok_or(RamError::OutOfRange { gpa })
    }

    /// The page's index counting pages across all regions in address order (for per-page
    /// bitmaps), after checking that `gpa` is a page inside RAM.
    pub fn page_index(&self, gpa: u64) -> Result<u64, RamError> {
        self.page(gpa)?;
        let mut first = 0;
        for r in &self.regions {
            if r.contains(gpa) {
                return Ok(first + (gpa - r.gpa) / PAGE_SIZE);
            }
            first += r.size / PAGE_SIZE;
        }
        unreachable!("page() found the region")
    }

    /// Whether the page at `gpa` is all zeros, read in place (no copy): the sender's zero scan,
    /// and what a VMM's own [`crate::scan::ZeroDetector`] may ask about the pages it knows
    /// nothing of.
    ///
    /// The guest may write the page while it is scanned, so the answer describes some mix of
    /// its old and new bytes. That is harmless for the same reason as for `Ram::page_slices`:
    /// tracking was re-armed before the page was queued, so a page that changes now is dirty
    /// again and sent again in its newer state.
    pub fn is_zero_page(&self, gpa: u64) -> Result<bool, RamError> {
        let host = self.page(gpa)?;
        // SAFETY: a page of guest RAM (checked above), mapped and readable while `self` lives
        // (the `Ram` invariant), and the slice lives only for this call. A vCPU may store to
        // it meanwhile: those stores come from outside this process's Rust code, every byte
        // value is valid `u8`, and the scan reads each byte at most once and acts on no more
        // than "some byte was non-zero", so a racing store can only change the answer, never
        // the scan's behaviour; the answer is not the last word (see above).
        let page = unsafe { std::slice::from_raw_parts(host as *const u8, PAGE_SIZE as usize) };
        Ok(crate::zero::is_zero(page))
    }

    /// The pages at `gpas` as slices of guest memory for one vectored write to a socket, in
    /// order, with pages adjacent in host memory merged into one slice (a run of 128 adjacent
    /// pages is one `iovec`, not 128). The kernel copies from guest memory straight into the
    /// socket: no copy into a buffer of ours first.
    ///
    /// Why sending from live guest memory is as correct as the copy it replaces: dirty
    /// tracking is armed for a page before the session queues the page (pass 1 walks after
    /// `SourceVm::start_dirty_log`; a dirty pass walks the bitmap that
    /// `SourceVm::fetch_dirty`, a fetch-and-clear, filled), so a guest store that lands before the kernel has read the page, or in
    /// the middle of it, is in the next pass's dirty log, and that pass sends the page again
    /// in its newer state; the last pass runs with the guest paused. A torn page on the wire
    /// is never the last word, which is exactly what the copy out of guest memory guaranteed
    /// (that copy could tear the same way).
    ///
    /// Contract (crate-internal): the slices are handed to the kernel (`writev`), not read by
    /// Rust code, whose reads of memory a vCPU may be writing would race; a caller that needs
    /// the bytes copies them with [`Ram::copy_pages`].
    pub(crate) fn page_slices(&self, gpas: &[u64]) -> Result<Vec<std::io::IoSlice<'_>>, RamError> {
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for &gpa in gpas {
            let host = self.page(gpa)?;
            match spans.last_mut() {
                Some((start, len)) if *start + *len == host => *len += PAGE_SIZE as usize,
                _ => spans.push((host, PAGE_SIZE as usize)),
            }
        }
        Ok(spans
            .into_iter()
            .map(|(start, len)| {
                // SAFETY: `start..start + len` is whole pages of guest RAM found by `page`
                // (adjacent host pages, each inside a mapped region), mapped and readable for
                // as long as `self` lives (the `Ram` invariant), and the slice borrows `self`.
                // The guest may store to it while the slice lives; the contract above keeps
                // Rust code from reading it (the kernel copies it), and a torn read by the
                // kernel is caught by the dirty log (see above).
                let bytes = unsafe { std::slice::from_raw_parts(start as *const u8, len) };
                std::io::IoSlice::new(bytes)
            })
            .collect())
    }

    /// Copies the pages at `gpas` (in order, one page each) into `into` with volatile reads,
    /// for the callers that need the bytes themselves (a snapshot's CRC, compression, page
    /// checksums). Guest memory a vCPU may be writing is read as a device's memory is, never
    /// through a Rust reference (which [`Ram::page_slices`]' contract forbids); a store that
    /// races the copy can tear the copied page, and the dirty log sends the page again, as
    /// for a page on the wire.
    pub(crate) fn copy_pages(&self, gpas: &[u64], into: &mut [u8]) -> Result<(), RamError> {
        const WORD: usize = std::mem::size_of::<u64>();
        assert_eq!(into.len() as u64, gpas.len() as u64 * PAGE_SIZE);
        for (&gpa, out) in gpas.iter().zip(into.chunks_exact_mut(PAGE_SIZE as usize)) {
            let host = self.page(gpa)? as *const u64;
            for (i, word) in out.chunks_exact_mut(WORD).enumerate() {
                // SAFETY: `host` is a whole page of guest RAM (found by `page`), mapped and
                // readable while `self` lives (the `Ram` invariant) and page-aligned, so each
                // of its 512 words is aligned and inside it; a volatile read of memory that
                // another agent may write is the access the invariant allows.
                let w = unsafe { host.add(i).read_volatile() };
                word.copy_from_slice(&w.to_ne_bytes());
            }
        }
        Ok(())
    }

    /// The next populated range of region `region` at or after guest address `from`, as
    /// `(start, end)` guest addresses, found with `SEEK_DATA`/`SEEK_HOLE` on the backing file;
    /// `None` when the rest of the region is a hole.
    pub fn next_data(&self, region: usize, from: u64) -> std::io::Result<Option<(u64, u64)>> {
        let r = &self.regions[region];
        let at = r.file_offset + (from - r.gpa);
        Ok(next_data_in_file(r.fd, at, r.file_offset + r.size)?
            .map(|(data, hole)| (r.gpa + data - r.file_offset, r.gpa + hole - r.file_offset)))
    }
}

/// The next populated range of file `fd` at or after offset `from` and before `end`, as
/// `(start, end)` offsets rounded out to whole pages, found with `SEEK_DATA`/`SEEK_HOLE`;
/// `None` when the rest up to `end` is a hole. Moves the file's offset, which guest RAM's users
/// never rely on (they go through the mapping, or `pread`/`pwrite` at explicit offsets).
pub fn next_data_in_file(fd: RawFd, from: u64, end: u64) -> std::io::Result<Option<(u64, u64)>> {
    if from >= end {
        return Ok(None);
    }
    let Some(data) = seek(fd, from, libc::SEEK_DATA)?.filter(|&d| d < end) else {
        return Ok(None);
    };
    let hole = seek(fd, data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
    Ok(Some((
        data / PAGE_SIZE * PAGE_SIZE,
        hole.next_multiple_of(PAGE_SIZE),
    )))
}

/// The offset of the first populated byte of file `fd` at or after `from`, wherever it is
/// (`SEEK_DATA`), or `None` when the rest of the file is a hole: one call tells a caller that
/// walks ranges in order how many of them it may skip.
pub fn next_data_offset(fd: RawFd, from: u64) -> std::io::Result<Option<u64>> {
    seek(fd, from, libc::SEEK_DATA)
}

/// `lseek(fd, offset, whence)`; `None` for `ENXIO` (no data, or no hole, from there on).
fn seek(fd: RawFd, offset: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
    // SAFETY: lseek takes plain integers and only moves the file offset of `fd` (an invalid fd
    // makes it fail); no memory is read or written.
    let ret = unsafe { libc::lseek(fd, offset as libc::off_t, whence) };
    if ret < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(ret as u64))
}

impl Ram {
    /// Reads the pages at `gpas` (strictly increasing) straight from `stream` into guest
    /// memory: one `readv` per as many pages as the socket has ready, no intermediate buffer.
    ///
    /// Contract (crate-internal, see the module doc): the pages are the caller's alone until
    /// this returns: no other thread reads or writes them (the receivers claim each page for
    /// the pass before writing it), and no vCPU runs.
    pub(crate) fn read_pages(
        &self,
        stream: &mut impl std::io::Read,
        gpas: &[u64],
    ) -> std::io::Result<()> {
        let mut slices = Vec::with_capacity(gpas.len());
        for w in gpas.windows(2) {
            assert!(w[0] < w[1], "page addresses must be strictly increasing");
        }
        for &gpa in gpas {
            let host = self.page(gpa).map_err(std::io::Error::other)?;
            // SAFETY: a mapped, writable guest page (the `Ram` invariant); the addresses are
            // distinct (strictly increasing) and the caller holds each alone (this function's
            // crate-internal contract, kept by the receivers' page claim), so no other slice
            // to it exists now.
            let page =
                unsafe { std::slice::from_raw_parts_mut(host as *mut u8, PAGE_SIZE as usize) };
            slices.push(std::io::IoSliceMut::new(page));
        }
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match stream.read_vectored(rest) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => std::io::IoSliceMut::advance_slices(&mut rest, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes `data` (one page per address, in order) to the pages at `gpas` (strictly
    /// increasing) through the backing file: one `pwrite` per run of consecutive pages inside
    /// one region, at the region's `file_offset` plus the page's offset in the region. Every
    /// address is checked to be RAM before anything is written.
    ///
    /// Contract (crate-internal): as for `Ram::read_pages`, the pages are the caller's alone
    /// until this returns.
    pub(crate) fn write_pages(&self, gpas: &[u64], data: &[u8]) -> std::io::Result<()> {
        assert_eq!(data.len() as u64, gpas.len() as u64 * PAGE_SIZE);
        // (region, file offset) of each page, all checked before the first write.
        let mut at = Vec::with_capacity(gpas.len());
        for (k, &gpa) in gpas.iter().enumerate() {
            assert!(
                k == 0 || gpas[k - 1] < gpa,
                "page addresses must be strictly increasing"
            );
            self.page(gpa).map_err(std::io::Error::other)?;
            let (i, r) = self
                .regions
                .iter()
                .enumerate()
                .find(|(_, r)| r.contains(gpa))
                .expect("page() found the region");
            at.push((i, r.file_offset + (gpa - r.gpa)));
        }
        let mut first = 0;
        while first < at.len() {
            let mut end = first + 1;
            while end < at.len()
                && at[end].0 == at[first].0
                && gpas[end] == gpas[end - 1] + PAGE_SIZE
            {
                end += 1;
            }
            let bytes = &data[first * PAGE_SIZE as usize..end * PAGE_SIZE as usize];
            self.pwrite_all(self.regions[at[first].0].fd, bytes, at[first].1)?;
            first = end;
        }
        Ok(())
    }

    /// `pwrite` until all of `bytes` is at `offset` of `fd`.
    fn pwrite_all(&self, fd: RawFd, mut bytes: &[u8], mut offset: u64) -> std::io::Result<()> {
        while !bytes.is_empty() {
            // SAFETY: `bytes` is a live slice for the call; `fd` backs a region of this `Ram`
            // (`Ram::from_regions`'s contract) and the range `offset..offset + bytes.len()` is
            // the file range of pages inside that region (`write_pages` checked them), so the
            // write changes only guest pages the caller holds alone.
            let n = unsafe {
                libc::pwrite(
                    fd,
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    offset as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            bytes = &bytes[n as usize..];
            offset += n as u64;
        }
        Ok(())
    }

    /// Makes `pages` stale pages from `gpa` (inside one region) zero by clearing them with
    /// stores. Clearing beats punching a hole in the backing file: `ferry bench channels`
    /// measured 0.27–0.40 µs per page cleared against 1.0–3.9 µs per page punched (runs of 16
    /// and 1), and the pages are populated already, so clearing takes no extra memory.
    ///
    /// Contract (crate-internal): as for `Ram::read_pages`, the pages are the caller's alone
    /// until this returns.
    pub(crate) fn zero_run(&self, gpa: u64, pages: u64) -> std::io::Result<()> {
        for i in 0..pages {
            let host = self
                .page(gpa + i * PAGE_SIZE)
                .map_err(std::io::Error::other)?;
            // SAFETY: a mapped, writable guest page (the `Ram` invariant) that the caller holds
            // alone (this function's crate-internal contract, kept by the page claim).
            unsafe { std::ptr::write_bytes(host as *mut u8, 0, PAGE_SIZE as usize) };
        }
        Ok(())
    }

    /// Registers every region with `uffd` for `faults` (postcopy's destination, a lazy
    /// restore): from then on a touch of a page that is not in the backing file (or, with
    /// minor faults, not mapped) waits for the fault thread.
    pub(crate) fn register_uffd(
        &self,
        uffd: &crate::uffd::Uffd,
        faults: crate::uffd::Faults,
    ) -> Result<(), crate::uffd::UffdError> {
        for r in &self.regions {
            // SAFETY: the region is mapped for as long as this `Ram` lives (the module's
            // invariant), and guest memory is reached only through raw pointers (the engine's
            // copies, the VMM's volatile accesses, the kernel's for KVM), never through Rust
            // references that a page filled behind them would invalidate.
            unsafe { uffd.register(r.host_addr, r.size as usize, faults) }?;
        }
        Ok(())
    }

    /// Removes the mapping's page table entries for `pages` pages at `gpa`
    /// (`MADV_DONTNEED`), keeping the file's pages: with the range registered for minor
    /// faults, the next touch waits for `UFFDIO_CONTINUE` (postcopy over memory the
    /// destination holds, `ram/alias.rs`).
    pub(crate) fn unmap_pages(&self, gpa: u64, pages: u64) -> std::io::Result<()> {
        self.check_run(gpa, pages).map_err(std::io::Error::other)?;
        let host = self.page(gpa).map_err(std::io::Error::other)?;
        // SAFETY: pages of one region (checked above), which stay mapped; on a shared file
        // mapping MADV_DONTNEED drops only page table entries, never the file's bytes, so no
        // byte changes for any holder.
        unsafe { madvise(host, pages, libc::MADV_DONTNEED) }
    }

    /// The size of the host pages behind guest RAM: 4 KiB for shmem and anonymous memory, the
    /// huge page size for hugetlbfs; `None` when regions differ. Postcopy places whole host
    /// pages, so this is its unit.
    pub fn host_page_size(&self) -> Option<u64> {
        /// `HUGETLBFS_MAGIC` from linux/magic.h.
        const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
        let mut sizes = self.regions.iter().map(|r| {
            // SAFETY: `statfs` is plain integers, for which all-zero bytes are a valid value.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: fstatfs writes one `statfs` into `st`, which we own for the call; `r.fd`
            // is the region's file (an invalid fd only makes the call fail).
            let ok = unsafe { libc::fstatfs(r.fd, &mut st) } == 0;
            // hugetlbfs reports its page size as the block size.
            if ok && st.f_type as i64 == HUGETLBFS_MAGIC {
                st.f_bsize as u64
            } else {
                PAGE_SIZE
            }
        });
        let first = sizes.next().unwrap_or(PAGE_SIZE);
        sizes.all(|s| s == first).then_some(first)
    }

    /// About how much of guest RAM is populated: the blocks the backing files hold
    /// (`st_blocks`), each file counted once and at most the size of its regions. One `fstat`
    /// per file, so pass 1's progress can show what it has left without walking memory twice.
    /// A file that also backs something else than guest RAM counts high (capped).
    pub fn populated_bytes(&self) -> u64 {
        let mut files: Vec<(RawFd, u64)> = Vec::new();
        for r in &self.regions {
            match files.iter_mut().find(|(fd, _)| *fd == r.fd) {
                Some((_, size)) => *size += r.size,
                None => files.push((r.fd, r.size)),
            }
        }
        files
            .iter()
            .map(|&(fd, size)| {
                // SAFETY: `stat` is plain integers, for which all-zero bytes are a valid value.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: fstat writes one `stat` into `st`, which we own for the call; `fd` is
                // a region's file (an invalid fd only makes the call fail).
                let ok = unsafe { libc::fstat(fd, &mut st) } == 0;
                if ok {
                    (st.st_blocks as u64 * 512).min(size)
                } else {
                    size
                }
            })
            .sum()
    }

    /// The guest address of the page at host address `addr`, if it is in RAM.
    pub fn gpa_of_host(&self, addr: usize) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| addr >= r.host_addr && ((addr - r.host_addr) as u64) < r.size)
            .map(|r| r.gpa + ((addr - r.host_addr) as u64 & !(PAGE_SIZE - 1)))
    }

    /// Drops `pages` pages from `gpa` (checked to be RAM in one region) out of the backing
    /// file (`fallocate(PUNCH_HOLE)`): they read as zero afterwards and, under userfaultfd,
    /// fault as missing. Postcopy's discard of stale pages.
    ///
    /// Contract (crate-internal): as for `Ram::read_pages`, the pages are the caller's alone
    /// until this returns.
    pub(crate) fn punch(&self, gpa: u64, pages: u64) -> std::io::Result<()> {
        self.check_run(gpa, pages).map_err(std::io::Error::other)?;
        let r = self
            .regions
            .iter()
            .find(|r| r.contains(gpa))
            .expect("check_run found the region");
        // SAFETY: fallocate on the region's backing file (`Ram::from_regions`'s contract) over
        // the file range of pages inside that region (checked above): it changes only guest
        // pages, which the caller holds alone, and punching never moves or unmaps the mapping.
        let ret = unsafe {
            libc::fallocate(
                r.fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                (r.file_offset + (gpa - r.gpa)) as libc::off_t,
                (pages * PAGE_SIZE) as libc::off_t,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The end (first byte after) of the region that holds `gpa`, if one does.
    pub fn region_end(&self, gpa: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| r.contains(gpa))
            .map(|r| r.gpa + r.size)
    }

    /// Checks that `pages` pages from `gpa` are RAM within one region.
    pub fn check_run(&self, gpa: u64, pages: u64) -> Result<(), RamError> {
        self.page(gpa)?;
        // The count is bounded before it is multiplied (the fuzzer's overflow, a run of
        // u64::MAX pages).
        if pages == 0 || pages > crate::wire::MAX_ZERO_RUN_PAGES {
            return Err(RamError::BadRun { gpa, pages });
        }
        let last = gpa
            .checked_add((pages - 1) * PAGE_SIZE)
            .ok_or(RamError::OutOfRange { gpa })?;
        if !self
            .regions
            .iter()
            .any(|r| r.contains(gpa) && r.contains(last))
        {
            return Err(RamError::BadRun { gpa, pages });
        }
        Ok(())
    }
}

#[cfg(test)]
impl Ram {
    /// A one-region `Ram` at guest address 0 over `bytes` (a whole number of pages), leaked so
    /// that it is mapped for as long as the process lives: for unit tests of code that reads
    /// guest memory.
    pub(crate) fn leaked_for_test(bytes: Vec<u8>) -> Ram {
        let bytes = bytes.leak();
        let region = RamRegion {
            host_addr: bytes.as_ptr() as usize,
            ..RamRegion::for_test(0, bytes.len() as u64)
        };
        // SAFETY: the region is a leaked heap allocation of `size` bytes, readable and
        // writable for the rest of the process; no other reference to it remains.
        unsafe { Ram::from_regions(vec![region]) }.expect("a whole number of pages")
    }
}

#[cfg(test)]
mod tests;
