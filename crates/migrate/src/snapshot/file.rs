//! A snapshot file on disk (docs/snapshot.md): the [`Writer`] that fills one in parallel with
//! positioned writes and makes it complete only at the end, and the [`Reader`] that checks
//! everything it hands out against its CRC first.
//!
//! Invariants:
//! - Until [`Writer::finish`] returns, the file is `PATH.partial` with a header that says it is
//!   incomplete: a snapshot that fails half way leaves nothing that reads as a snapshot.
//! - Every page the writer is given is recorded in the CRC table as it is written, so a later
//!   pass that overwrites a page leaves the table matching the file; a zero page is a hole
//!   (punched, if a page was written there before) with the zero page's CRC.
//! - A reader returns no byte of an area or a page whose CRC does not match.

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::format::{FormatError, HEADER_SIZE, Header, MAGIC, MAX_STATE_BYTES};
use crate::wire::{PAGE_SIZE, crc};

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{during} {}: {source}", path.display())]
    Io {
        during: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Format {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    #[error(
        "{}: its {area} is damaged (its checksum does not match); restore another copy or take a new snapshot",
        path.display()
    )]
    AreaChecksum { path: PathBuf, area: &'static str },
    #[error(
        "{}: the page at {gpa:#x} is damaged (its checksum does not match); restore another copy or take a new snapshot",
        path.display()
    )]
    PageChecksum { path: PathBuf, gpa: u64 },
    #[error(
        "the file system of {} does not take direct I/O (O_DIRECT: {source}); snapshot without --direct-io",
        path.display()
    )]
    NoDirectIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a snapshot writer thread panicked (a bug in ferry)")]
    WriterPanicked,
    #[error("{gpa:#x} is not guest RAM in this snapshot")]
    OutsideRam { gpa: u64 },
    #[error("{what} of {len} bytes is more than the {reserved} bytes the snapshot reserved for it")]
    TooLarge {
        what: &'static str,
        len: u64,
        reserved: u64,
    },
}

/// A page of memory aligned to its size, as direct I/O (`O_DIRECT`) needs its buffers.
#[derive(
    Clone, zerocopy::FromBytes, zerocopy::IntoBytes, zerocopy::Immutable, zerocopy::KnownLayout,
)]
#[repr(C, align(4096))]
pub(crate) struct AlignedPage([u8; PAGE_SIZE as usize]);

/// A buffer of whole pages at a page-aligned address: what the snapshot's writers fill and
/// write, with or without direct I/O.
pub(crate) struct PageBuf(Vec<AlignedPage>);

impl PageBuf {
    /// `pages` zeroed pages (the memory is touched: see [`PageBuf::touch`] for why it matters).
    pub(crate) fn new(pages: usize) -> PageBuf {
        PageBuf(vec![AlignedPage([0; PAGE_SIZE as usize]); pages])
    }

    /// Writes a byte of every page, so that none is still to be faulted in when it is used.
    pub(crate) fn touch(&mut self) {
        for p in &mut self.0 {
            p.0[0] = 1;
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        zerocopy::IntoBytes::as_bytes(&self.0[..])
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        zerocopy::IntoBytes::as_mut_bytes(&mut self.0[..])
    }
}

/// The CRC32C of a page of zeros: what a hole holds.
fn zero_page_crc() -> u32 {
    crc(&[0u8; PAGE_SIZE as usize])
}

/// Fills a snapshot file; shared by the threads that write pages (`&self`).
#[derive(Debug)]
pub struct Writer {
    file: File,
    /// With direct I/O, a second descriptor of the file opened `O_DIRECT`, for the pages (the
    /// metadata areas are not whole pages, so they go through `file`).
    direct: Option<File>,
    partial: PathBuf,
    path: PathBuf,
    header: Header,
    /// Room reserved for the device state and the hot set (their lengths come at the end).
    reserved: (u64, u64),
    crcs: Vec<AtomicU32>,
    /// Renamed to its name: the drop leaves it.
    finished: bool,
}

/// A writer dropped before it finished removes its `.partial` file: nothing is left of a
/// snapshot that failed.
impl Drop for Writer {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

impl Writer {
    /// Creates `PATH.partial` for a VM of `vcpus` vCPUs with RAM `regions` (`(gpa, size)`) and
    /// `config`, sized to hold all of RAM (a sparse file), with room for the device state's
    /// bound and a hot set as large as RAM's pages allow, and an incomplete header.
    pub fn create(
        path: &Path,
        vcpus: u32,
        uuid: [u8; 16],
        regions: &[(u64, u64)],
        config: &[u8],
        direct_io: bool,
    ) -> Result<Writer, SnapshotError> {
        let pages: u64 = regions.iter().map(|r| r.1 / PAGE_SIZE).sum();
        let mut header = Header::layout(
            vcpus,
            uuid,
            regions,
            config.len() as u64,
            MAX_STATE_BYTES,
            pages,
        );
        let reserved = (header.state.len, header.hot.len);
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let io = |during| {
            let p = partial.clone();
            move |source| SnapshotError::Io {
                during,
                path: p,
                source,
            }
        };
        let file = File::create(&partial).map_err(io("creating"))?;
        file.set_len(header.file_len()).map_err(io("sizing"))?;
        file.write_all_at(config, header.config.offset)
            .map_err(io("writing the configuration to"))?;
        header.config_crc = crc(config);
        file.write_all_at(&header.encode(), 0)
            .map_err(io("writing the header of"))?;
        let direct = match direct_io {
            false => None,
            true => {
                use std::os::unix::fs::OpenOptionsExt;
                let opened = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&partial);
                match opened {
                    Ok(f) => Some(f),
                    Err(source) => {
                        let _ = std::fs::remove_file(&partial);
                        return Err(SnapshotError::NoDirectIo {
                            path: path.to_owned(),
                            source,
                        });
                    }
                }
            }
        };
        let zero = zero_page_crc();
        let crcs = (0..pages).map(|_| AtomicU32::new(zero)).collect();
        Ok(Writer {
            file,
            direct,
            partial,
            path: path.to_owned(),
            header,
            reserved,
            crcs,
            finished: false,
        })
    }

