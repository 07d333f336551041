//! The snapshot file's header and layout (docs/snapshot.md is normative): encoding, decoding
//! with every check the document lists, and where a page, its CRC and each area lie. Pure: a
//! reader hands it the header's 4096 bytes and the file's length, and gets a [`Header`] whose
//! every offset is inside the file and apart from the others, or the reason it is refused.
//!
//! Every length the header states is bounded by what a writer writes (the hot set: one run per
//! 2 MiB chunk, [`max_hot_runs`]), by the file's length, and by the restoring side's
//! [`Limits`], before a reader allocates for it; that the metadata areas are data on disk, not
//! holes, is the reader's check (`read.rs`), and [`Header::metadata`] lists them for it.

#![forbid(unsafe_code)]

pub use super::hot::max_hot_runs;
use crate::ram::Size;
use crate::wire::{PAGE_SIZE, crc as crc32c};

/// The header's size: one page.
pub const HEADER_SIZE: usize = 4096;
/// The file's magic.
pub const MAGIC: [u8; 8] = *b"FERRYSNP";
/// The format version this ferry writes and reads.
pub const VERSION: u32 = 1;
/// Flag: the snapshot finished; set in its last write.
pub const COMPLETE: u32 = 1;
/// Guest RAM starts at a multiple of this in the file (huge pages, `O_DIRECT`).
pub const RAM_ALIGN: u64 = 2 << 20;
/// Most RAM regions a header describes (the reference VMM has 2: below and above the PCI hole).
pub const MAX_REGIONS: usize = 16;
/// Most vCPUs (the reference VMM's bound).
pub const MAX_VCPUS: u32 = 255;
/// The bounds a migration puts on what the VMM sends, kept for a file.
pub const MAX_CONFIG_BYTES: u64 = crate::wire::MAX_CONFIG_BYTES;
pub const MAX_STATE_BYTES: u64 = crate::wire::MAX_STATE_BYTES;
/// Bytes of a hot-set run: `(gpa, pages)`.
pub const HOT_RUN_SIZE: u64 = 16;
/// Bytes of a page's CRC in the table.
pub const PAGE_CRC_SIZE: u64 = 4;

const REGIONS_AT: usize = 136;
const REGION_SIZE: usize = 24;
const CRC_AT: usize = HEADER_SIZE - 4;

/// A region of guest RAM and where its pages lie in the RAM area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub gpa: u64,
    pub size: u64,
    /// Offset of its first page from the start of the RAM area.
    pub offset: u64,
}

/// An area of the file: where it starts and how long it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Area {
    pub offset: u64,
    pub len: u64,
}

impl Area {
    fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// What the restoring side can hold, checked against the header before anything is read
/// past it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of guest RAM: the VM restored into (its RAM is the file's, or the restore is
    /// refused), or the largest VM the restoring VMM makes.
    pub max_memory: u64,
}

impl Limits {
    /// No bound but the file's own: what the file holds on disk bounds what a reader
    /// allocates (a test, a tool that only reads the file).
    pub const FILE_ONLY: Limits = Limits {
        max_memory: u64::MAX,
    };
}

/// A snapshot file's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub complete: bool,
    pub vcpus: u32,
    pub uuid: [u8; 16],
    pub regions: Vec<Region>,
    pub config: Area,
    pub config_crc: u32,
    pub state: Area,
    pub state_crc: u32,
    pub hot: Area,
    pub hot_crc: u32,
    /// The page CRC table; its length is [`PAGE_CRC_SIZE`] per page of RAM.
    pub crc_table: u64,
    pub crc_table_crc: u32,
    pub ram_offset: u64,
}

