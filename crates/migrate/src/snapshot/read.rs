//! Reading a snapshot file (docs/snapshot.md): the [`Reader`] that checks everything it hands
//! out against its CRC first.
//!
//! Invariants: a reader returns no byte of an area or a page whose CRC does not match; and it
//! allocates only for bytes the file holds on disk. Every length in the header is checked
//! against the file's length and the restoring side's [`Limits`] first, then every metadata
//! area is checked to be data, not a hole (`SEEK_DATA`/`SEEK_HOLE`: a writer writes each whole),
//! and read in chunks of [`READ_CHUNK`], its CRC summed as it comes. A crafted sparse file that
//! claims 64 TiB of RAM (a 64 GiB CRC table) is refused without a byte of it read.

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::error::{SnapshotError, zero_page_crc};
use super::format::{Area, FormatError, HEADER_SIZE, Header, Limits, MAGIC};
use super::hot;
use crate::ram::next_data_in_file;
use crate::wire::{PAGE_SIZE, crc, crc_append};

/// Bytes of a metadata area read at once: what the reader has allocated is what it has read,
/// plus at most this. A read of 1 MiB from the page cache takes about 100 µs, against the
/// microseconds a call costs: the chunking adds nothing measurable to a restore's open.
pub const READ_CHUNK: u64 = 1 << 20;

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
    /// Opens `path` with no bound on its guest RAM but the file's own: [`Reader::open_with`]
    /// and [`Limits::FILE_ONLY`].
    pub fn open(path: &Path) -> Result<Reader, SnapshotError> {
        Self::open_with(path, &Limits::FILE_ONLY)
    }

    /// Opens `path` and checks its header, and its guest RAM against `limits`; then that its
    /// configuration, device state, hot set and page CRC table are data on disk; then reads
    /// each and checks it against its CRC, and the hot set's runs against RAM.
    pub fn open_with(path: &Path, limits: &Limits) -> Result<Reader, SnapshotError> {
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
        let refused = |source| SnapshotError::Format {
            path: path.to_owned(),
            source,
        };
        let header = Header::decode(&b, len).map_err(refused)?;
        let h = &header;
        h.check_limits(limits).map_err(refused)?;
        for (area, a) in h.metadata() {
            if !is_data(&file, a).map_err(io("looking for the data in"))? {
                return Err(refused(FormatError::Hole {
                    area,
                    offset: a.offset,
                    len: a.len,
                }));
            }
        }
        let area = |name: &'static str, a: Area, want: u32| {
            let (bytes, sum) = read_area(&file, a).map_err(io("reading the metadata of"))?;
            if sum != want {
                return Err(SnapshotError::AreaChecksum {
                    path: path.to_owned(),
                    area: name,
                });
            }
            Ok(bytes)
        };
        let config = area("configuration", h.config, h.config_crc)?;
        let state = area("device state", h.state, h.state_crc)?;
        let hot = area("hot set", h.hot, h.hot_crc)?;
        let table = area("page checksums", h.crc_area(), h.crc_table_crc)?;
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap());
        let hot: Vec<(u64, u64)> = hot
            .chunks_exact(16)
            .map(|r| (word(&r[..8]), word(&r[8..])))
            .collect();
        let regions: Vec<(u64, u64)> = h.regions.iter().map(|r| (r.gpa, r.size)).collect();
        if let Err(index) = hot::check_runs(&hot, &regions) {
            let (gpa, pages) = hot[index];
            return Err(refused(FormatError::HotRun { index, gpa, pages }));
        }
        Ok(Reader {
            path: path.to_owned(),
            hot,
            crcs: table,
            config,
            state,
            header,
            file,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The open file (read-only): what a mapped restore maps guest RAM from.
    pub fn file(&self) -> &File {
        &self.file
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
                next_data_in_file(self.file.as_raw_fd(), at, end).map_err(io)?
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

/// Whether area `a` of `file` is data from its first byte to its last (an empty one is).
fn is_data(file: &File, a: Area) -> std::io::Result<bool> {
    let end = a.offset + a.len;
    Ok(a.len == 0
        || next_data_in_file(file.as_raw_fd(), a.offset, end)?
            .is_some_and(|(data, hole)| data <= a.offset && hole >= end))
}

/// Area `a` of `file` and its CRC32C, read [`READ_CHUNK`] bytes at a time: the buffer grows
/// with what was read, whatever the area's length says.
fn read_area(file: &File, a: Area) -> std::io::Result<(Vec<u8>, u32)> {
    let mut v = Vec::new();
    let mut sum = 0;
    while (v.len() as u64) < a.len {
        let at = v.len();
        let n = (a.len - at as u64).min(READ_CHUNK) as usize;
        v.resize(at + n, 0);
        file.read_exact_at(&mut v[at..], a.offset + at as u64)?;
        sum = crc_append(sum, &v[at..]);
    }
    Ok((v, sum))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    const MIB: u64 = 1 << 20;
    const TIB: u64 = 1 << 40;

    /// A complete snapshot of `regions` laid out as a writer lays it out, every page a hole,
    /// its areas written (the CRC table only if `table`) with their CRCs, and the file sized
    /// to the header's length: sparse, so a claim of any size costs a few pages.
    fn crafted(path: &Path, regions: &[(u64, u64)], hot: &[(u64, u64)], table: bool) -> Header {
        let (config, state) = (b"{\"vcpus\":1}".as_slice(), [9u8; 100]);
        let hot: Vec<u8> = hot
            .iter()
            .flat_map(|&(gpa, pages)| gpa.to_le_bytes().into_iter().chain(pages.to_le_bytes()))
            .collect();
        let runs = hot::max_hot_runs(regions);
        let mut h = Header::layout(1, [1; 16], regions, config.len() as u64, 100, runs);
        h.hot.len = hot.len() as u64;
        (h.complete, h.config_crc, h.state_crc, h.hot_crc) =
            (true, crc(config), crc(&state), crc(&hot));
        let f = File::create(path).unwrap();
        f.set_len(h.file_len()).unwrap();
        f.write_all_at(config, h.config.offset).unwrap();
        f.write_all_at(&state, h.state.offset).unwrap();
        f.write_all_at(&hot, h.hot.offset).unwrap();
        if table {
            let table: Vec<u8> = (0..h.pages())
                .flat_map(|_| zero_page_crc().to_le_bytes())
                .collect();
            h.crc_table_crc = crc(&table);
            f.write_all_at(&table, h.crc_table).unwrap();
        }
        f.write_all_at(&h.encode(), 0).unwrap();
        h
    }

    /// A tmpfs when there is one: its files may claim 64 TiB (ext4's stop at 16).
    fn dir() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
    }

    fn refusal(r: Result<Reader, SnapshotError>) -> FormatError {
        match r {
            Err(SnapshotError::Format { source, .. }) => source,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_small_sparse_file_claiming_huge_ram_is_refused_before_its_table_is_read() {
        let dir = dir();
        let path = dir.path().join("crafted.snap");
        for memory in [TIB, 64 * TIB] {
            let h = crafted(&path, &[(0, memory)], &[], false);
            let table = h.crc_area();
            // 4 bytes per page: a table of 1 GiB, then 64 GiB, all of it a hole.
            assert_eq!(table.len, memory / 1024);
            assert_eq!(
                refusal(Reader::open(&path)),
                FormatError::Hole {
                    area: "page checksums",
                    offset: table.offset,
                    len: table.len
                }
            );
            let limits = Limits {
                max_memory: 512 << 30,
            };
            assert_eq!(
                refusal(Reader::open_with(&path, &limits)),
                FormatError::TooLarge {
                    memory,
                    max: 512 << 30
                }
            );
        }
    }

    #[test]
    fn a_metadata_area_that_is_a_hole_is_refused_naming_it() {
        let dir = dir();
        let path = dir.path().join("crafted.snap");
        let regions = [(0, 8 * MIB), (16 * MIB, 2 * MIB)];
        let h = crafted(&path, &regions, &[(16 * MIB, 512), (4096, 3)], true);
        let r = Reader::open(&path).unwrap();
        assert_eq!(
            (r.config(), r.state()),
            (&b"{\"vcpus\":1}"[..], &[9u8; 100][..])
        );
        assert_eq!(r.hot(), &[(16 * MIB, 512), (4096, 3)]);
        assert_eq!(r.data_runs(512).unwrap(), vec![]);
        let punch = |a: Area| {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let flags = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
            nix::fcntl::fallocate(f.as_fd(), flags, a.offset as i64, a.len as i64).unwrap();
        };
        for (area, a) in [("page checksums", h.crc_area()), ("device state", h.state)] {
            punch(Area {
                offset: a.offset + a.len / 2 / 4096 * 4096,
                len: 4096,
            });
            let e = refusal(Reader::open(&path));
            assert_eq!(
                e,
                FormatError::Hole {
                    area,
                    offset: a.offset,
                    len: a.len
                }
            );
            assert!(e.to_string().contains("restore a whole copy"), "{e}");
        }
    }

    #[test]
    fn a_hot_run_a_writer_does_not_write_is_refused() {
        let dir = dir();
        let path = dir.path().join("crafted.snap");
        let regions = [(0, 8 * MIB)];
        // Checksummed, within the hot set's bound, but a run across two chunks.
        crafted(&path, &regions, &[(0, 1), (MIB, 512)], true);
        assert_eq!(
            refusal(Reader::open(&path)),
            FormatError::HotRun {
                index: 1,
                gpa: MIB,
                pages: 512
            }
        );
    }
}