    fn io(&self, during: &'static str) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
        move |source| SnapshotError::Io {
            during,
            path: self.partial.clone(),
            source,
        }
    }

    /// Writes the page at `gpa` (4096 bytes) where it belongs, and records its CRC. A page of
    /// zeros is punched instead (a hole reads as zeros and takes no space).
    pub fn write_page(&self, gpa: u64, page: &[u8]) -> Result<(), SnapshotError> {
        self.write_pages(&[gpa], page).map(drop)
    }

    /// Writes `data`, one page per address of `gpas`, where the pages belong, and records their
    /// CRCs: the pages that follow one another in the file in one write, and each run of zero
    /// pages punched in one call (or left alone where the file holds zeros already: a page
    /// never written, or punched before). Returns how many of the pages were zeros.
    pub fn write_pages(&self, gpas: &[u64], data: &[u8]) -> Result<u64, SnapshotError> {
        assert_eq!(data.len() as u64, gpas.len() as u64 * PAGE_SIZE);
        let zero_crc = zero_page_crc();
        // The run being gathered: (file offset, first page's index in `data`, pages, zeros).
        let mut run: Option<(u64, usize, usize, bool)> = None;
        let mut zeros = 0;
        for (k, (&gpa, page)) in gpas
            .iter()
            .zip(data.chunks_exact(PAGE_SIZE as usize))
            .enumerate()
        {
            let (at, index) = self
                .header
                .locate(gpa)
                .ok_or(SnapshotError::OutsideRam { gpa })?;
            let slot = &self.crcs[index as usize];
            let zero = crate::zero::is_zero(page);
            zeros += u64::from(zero);
            if zero && slot.load(Ordering::Relaxed) == zero_crc {
                self.flush_run(run.take(), data)?;
                continue;
            }
            slot.store(if zero { zero_crc } else { crc(page) }, Ordering::Relaxed);
            match &mut run {
                Some((start, _, pages, z))
                    if *z == zero && *start + *pages as u64 * PAGE_SIZE == at =>
                {
                    *pages += 1
                }
                _ => {
                    self.flush_run(run.take(), data)?;
                    run = Some((at, k, 1, zero));
                }
            }
        }
        self.flush_run(run, data)?;
        Ok(zeros)
    }

    /// Writes (or punches) a run [`Writer::write_pages`] gathered.
    fn flush_run(
        &self,
        run: Option<(u64, usize, usize, bool)>,
        data: &[u8],
    ) -> Result<(), SnapshotError> {
        let Some((at, first, pages, zero)) = run else {
            return Ok(());
        };
        let page = PAGE_SIZE as usize;
        if zero {
            return self.punch(at, pages as u64 * PAGE_SIZE);
        }
        // With direct I/O the offsets and lengths are whole pages, and the callers' buffers
        // page-aligned (`PageBuf`).
        self.direct
            .as_ref()
            .unwrap_or(&self.file)
            .write_all_at(&data[first * page..(first + pages) * page], at)
            .map_err(self.io("writing pages to"))
    }