/// Why a snapshot file is refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("not a ferry snapshot (its first bytes are not FERRYSNP)")]
    Magic,
    #[error(
        "snapshot format version {0}, this ferry reads version {VERSION}: restore it with the ferry that wrote it"
    )]
    Version(u32),
    #[error(
        "the snapshot's header is damaged (its checksum does not match); restore another copy or take a new snapshot"
    )]
    HeaderChecksum,
    #[error("the snapshot is incomplete: the snapshot that wrote it failed or is still running")]
    Incomplete,
    #[error("the snapshot's header is invalid: {0}")]
    Invalid(Invalid),
    #[error(
        "the snapshot file is {file} bytes, its header describes {needed}: it was cut short; restore a whole copy or take a new snapshot"
    )]
    Truncated { file: u64, needed: u64 },
    #[error(
        "the snapshot holds {} of guest RAM, more than the {} this restore can hold; restore it into a VM of its size, on a host that maps that much",
        Size(*memory), Size(*max)
    )]
    TooLarge { memory: u64, max: u64 },
    #[error(
        "the snapshot's {area} ({len} bytes at {offset:#x}) is a hole in the file where a writer writes data: the file was cut, punched or made up; restore a whole copy or take a new snapshot"
    )]
    Hole {
        area: &'static str,
        offset: u64,
        len: u64,
    },
    #[error(
        "the snapshot's hot set is invalid: run {index} ({pages} pages at {gpa:#x}) is not inside one RAM region and one 2 MiB chunk; restore another copy or take a new snapshot"
    )]
    HotRun { index: usize, gpa: u64, pages: u64 },
}

/// A header field a reader refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("unknown flags {0:#x}")]
    Flags(u32),
    #[error("page size {0}, not 4096")]
    PageSize(u32),
    #[error("{0} vCPUs (1 to {MAX_VCPUS})")]
    Vcpus(u32),
    #[error("{0} RAM regions (1 to {MAX_REGIONS})")]
    Regions(u32),
    #[error(
        "RAM region {0} is not whole pages, overlaps the one before, or is not packed after it in the file"
    )]
    Region(usize),
    #[error("the regions' sizes add up to {regions} bytes, the header says {memory}")]
    MemorySize { regions: u64, memory: u64 },
    #[error("the {area} area is {len} bytes, over its bound of {max}")]
    Bound {
        area: &'static str,
        len: u64,
        max: u64,
    },
    #[error("the hot set is {0} bytes, not whole 16-byte runs")]
    HotLen(u64),
    #[error("the {0} area is not between the header and guest RAM, or overlaps another")]
    Placement(&'static str),
    #[error("guest RAM starts at {0:#x}, not a multiple of 2 MiB")]
    RamAlign(u64),
    #[error("reserved bytes are not zero")]
    Reserved,
}

impl From<Invalid> for FormatError {
    fn from(e: Invalid) -> Self {
        FormatError::Invalid(e)
    }
}

impl Header {
    /// Bytes of guest RAM.
    pub fn memory_size(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// Pages of guest RAM.
    pub fn pages(&self) -> u64 {
        self.memory_size() / PAGE_SIZE
    }

    /// The page CRC table's area.
    pub fn crc_area(&self) -> Area {
        Area {
            offset: self.crc_table,
            len: self.pages() * PAGE_CRC_SIZE,
        }
    }

    /// The metadata areas a writer writes whole, by name: a reader checks each is data on disk
    /// before it reads it.
    pub fn metadata(&self) -> [(&'static str, Area); 4] {
        [
            ("configuration", self.config),
            ("device state", self.state),
            ("hot set", self.hot),
            ("page checksums", self.crc_area()),
        ]
    }

    /// Refuses a header whose guest RAM is more than `limits` hold.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), FormatError> {
        let memory = self.memory_size();
        if memory > limits.max_memory {
            return Err(FormatError::TooLarge {
                memory,
                max: limits.max_memory,
            });
        }
        Ok(())
    }

    /// The file's length: the header area and guest RAM.
    pub fn file_len(&self) -> u64 {
        self.ram_offset + self.memory_size()
    }

    /// Where the page at `gpa` lies in the file, and its index in the CRC table; `None` for an
    /// address outside RAM.
    pub fn locate(&self, gpa: u64) -> Option<(u64, u64)> {
        let r = self
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa - r.gpa < r.size)?;
        let within = (gpa - r.gpa) & !(PAGE_SIZE - 1);
        let offset = r.offset + within;
        Some((self.ram_offset + offset, offset / PAGE_SIZE))
    }

    /// A header for `regions` (packed in the RAM area in order) with room for `config_len`
    /// bytes of configuration, `state_len` of device state and `hot_runs` runs, the areas laid
    /// out one after another, page-aligned, and guest RAM after them. The CRCs are zero and
    /// the snapshot is not complete: the writer fills them in last.
    pub fn layout(
        vcpus: u32,
        uuid: [u8; 16],
        regions: &[(u64, u64)],
        config_len: u64,
        state_len: u64,
        hot_runs: u64,
    ) -> Header {
        let mut offset = 0;
        let regions: Vec<Region> = regions
            .iter()
            .map(|&(gpa, size)| {
                let r = Region { gpa, size, offset };
                offset += size;
                r
            })
            .collect();
        let pages = offset / PAGE_SIZE;
        let mut at = HEADER_SIZE as u64;
        let mut area = |len: u64| {
            let a = Area { offset: at, len };
            at = (at + len).next_multiple_of(PAGE_SIZE);
            a
        };
        let config = area(config_len);
        let state = area(state_len);
        let hot = area(hot_runs * HOT_RUN_SIZE);
        let crc_table = area(pages * PAGE_CRC_SIZE).offset;
        Header {
            complete: false,
            vcpus,
            uuid,
            regions,
            config,
            config_crc: 0,
            state,
            state_crc: 0,
            hot,
            hot_crc: 0,
            crc_table,
            crc_table_crc: 0,
            ram_offset: at.next_multiple_of(RAM_ALIGN),
        }
    }

    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &MAGIC);
        put(8, &VERSION.to_le_bytes());
        put(
            12,
            &(if self.complete { COMPLETE } else { 0 }).to_le_bytes(),
        );
        put(16, &(PAGE_SIZE as u32).to_le_bytes());
        put(20, &self.vcpus.to_le_bytes());
        put(24, &self.memory_size().to_le_bytes());
        put(32, &(self.regions.len() as u32).to_le_bytes());
        put(40, &self.uuid);
        put(56, &self.config.offset.to_le_bytes());
        put(64, &self.config.len.to_le_bytes());
        put(72, &self.config_crc.to_le_bytes());
        put(76, &self.state_crc.to_le_bytes());
        put(80, &self.state.offset.to_le_bytes());
        put(88, &self.state.len.to_le_bytes());
        put(96, &self.hot.offset.to_le_bytes());
        put(104, &self.hot.len.to_le_bytes());
        put(112, &self.hot_crc.to_le_bytes());
        put(116, &self.crc_table_crc.to_le_bytes());
        put(120, &self.crc_table.to_le_bytes());
        put(128, &self.ram_offset.to_le_bytes());
        for (i, r) in self.regions.iter().enumerate() {
            let at = REGIONS_AT + i * REGION_SIZE;
            put(at, &r.gpa.to_le_bytes());
            put(at + 8, &r.size.to_le_bytes());
            put(at + 16, &r.offset.to_le_bytes());
        }
        let crc = crc32c(&b[..CRC_AT]);
        b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header read from a file of `file_len` bytes: the magic and version,
    /// then the checksum before any other field is used, then every field and that every area
    /// lies inside the file, between the header and guest RAM, apart from the others.
    pub fn decode(b: &[u8; HEADER_SIZE], file_len: u64) -> Result<Header, FormatError> {
        let u32_at = |at| le32(b, at);
        if b[..8] != MAGIC {
            return Err(FormatError::Magic);
        }
        if u32_at(8) != VERSION {
            return Err(FormatError::Version(u32_at(8)));
        }
        if crc32c(&b[..CRC_AT]) != u32_at(CRC_AT) {
            return Err(FormatError::HeaderChecksum);
        }
        let flags = u32_at(12);
        if flags & !COMPLETE != 0 {
            return Err(Invalid::Flags(flags).into());
        }
        if flags & COMPLETE == 0 {
            return Err(FormatError::Incomplete);
        }
        Self::fields(b, flags, file_len)
    }

    fn fields(b: &[u8; HEADER_SIZE], flags: u32, file_len: u64) -> Result<Header, FormatError> {
        let (u32_at, u64_at) = (|at| le32(b, at), |at| le64(b, at));
        if u32_at(16) != PAGE_SIZE as u32 {
            return Err(Invalid::PageSize(u32_at(16)).into());
        }
        let vcpus = u32_at(20);
        if vcpus == 0 || vcpus > MAX_VCPUS {
            return Err(Invalid::Vcpus(vcpus).into());
        }
        let n = u32_at(32);
        if n == 0 || n as usize > MAX_REGIONS {
            return Err(Invalid::Regions(n).into());
        }
        let end = REGIONS_AT + n as usize * REGION_SIZE;
        if u32_at(36) != 0 || b[end..CRC_AT].iter().any(|&x| x != 0) {
            return Err(Invalid::Reserved.into());
        }
        let mut regions: Vec<Region> = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            let at = REGIONS_AT + i * REGION_SIZE;
            let r = Region {
                gpa: u64_at(at),
                size: u64_at(at + 8),
                offset: u64_at(at + 16),
            };
            let packed = regions.last().map_or(0, |p| p.offset + p.size);
            let after = regions.last().is_none_or(|p| r.gpa >= p.gpa + p.size);
            let whole = r.size > 0 && (r.gpa | r.size).is_multiple_of(PAGE_SIZE);
            if !whole || !after || r.offset != packed || r.gpa.checked_add(r.size).is_none() {
                return Err(Invalid::Region(i).into());
            }
            regions.push(r);
        }
        let area = |offset: usize| Area {
            offset: u64_at(offset),
            len: u64_at(offset + 8),
        };
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[40..56]);
        let h = Header {
            complete: flags & COMPLETE != 0,
            vcpus,
            uuid,
            regions,
            config: area(56),
            config_crc: u32_at(72),
            state_crc: u32_at(76),
            state: area(80),
            hot: area(96),
            hot_crc: u32_at(112),
            crc_table_crc: u32_at(116),
            crc_table: u64_at(120),
            ram_offset: u64_at(128),
        };
        let memory = u64_at(24);
        // Summed with overflow checked: the regions are packed, so their offsets bound it.
        let last = h.regions.last().expect("one region or more");
        let regions_total = last.offset.checked_add(last.size);
        if regions_total != Some(memory) {
            return Err(Invalid::MemorySize {
                regions: regions_total.unwrap_or(u64::MAX),
                memory,
            }
            .into());
        }
        h.check_areas()?;
        let needed = h
            .ram_offset
            .checked_add(memory)
            .ok_or(Invalid::Placement("guest RAM"))?;
        if file_len < needed {
            return Err(FormatError::Truncated {
                file: file_len,
                needed,
            });
        }
        Ok(h)
    }

    /// Every area within its bound, between the header and guest RAM, apart from the others.
    fn check_areas(&self) -> Result<(), Invalid> {
        if !self.ram_offset.is_multiple_of(RAM_ALIGN) {
            return Err(Invalid::RamAlign(self.ram_offset));
        }
        let regions: Vec<(u64, u64)> = self.regions.iter().map(|r| (r.gpa, r.size)).collect();
        let bounds = [
            ("configuration", self.config, MAX_CONFIG_BYTES),
            ("device state", self.state, MAX_STATE_BYTES),
            (
                "hot set",
                self.hot,
                max_hot_runs(&regions).saturating_mul(HOT_RUN_SIZE),
            ),
        ];
        for (area, a, max) in bounds {
            if a.len > max {
                return Err(Invalid::Bound {
                    area,
                    len: a.len,
                    max,
                });
            }
        }
        if !self.hot.len.is_multiple_of(HOT_RUN_SIZE) {
            return Err(Invalid::HotLen(self.hot.len));
        }
        let mut areas = self.metadata();
        for (name, a) in areas {
            let inside = a.offset >= HEADER_SIZE as u64
                && a.offset
                    .checked_add(a.len)
                    .is_some_and(|e| e <= self.ram_offset);
            if !inside {
                return Err(Invalid::Placement(name));
            }
        }
        areas.sort_by_key(|(_, a)| a.offset);
        for w in areas.windows(2) {
            if w[0].1.end() > w[1].1.offset {
                return Err(Invalid::Placement(w[1].0));
            }
        }
        Ok(())
    }
}