    fn punch(&self, at: u64, len: u64) -> Result<(), SnapshotError> {
        use std::os::fd::AsFd;
        nix::fcntl::fallocate(
            self.file.as_fd(),
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            at as i64,
            len as i64,
        )
        .map_err(std::io::Error::from)
        .map_err(self.io("punching zero pages out of"))
    }

    /// Ends the snapshot: writes the device `state` (sections as a migration carries them) and
    /// the `hot` runs, the CRC table, then, once all of it is on disk, the complete header;
    /// renames the file to its name. Returns the header written.
    pub fn finish(mut self, state: &[u8], hot: &[(u64, u64)]) -> Result<Header, SnapshotError> {
        let hot_bytes: Vec<u8> = hot
            .iter()
            .flat_map(|&(gpa, pages)| gpa.to_le_bytes().into_iter().chain(pages.to_le_bytes()))
            .collect();
        for (what, len, reserved) in [
            ("the device state", state.len() as u64, self.reserved.0),
            ("the hot set", hot_bytes.len() as u64, self.reserved.1),
        ] {
            if len > reserved {
                return Err(SnapshotError::TooLarge {
                    what,
                    len,
                    reserved,
                });
            }
        }
        let table: Vec<u8> = self
            .crcs
            .iter()
            .flat_map(|c| c.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        let h = &mut self.header;
        h.state.len = state.len() as u64;
        h.state_crc = crc(state);
        h.hot.len = hot_bytes.len() as u64;
        h.hot_crc = crc(&hot_bytes);
        h.crc_table_crc = crc(&table);
        h.complete = true;
        let (state_at, hot_at, table_at) = (h.state.offset, h.hot.offset, h.crc_table);
        let header = h.encode();
        let file = &self.file;
        file.write_all_at(state, state_at)
            .map_err(self.io("writing the device state to"))?;
        file.write_all_at(&hot_bytes, hot_at)
            .map_err(self.io("writing the hot set to"))?;
        file.write_all_at(&table, table_at)
            .map_err(self.io("writing the page checksums to"))?;
        file.sync_data().map_err(self.io("syncing"))?;
        file.write_all_at(&header, 0)
            .map_err(self.io("writing the header of"))?;
        file.sync_data().map_err(self.io("syncing"))?;
        std::fs::rename(&self.partial, &self.path).map_err(self.io("renaming"))?;
        self.finished = true;
        Ok(self.header.clone())
    }
}

/// A complete snapshot file, its metadata checked.
#[derive(Debug)]
pub struct Reader {
    file: File,
    path: PathBuf,
    header: Header,
    config: Vec<u8>,
    state: Vec<u8>,
    hot: Vec<(u64, u64)>,
    /// The page CRC table as the file holds it (4 little-endian bytes per page): kept as read,
    /// since a second copy of a table of 8 MiB for 8 GiB of RAM costs milliseconds of fresh
    /// memory on a lazy restore's way to the guest's first instruction.
    crcs: Vec<u8>,
}

impl Reader {
    /// Opens `path` and checks its header, then its configuration, device state, hot set and
    /// page CRC table against their CRCs.
    pub fn open(path: &Path) -> Result<Reader, SnapshotError> {
        let io = |during| {
            move |source| SnapshotError::Io {
                during,
                path: path.to_owned(),
                source,
            }
        };
        let file = File::open(path).map_err(io("opening"))?;
        let len = file.metadata().map_err(io("reading the size of"))?.len();
        let mut b = [0u8; HEADER_SIZE];
        if len < HEADER_SIZE as u64 {
            // A short file of something else is not a snapshot, rather than a cut one.
            let mut start = vec![0u8; len.min(MAGIC.len() as u64) as usize];
            file.read_exact_at(&mut start, 0)
                .map_err(io("reading the header of"))?;
            return Err(SnapshotError::Format {
                path: path.to_owned(),
                source: if MAGIC.starts_with(&start) {
                    FormatError::Truncated {
                        file: len,
                        needed: HEADER_SIZE as u64,
                    }
                } else {
                    FormatError::Magic
                },
            });
        }
        file.read_exact_at(&mut b, 0)
            .map_err(io("reading the header of"))?;
        let header = Header::decode(&b, len).map_err(|source| SnapshotError::Format {
            path: path.to_owned(),
            source,
        })?;
        let area = |name: &'static str, offset: u64, len: u64, want: u32| {
            let mut v = vec![0u8; len as usize];
            file.read_exact_at(&mut v, offset)
                .map_err(io("reading the metadata of"))?;
            if crc(&v) != want {
                return Err(SnapshotError::AreaChecksum {
                    path: path.to_owned(),
                    area: name,
                });
            }
            Ok(v)
        };
        let h = &header;
        let config = area("configuration", h.config.offset, h.config.len, h.config_crc)?;
        let state = area("device state", h.state.offset, h.state.len, h.state_crc)?;
        let hot = area("hot set", h.hot.offset, h.hot.len, h.hot_crc)?;
        let table = h.crc_area();
        let table = area("page checksums", table.offset, table.len, h.crc_table_crc)?;
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap());
        Ok(Reader {
            path: path.to_owned(),
            hot: hot
                .chunks_exact(16)
                .map(|r| (word(&r[..8]), word(&r[8..])))
                .collect(),
            crcs: table,
            config,
            state,
            header,
            file,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The VMM's configuration of the VM.
    pub fn config(&self) -> &[u8] {
        &self.config
    }

    /// The device state, as a migration's DeviceState records carry it.
    pub fn state(&self) -> &[u8] {
        &self.state
    }

    /// The hot set: runs `(gpa, pages)`, hottest first.
    pub fn hot(&self) -> &[(u64, u64)] {
        &self.hot
    }

    /// The CRC the table records for page `index`.
    fn page_crc(&self, index: u64) -> u32 {
        let at = index as usize * 4;
        u32::from_le_bytes(self.crcs[at..at + 4].try_into().expect("4 bytes"))
    }

    /// Reads the page at `gpa` into `into` (4096 bytes) and checks it against its CRC.
    pub fn read_page(&self, gpa: u64, into: &mut [u8]) -> Result<(), SnapshotError> {
        self.read_pages(gpa, into)
    }

    /// Reads the pages from `gpa` on (as many as `into` holds; inside one region) with one
    /// read, and checks each against its CRC.
    pub fn read_pages(&self, gpa: u64, into: &mut [u8]) -> Result<(), SnapshotError> {
        let pages = into.len() as u64 / PAGE_SIZE;
        let (at, first) = self
            .header
            .locate(gpa)
            .ok_or(SnapshotError::OutsideRam { gpa })?;
        let last = gpa + (pages.max(1) - 1) * PAGE_SIZE;
        if self.header.locate(last) != Some((at + (last - gpa), first + (last - gpa) / PAGE_SIZE)) {
            return Err(SnapshotError::OutsideRam { gpa: last });
        }
        self.file
            .read_exact_at(into, at)
            .map_err(|source| SnapshotError::Io {
                during: "reading pages of",
                path: self.path.clone(),
                source,
            })?;
        for (k, page) in into.chunks_exact(PAGE_SIZE as usize).enumerate() {
            if crc(page) != self.page_crc(first + k as u64) {
                return Err(SnapshotError::PageChecksum {
                    path: self.path.clone(),
                    gpa: gpa + k as u64 * PAGE_SIZE,
                });
            }
        }
        Ok(())
    }

    /// The pages the file holds data for, as runs `(gpa, pages)` of at most `max_pages`, in
    /// address order; the rest of RAM is holes (zero pages). Checks that every page in a hole
    /// has a zero page's CRC: a hole where the table recorded data is a damaged file.
    pub fn data_runs(&self, max_pages: u64) -> Result<Vec<(u64, u64)>, SnapshotError> {
        use std::os::fd::AsRawFd;
        let io = |source| SnapshotError::Io {
            during: "looking for the data in",
            path: self.path.clone(),
            source,
        };
        let zero = zero_page_crc();
        let mut runs = Vec::new();
        for r in &self.header.regions {
            let start = self.header.ram_offset + r.offset;
            let end = start + r.size;
            let mut at = start;
            let hole_check = |from: u64, to: u64| {
                for off in (from..to).step_by(PAGE_SIZE as usize) {
                    let index = (off - self.header.ram_offset) / PAGE_SIZE;
                    if self.page_crc(index) != zero {
                        return Err(SnapshotError::PageChecksum {
                            path: self.path.clone(),
                            gpa: r.gpa + (off - start),
                        });
                    }
                }
                Ok(())
            };
            while let Some((data, hole)) =
                crate::ram::next_data_in_file(self.file.as_raw_fd(), at, end).map_err(io)?
            {
                hole_check(at, data)?;
                let mut gpa = r.gpa + (data - start);
                let last = r.gpa + (hole.min(end) - start);
                while gpa < last {
                    let pages = ((last - gpa) / PAGE_SIZE).min(max_pages);
                    runs.push((gpa, pages));
                    gpa += pages * PAGE_SIZE;
                }
                at = hole.min(end);
            }
            hole_check(at, end)?;
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    const MIB: u64 = 1 << 20;
    const REGIONS: [(u64, u64); 2] = [(0, 4 * MIB), (16 * MIB, 2 * MIB)];

    fn page(seed: u64) -> Vec<u8> {
        (0..PAGE_SIZE).map(|i| (i * 31 + seed) as u8 | 1).collect()
    }

    /// Two passes over a few pages (the second overwrites one and zeroes another), then the
    /// state: the file is complete only after `finish`, every page reads back in its last
    /// version, holes read as zeros, and the file holds little more than what was written.
    #[test]
    fn a_snapshot_written_in_passes_reads_back_its_last_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.snap");
        let w = Writer::create(&path, 2, [3; 16], &REGIONS, b"config", false).unwrap();
        let partial = dir.path().join("vm.snap.partial");
        assert!(!path.exists() && partial.exists());
        let err = Reader::open(&partial).unwrap_err();
        assert!(matches!(
            err,
            SnapshotError::Format {
                source: FormatError::Incomplete,
                ..
            }
        ));
        let pages = [0x1000, 0x3000, 16 * MIB, 16 * MIB + 0x5000];
        for (i, &gpa) in pages.iter().enumerate() {
            w.write_page(gpa, &page(i as u64)).unwrap();
        }
        // The second pass: one page written again, one now zero.
        w.write_page(0x3000, &page(99)).unwrap();
        w.write_page(16 * MIB, &[0u8; 4096]).unwrap();
        assert!(matches!(
            w.write_page(8 * MIB, &page(1)),
            Err(SnapshotError::OutsideRam { .. })
        ));
        let header = w.finish(b"sections", &[(0x3000, 1), (0x1000, 1)]).unwrap();
        assert!(path.exists() && !partial.exists());

        let r = Reader::open(&path).unwrap();
        assert_eq!(r.header(), &header);
        assert_eq!((r.config(), r.state()), (&b"config"[..], &b"sections"[..]));
        assert_eq!(r.hot(), &[(0x3000, 1), (0x1000, 1)]);
        let mut got = vec![0u8; 4096];
        for (gpa, want) in [
            (0x1000, page(0)),
            (0x3000, page(99)),
            (16 * MIB, vec![0u8; 4096]),
            (16 * MIB + 0x5000, page(3)),
            (0x2000, vec![0u8; 4096]),
        ] {
            r.read_page(gpa, &mut got).unwrap();
            assert!(got == want, "page {gpa:#x}");
        }
        // Sparse: a few pages and the metadata, not 6 MiB of RAM.
        let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(allocated < 64 * 4096, "{allocated} bytes allocated");
    }

    /// A flipped byte in a page, in the state, or in the CRC table is found before use.
    #[test]
    fn a_damaged_byte_is_refused_naming_what_it_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.snap");
        let w = Writer::create(&path, 1, [4; 16], &REGIONS, b"c", false).unwrap();
        w.write_page(0x2000, &page(5)).unwrap();
        let header = w.finish(b"state", &[]).unwrap();
        let flip = |at: u64| {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .read(true)
                .open(&path)
                .unwrap();
            let mut b = [0u8];
            f.read_exact_at(&mut b, at).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
        };
        let (page_at, _) = header.locate(0x2000).unwrap();
        flip(page_at + 100);
        let r = Reader::open(&path).unwrap();
        let mut got = vec![0u8; 4096];
        assert!(matches!(
            r.read_page(0x2000, &mut got),
            Err(SnapshotError::PageChecksum { gpa: 0x2000, .. })
        ));
        flip(page_at + 100);
        flip(header.state.offset + 1);
        let e = Reader::open(&path).unwrap_err();
        assert!(
            matches!(
                e,
                SnapshotError::AreaChecksum {
                    area: "device state",
                    ..
                }
            ),
            "{e}"
        );
        flip(header.state.offset + 1);
        flip(header.crc_table + 8);
        let e = Reader::open(&path).unwrap_err();
        assert!(
            matches!(
                e,
                SnapshotError::AreaChecksum {
                    area: "page checksums",
                    ..
                }
            ),
            "{e}"
        );
        flip(header.crc_table + 8);
        // Cut short: the header says more than the file holds.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(header.file_len() - 4096).unwrap();
        let e = Reader::open(&path).unwrap_err();
        assert!(e.to_string().contains("cut short"), "{e}");
    }
}