/// The little-endian integer at byte `at` of the header.
fn le32(b: &[u8; HEADER_SIZE], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8; HEADER_SIZE], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The reference VMM's shape: RAM below the PCI hole and above 4 GiB.
    fn sample() -> Header {
        let mut h = Header::layout(
            2,
            [7; 16],
            &[(0, 3072 * MIB), (4096 * MIB, 1024 * MIB)],
            300,
            9_000,
            64,
        );
        h.complete = true;
        h.config_crc = 1;
        h.state_crc = 2;
        h.hot_crc = 3;
        h.crc_table_crc = 4;
        h
    }

    #[test]
    fn a_header_round_trips_and_places_every_page() {
        let h = sample();
        let b = h.encode();
        assert_eq!(Header::decode(&b, h.file_len()).unwrap(), h);
        assert_eq!(h.ram_offset % RAM_ALIGN, 0);
        // 1 Mi pages: a 4 MiB CRC table after the small areas, RAM after it.
        assert_eq!(h.crc_area().len, 4 * MIB);
        assert!(h.crc_area().end() <= h.ram_offset);
        assert_eq!(h.locate(0), Some((h.ram_offset, 0)));
        assert_eq!(h.locate(0x1234), Some((h.ram_offset + 0x1000, 1)));
        // The first page above 4 GiB follows the last page below the hole.
        let (at, index) = h.locate(4096 * MIB).unwrap();
        assert_eq!(at, h.ram_offset + 3072 * MIB);
        assert_eq!(index, 3072 * MIB / PAGE_SIZE);
        assert_eq!(h.locate(3072 * MIB), None, "the hole is not RAM");
        assert_eq!(h.locate(5120 * MIB), None);
        assert_eq!(h.file_len(), h.ram_offset + 4096 * MIB);
    }

    fn decode_changed(at: usize, bytes: &[u8]) -> Result<Header, FormatError> {
        let h = sample();
        let mut b = h.encode();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        let crc = crc32c(&b[..CRC_AT]);
        b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        Header::decode(&b, h.file_len())
    }

    #[test]
    fn a_damaged_or_unfinished_header_is_refused_before_its_fields_are_used() {
        let h = sample();
        let good = h.encode();
        let len = h.file_len();
        let mut b = good;
        b[0] = b'X';
        assert_eq!(Header::decode(&b, len), Err(FormatError::Magic));
        let mut b = good;
        b[8] = 2;
        assert_eq!(Header::decode(&b, len), Err(FormatError::Version(2)));
        // A flipped bit anywhere the checksum covers.
        for at in [12, 24, 60, 130, 200, 4000] {
            let mut b = good;
            b[at] ^= 0x10;
            assert_eq!(
                Header::decode(&b, len),
                Err(FormatError::HeaderChecksum),
                "byte {at}"
            );
        }
        let mut unfinished = h.clone();
        unfinished.complete = false;
        assert_eq!(
            Header::decode(&unfinished.encode(), len),
            Err(FormatError::Incomplete)
        );
        assert_eq!(
            Header::decode(&good, len - 1),
            Err(FormatError::Truncated {
                file: len - 1,
                needed: len
            })
        );
    }

    #[test]
    fn every_field_a_reader_cannot_trust_is_refused() {
        let inv = |e: Result<Header, FormatError>| match e {
            Err(FormatError::Invalid(i)) => i,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            inv(decode_changed(12, &3u32.to_le_bytes())),
            Invalid::Flags(3)
        );
        assert_eq!(
            inv(decode_changed(16, &8192u32.to_le_bytes())),
            Invalid::PageSize(8192)
        );
        assert_eq!(
            inv(decode_changed(20, &0u32.to_le_bytes())),
            Invalid::Vcpus(0)
        );
        assert_eq!(
            inv(decode_changed(32, &17u32.to_le_bytes())),
            Invalid::Regions(17)
        );
        assert_eq!(inv(decode_changed(36, &[1])), Invalid::Reserved);
        assert_eq!(inv(decode_changed(3000, &[1])), Invalid::Reserved);
        // The second region starting inside the first, not packed after it, not whole pages.
        assert_eq!(
            inv(decode_changed(160, &MIB.to_le_bytes())),
            Invalid::Region(1)
        );
        assert_eq!(
            inv(decode_changed(176, &0u64.to_le_bytes())),
            Invalid::Region(1)
        );
        assert_eq!(
            inv(decode_changed(168, &(MIB + 1).to_le_bytes())),
            Invalid::Region(1)
        );
        assert!(matches!(
            inv(decode_changed(24, &MIB.to_le_bytes())),
            Invalid::MemorySize { .. }
        ));
        // Areas over their bounds, outside the metadata space, or on top of each other.
        let config_len = 64;
        assert_eq!(
            inv(decode_changed(
                config_len,
                &(MAX_CONFIG_BYTES + 1).to_le_bytes()
            )),
            Invalid::Bound {
                area: "configuration",
                len: MAX_CONFIG_BYTES + 1,
                max: MAX_CONFIG_BYTES
            }
        );
        assert_eq!(
            inv(decode_changed(104, &17u64.to_le_bytes())),
            Invalid::HotLen(17)
        );
        assert_eq!(
            inv(decode_changed(56, &0u64.to_le_bytes())),
            Invalid::Placement("configuration")
        );
        let h = sample();
        assert_eq!(
            inv(decode_changed(80, &h.config.offset.to_le_bytes())),
            Invalid::Placement("device state")
        );
        assert_eq!(
            inv(decode_changed(120, &(h.ram_offset - 4).to_le_bytes())),
            Invalid::Placement("page checksums")
        );
        assert_eq!(
            inv(decode_changed(128, &(h.ram_offset + 4096).to_le_bytes())),
            Invalid::RamAlign(h.ram_offset + 4096)
        );
    }

    #[test]
    fn a_hot_set_longer_than_one_run_per_chunk_is_refused() {
        let h = sample();
        // 4 GiB in two 2 MiB-aligned regions: 2048 chunks.
        let max = 2048 * HOT_RUN_SIZE;
        let regions: Vec<(u64, u64)> = h.regions.iter().map(|r| (r.gpa, r.size)).collect();
        assert_eq!(max_hot_runs(&regions) * HOT_RUN_SIZE, max);
        let hot_len = |len: u64| match decode_changed(104, &len.to_le_bytes()) {
            Err(FormatError::Invalid(i)) => Some(i),
            _ => None,
        };
        let over = |len| Invalid::Bound {
            area: "hot set",
            len,
            max,
        };
        assert_eq!(hot_len(max + 16), Some(over(max + 16)));
        // The bound before: one run per page, 512 times as long.
        assert_eq!(hot_len(h.pages() * 16), Some(over(h.pages() * 16)));
        // At the bound, only where it lies stops it (the sample reserved 64 runs).
        assert_eq!(hot_len(max), Some(Invalid::Placement("page checksums")));
    }

    #[test]
    fn guest_ram_over_the_restoring_sides_limit_is_refused_from_the_header() {
        const TIB: u64 = 1 << 40;
        for memory in [TIB, 64 * TIB] {
            let mut h = Header::layout(1, [1; 16], &[(0, memory)], 0, 0, 0);
            h.complete = true;
            // It decodes over a file of its length (sparse: the reader finds the holes)...
            assert_eq!(Header::decode(&h.encode(), h.file_len()).as_ref(), Ok(&h));
            assert_eq!(h.check_limits(&Limits::FILE_ONLY), Ok(()));
            // ...and is refused by a host that holds less, with both figures.
            let limits = Limits {
                max_memory: 512 << 30,
            };
            let e = h.check_limits(&limits).unwrap_err();
            assert_eq!(
                e,
                FormatError::TooLarge {
                    memory,
                    max: 512 << 30
                }
            );
            assert!(e.to_string().contains("512G"), "{e}");
        }
    }
}
