#![forbid(unsafe_code)]
//! Wire protocol v4: pure encoding and validation, no I/O and no `unsafe`. `docs/protocol.md`
//! is the normative text; this module is its implementation and its tests.
//!
//! A connection starts with a 64-byte [`Hello`] from the source and a 64-byte [`Hello`] reply
//! from the destination, then carries records: a 24-byte [`Header`] and a payload whose length
//! the header gives and `Header::validate` bounds. All integers are little-endian.
//!
//! Every hello and header carries a CRC32C of its own bytes, and every header a CRC32C of its
//! record's payload (of a Pages record: its addresses, and its page data too when
//! [`Capabilities::CHECKSUM_PAGES`] was granted), so a byte changed on the way is refused
//! before it is used rather than trusted to TCP's 16-bit checksum.

/// "FERRYMIG".
pub const MAGIC: [u8; 8] = *b"FERRYMIG";
/// Version 2 added opaque device-state sections (VMM-chosen id, instance, version) and
/// capability bits in the hello; version 3, the state parts in the Resumed record; version 4,
/// checksums on hellos, headers and payloads.
pub const VERSION: u32 = 4;
pub const HELLO_SIZE: usize = 64;
/// `kind:u16 reserved:u16 count:u32 len:u64 payload_crc:u32 header_crc:u32`.
pub const HEADER_SIZE: usize = 24;
/// Guest page size on the wire.
pub const PAGE_SIZE: u64 = 4096;
/// Pages in one Pages record: 512 × 4 KiB = 2 MiB, big enough that per-record overhead is
/// 0.2% and small enough that the sender checks its clock and rate limit every ~1 ms at
/// 2 GB/s.
pub const MAX_PAGES_PER_RECORD: u32 = 512;
/// Runs in one ZeroRuns record (64 KiB of runs).
pub const MAX_ZERO_RUNS_PER_RECORD: u32 = 4096;
/// Pages in one zero run: 1 GiB, so a run never spans more than a region's worth of checks.
pub const MAX_ZERO_RUN_PAGES: u64 = 1 << 18;
/// Data channels a migration may open (each is a thread on both sides).
pub const MAX_CHANNELS: u16 = 64;
/// A device-state section's data: a vCPU's state is a few KiB (XSAVE is the bulk); 1 MiB bounds
/// what a hostile source can make the destination buffer for one section, as Firecracker caps
/// snapshot state.
pub const MAX_SECTION_BYTES: u64 = 1 << 20;
/// The [`SectionHeader`] that starts a DeviceState payload.
pub const SECTION_HEADER_SIZE: usize = 16;
/// Sections in one migration: 64 vCPUs × (vCPU + local APIC) is 128, the interrupt controller
/// and devices a few dozen more; 1024 leaves room for many virtio devices.
pub const MAX_SECTIONS: usize = 1024;
/// All device state of one migration: 64 vCPUs × ~16 KiB is 1 MiB; 64 MiB bounds what the
/// destination buffers before it loads (it holds every section until Complete).
pub const MAX_STATE_BYTES: u64 = 64 << 20;
/// An error message.
pub const MAX_ERROR_BYTES: u64 = 4096;
/// An Error record's count: the sayer failed (and always without [`Capabilities::ERROR_CODES`]).
pub const ERROR_FAILED: u32 = 0;
/// An Error record's count: the sayer's operator cancelled the migration.
pub const ERROR_CANCELLED: u32 = 1;
/// Cap on a VmConfig record: a VMM's description of its VM (vCPUs, devices, a CPUID digest)
/// is a few hundred bytes; 64 KiB leaves room for a CPUID table in full.
pub const MAX_CONFIG_BYTES: u64 = 64 << 10;
/// The Resumed payload's fixed part: `load_ns:u64 resume_ns:u64 cpu_ns:u64`; the header's
/// count of state parts follows (see [`ResumedRecord`]).
pub const RESUMED_SIZE: u64 = 24;
/// Most state parts a Resumed record lists: ferry's VMM names two per vCPU (64 at most), its
/// devices and its own steps; the rest is room.
pub const MAX_STATE_PARTS: u32 = 1024;
/// Longest name of a state part, in bytes of UTF-8.
pub const MAX_PART_NAME: usize = 64;
/// A state part in a Resumed record before its name: `ns:u64 bytes:u64 name_len:u16`.
const PART_HEAD: usize = 18;
/// The Received payload: `bytes:u64 pages:u64`.
pub const RECEIVED_SIZE: u64 = 16;
/// Buckets of a [`Latencies`] histogram: bucket k counts latencies in [2^k, 2^(k+1)) µs.
pub const LATENCY_BUCKETS: usize = 32;
/// The Done payload: a [`Latencies`], `requests:u64 sum_us:u64 max_us:u64` and the buckets.
pub const DONE_SIZE: u64 = 8 * (3 + LATENCY_BUCKETS as u64);

/// What a connection is for. `Invalid = 0` so that zeroed bytes never pass as a role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Role {
    Invalid = 0,
    /// Control and device state; opened first.
    Main = 1,
    /// Page batches; `channel` is 1..=channels, as announced in the main hello.
    Data = 2,
    /// Postcopy's requested pages, ahead of the data channels' background stream; `channel`
    /// is 0. Only with [`Capabilities::PREEMPT`] granted, and at most one.
    Preempt = 3,
    /// The main connection of a postcopy recovery: names a migration in postcopy-paused on the
    /// destination by its uuid; `channel` is 0. Only with [`Capabilities::RECOVER`] granted.
    Resume = 4,
}

/// Record kinds. `Invalid = 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Invalid = 0,
    /// `count` pages: `count` guest addresses (u64), then `count` × 4096 bytes of data.
    Pages = 1,
    /// `count` runs of zero pages, each `gpa:u64 pages:u64`.
    ZeroRuns = 2,
    /// End of precopy pass `count` (1-based). No payload.
    EndOfPass = 3,
    /// A device-state section: payload = a [`SectionHeader`], then the section's data.
    DeviceState = 4,
    /// Source → destination: everything was sent; load, resume and acknowledge. No payload.
    Complete = 5,
    /// Either direction: the sender gives up; payload = UTF-8 message.
    Error = 6,
    /// Destination → source: the guest runs on the destination. Payload: [`RESUMED_SIZE`]
    /// bytes, the destination's load, resume and CPU times (ns, u64 each).
    Resumed = 7,
    /// Destination → source, only when [`Capabilities::PROGRESS`] was granted: how much the
    /// destination has taken in so far. Payload: a [`Received`] ([`RECEIVED_SIZE`] bytes).
    Received = 8,
    /// Source → destination, main, postcopy only: `count` runs `gpa:u64 pages:u64` of pages
    /// the source will send after the switch; whatever the destination holds for them is stale.
    Discard = 9,
    /// Source → destination, postcopy only. On the main connection, after the device state:
    /// load and resume the guest now, the remaining pages follow. On a data connection, after
    /// its last EndOfPass: the page records that follow are postcopy pages. No payload.
    Postcopy = 10,
    /// Destination → source, main, postcopy only: `count` runs `gpa:u64 pages:u64` of pages a
    /// vCPU waits for.
    PageRequest = 11,
    /// Destination → source, main, postcopy only: every page is in place. Payload: the
    /// destination's request latencies, a [`Latencies`] ([`DONE_SIZE`] bytes).
    Done = 12,
    /// Destination → source, on a recovery's main connection: `count` runs `gpa:u64
    /// pages:u64` of listed pages the destination still lacks (it holds every other page).
    Missing = 13,
    /// Destination → source, on a recovery's main connection: the Missing list is complete;
    /// reconnect the data channels and send the missing pages. No payload.
    Resume = 14,
    /// Source → destination, main, right after the hello when [`Capabilities::CONFIG`] is
    /// requested: the VM's configuration as the source VMM describes it (opaque to the engine,
    /// at most [`MAX_CONFIG_BYTES`]). The destination VMM compares it with its own before it
    /// answers the hello, so a VM that cannot take this guest is refused before anything is
    /// sent, let alone the guest paused.
    VmConfig = 15,
}

impl Kind {
    pub fn from_u16(v: u16) -> Kind {
        match v {
            1 => Kind::Pages,
            2 => Kind::ZeroRuns,
            3 => Kind::EndOfPass,
            4 => Kind::DeviceState,
            5 => Kind::Complete,
            6 => Kind::Error,
            7 => Kind::Resumed,
            8 => Kind::Received,
            9 => Kind::Discard,
            10 => Kind::Postcopy,
            11 => Kind::PageRequest,
            12 => Kind::Done,
            13 => Kind::Missing,
            14 => Kind::Resume,
            15 => Kind::VmConfig,
            _ => Kind::Invalid,
        }
    }
}

/// Names a kind of device state. The VMM chooses the numbers and the engine moves them
/// without knowing what they mean; `0` is invalid so that zeroed bytes never name a section.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SectionId(pub u32);

impl std::fmt::Display for SectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "section {}", self.0)
    }
}

/// The first [`SECTION_HEADER_SIZE`] bytes of a DeviceState payload:
/// `id:u32 instance:u32 version:u32 reserved:u32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionHeader {
    pub id: SectionId,
    /// Which one of several sections of the same id (vCPU 3, the second UART); 0 for a single.
    pub instance: u32,
    /// The layout version of the data, which the VMM checks when it loads it.
    pub version: u32,
}

impl SectionHeader {
    pub fn encode(&self) -> [u8; SECTION_HEADER_SIZE] {
        let mut b = [0u8; SECTION_HEADER_SIZE];
        b[0..4].copy_from_slice(&self.id.0.to_le_bytes());
        b[4..8].copy_from_slice(&self.instance.to_le_bytes());
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b
    }

    /// Decodes the header at the start of a DeviceState payload; the rest is the data.
    pub fn decode(payload: &[u8]) -> Result<(SectionHeader, &[u8]), WireError> {
        let Some((b, data)) = payload.split_first_chunk::<SECTION_HEADER_SIZE>() else {
            return Err(WireError::SectionHeader(payload.len()));
        };
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        if word(0) == 0 {
            return Err(WireError::InvalidSection);
        }
        if word(12) != 0 {
            return Err(WireError::Reserved("section header"));
        }
        let h = SectionHeader {
            id: SectionId(word(0)),
            instance: word(4),
            version: word(8),
        };
        Ok((h, data))
    }
}

/// Optional protocol features, agreed in the main hello: the source asks for a set and the
/// destination answers with the subset it grants, so that a newer source can talk to an older
/// destination by asking and reading the answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities(pub u64);

impl Capabilities {
    pub const NONE: Capabilities = Capabilities(0);
    /// Bit 0: the source may switch to postcopy (Discard, Postcopy), and the destination then
    /// requests missing pages (PageRequest) and says when it has them all (Done).
    pub const POSTCOPY: Capabilities = Capabilities(1);
    /// Bit 1, with postcopy: a preempt connection (role 3) carries the pages the destination
    /// asked for, so that they never wait behind the data channels' background stream.
    pub const PREEMPT: Capabilities = Capabilities(1 << 1);
    /// Bit 2: a Pages record's payload checksum covers its page data as well as its addresses
    /// (without it, the addresses only). The sender copies each page before it checksums and
    /// sends it, so a page the guest changes meanwhile is sent as checksummed.
    pub const CHECKSUM_PAGES: Capabilities = Capabilities(1 << 2);
    /// Bit 4: the destination sends [`Kind::Received`] records on the main connection while
    /// pages arrive, and the source reads them as it sends.
    pub const PROGRESS: Capabilities = Capabilities(1 << 4);
    /// Bit 5, with postcopy: a connection that breaks in postcopy pauses the migration on both
    /// sides instead of failing it, and a recovery (role 4) resumes it.
    pub const RECOVER: Capabilities = Capabilities(1 << 5);
    /// A [`Kind::VmConfig`] record follows the source's main hello, and the destination's
    /// VMM checks it before answering (refusing with [`Refusal::Config`] and an Error record
    /// that says what differs).
    pub const CONFIG: Capabilities = Capabilities(1 << 6);
    /// Bit 7, with postcopy on 4 KiB pages: once the destination sent Resumed, the source may
    /// send requested pages as Pages records on the main connection (which carries nothing
    /// else until Complete then), so that without a preempt connection they do not wait
    /// behind the data channels' background stream.
    pub const MAIN_PAGES: Capabilities = Capabilities(1 << 7);
    /// Bit 8: an Error record's count says why it ends the migration: [`ERROR_FAILED`] (0),
    /// or [`ERROR_CANCELLED`] (1, the sayer's operator cancelled it). Without it, every Error
    /// has count 0.
    pub const ERROR_CODES: Capabilities = Capabilities(1 << 8);
    /// What this side implements.
    pub const SUPPORTED: Capabilities = Capabilities(
        Capabilities::POSTCOPY.0
            | Capabilities::PREEMPT.0
            | Capabilities::CHECKSUM_PAGES.0
            | Capabilities::PROGRESS.0
            | Capabilities::RECOVER.0
            | Capabilities::CONFIG.0
            | Capabilities::MAIN_PAGES.0
            | Capabilities::ERROR_CODES.0,
    );

    /// Both sets' bits.
    pub fn with(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    /// Whether every bit of `other` is in `self`.
    pub fn contains(self, other: Capabilities) -> bool {
        other.is_subset(self)
    }

    /// What a destination grants for a request: the bits it also supports.
    pub fn grant(self, supported: Capabilities) -> Capabilities {
        Capabilities(self.0 & supported.0)
    }

    /// Whether every bit of `self` is in `of`.
    pub fn is_subset(self, of: Capabilities) -> bool {
        self.0 & !of.0 == 0
    }
}

/// The payload of a [`Kind::Received`] record: what the destination has taken in from every
/// connection of the migration, counted from the end of the hellos.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Received {
    /// Record bytes (headers and payloads) the destination has read and validated, on the
    /// main and every data connection; hellos are not counted.
    pub bytes: u64,
    /// Pages (with data, or zero) the destination has written into guest memory.
    pub pages: u64,
}

impl Received {
    pub fn encode(&self) -> [u8; RECEIVED_SIZE as usize] {
        let mut b = [0u8; RECEIVED_SIZE as usize];
        b[0..8].copy_from_slice(&self.bytes.to_le_bytes());
        b[8..16].copy_from_slice(&self.pages.to_le_bytes());
        b
    }

    /// Decodes a payload; its length must be [`RECEIVED_SIZE`] (the header's validation
    /// guarantees it for a record read from a connection).
    pub fn decode(payload: &[u8]) -> Result<Received, WireError> {
        let Ok(b) = <&[u8; RECEIVED_SIZE as usize]>::try_from(payload) else {
            return Err(WireError::Length {
                kind: Kind::Received,
                count: 0,
                len: payload.len() as u64,
                expected: RECEIVED_SIZE,
            });
        };
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Ok(Received {
            bytes: word(0),
            pages: word(8),
        })
    }
}

/// Postcopy page requests as the destination measured them, from the fault that needed a page
/// to the page being in place: a histogram in powers of two of microseconds (bucket k counts
/// [2^k, 2^(k+1)) µs; bucket 0 also counts under 1 µs), with the count, sum and maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latencies {
    pub requests: u64,
    pub sum_us: u64,
    pub max_us: u64,
    pub buckets: [u64; LATENCY_BUCKETS],
}

impl Latencies {
    /// Counts one latency.
    pub fn add(&mut self, us: u64) {
        self.requests += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        self.max_us = self.max_us.max(us);
        let k = (u64::BITS - us.max(1).leading_zeros() - 1) as usize;
        self.buckets[k.min(LATENCY_BUCKETS - 1)] += 1;
    }

    pub fn mean_us(&self) -> f64 {
        self.sum_us as f64 / self.requests.max(1) as f64
    }

    /// The upper bound of the bucket that holds quantile `q` (0..=1), in µs: an estimate within
    /// a factor of two, as a power-of-two histogram gives it (the maximum caps it).
    pub fn quantile_us(&self, q: f64) -> u64 {
        let want = (q * self.requests as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (k, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return (1u64 << (k + 1)).min(self.max_us.max(1));
            }
        }
        self.max_us
    }

    pub fn encode(&self) -> Vec<u8> {
        [self.requests, self.sum_us, self.max_us]
            .iter()
            .chain(self.buckets.iter())
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    /// Decodes a Done payload; its length must be [`DONE_SIZE`].
    pub fn decode(payload: &[u8]) -> Result<Latencies, WireError> {
        if payload.len() as u64 != DONE_SIZE {
            return Err(WireError::Length {
                kind: Kind::Done,
                count: 0,
                len: payload.len() as u64,
                expected: DONE_SIZE,
            });
        }
        let words: Vec<u64> = decode_addresses(payload).collect();
        let mut buckets = [0; LATENCY_BUCKETS];
        buckets.copy_from_slice(&words[3..]);
        Ok(Latencies {
            requests: words[0],
            sum_us: words[1],
            max_us: words[2],
            buckets,
        })
    }
}

/// Why bytes do not form a valid hello or header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}: the peer is not a ferry migration endpoint")]
    BadMagic([u8; 8]),
    #[error(
        "protocol version {0} is not supported (this side speaks version {VERSION}); use matching ferry versions"
    )]
    Version(u32),
    #[error("unknown channel role {0}")]
    Role(u16),
    #[error("page size {0} is not the 4096 this side uses")]
    PageSize(u32),
    #[error("reserved bytes are not zero in the {0}")]
    Reserved(&'static str),
    #[error("unknown record kind {0}")]
    UnknownKind(u16),
    #[error("{kind:?} record of {count} items exceeds the limit of {max}")]
    TooMany { kind: Kind, count: u32, max: u32 },
    #[error("{kind:?} record length {len} does not match {expected} for {count} items")]
    Length {
        kind: Kind,
        count: u32,
        len: u64,
        expected: u64,
    },
    #[error("{kind:?} record length {len} exceeds the limit of {max}")]
    TooLong { kind: Kind, len: u64, max: u64 },
    #[error("{kind:?} record must be empty but carries {len} bytes")]
    NotEmpty { kind: Kind, len: u64 },
    #[error("{kind:?} record has an empty batch")]
    Empty { kind: Kind },
    #[error("DeviceState payload of {0} bytes is shorter than its 16-byte section header")]
    SectionHeader(usize),
    #[error("device-state section id 0 is invalid")]
    InvalidSection,
    #[error(
        "capabilities {0:#x} on a data connection: only the main and recovery hellos carry capabilities"
    )]
    DataCapabilities(u64),
    #[error(
        "postcopy page shift {0} in a hello: only a main reply names one, 12 (4 KiB) or 21 (2 MiB)"
    )]
    PostcopyPage(u8),
    #[error("Resumed record: state part {index} is malformed ({why})")]
    StatePart { index: u32, why: &'static str },
    #[error(
        "the {0}'s checksum does not match its bytes: they were changed on the way (a faulty network, NIC or middlebox); nothing of it was used"
    )]
    HelloChecksum(&'static str),
    #[error(
        "a record header's checksum does not match its bytes: they were changed on the way (a faulty network, NIC or middlebox); nothing of the record was used"
    )]
    HeaderChecksum,
    #[error(
        "the {kind:?} record's payload checksum does not match ({what}: sent {sent:#010x}, received {got:#010x}): the bytes were changed on the way (a faulty network, NIC or middlebox); the record was not used"
    )]
    PayloadChecksum {
        kind: Kind,
        what: &'static str,
        sent: u32,
        got: u32,
    },
}

/// CRC32C (Castagnoli) of `bytes`, with the CPU's instruction where it has one.
pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// CRC32C of `crc`'s bytes followed by `bytes`.
pub fn crc_append(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}

/// The Resumed record: the destination's load, resume and CPU times, and where its state load
/// went part by part (the header's count says how many parts; each is `ns:u64 bytes:u64
/// name_len:u16` and the name in UTF-8, at most [`MAX_PART_NAME`] bytes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResumedRecord {
    pub load_ns: u64,
    pub resume_ns: u64,
    pub cpu_ns: u64,
    pub parts: Vec<crate::state_part::StatePart>,
}

impl ResumedRecord {
    /// The header and payload; parts past [`MAX_STATE_PARTS`] are left out and names cut to
    /// [`MAX_PART_NAME`] bytes (at a character boundary).
    pub fn encode(&self) -> (Header, Vec<u8>) {
        let parts = &self.parts[..self.parts.len().min(MAX_STATE_PARTS as usize)];
        let mut b = Vec::with_capacity(RESUMED_SIZE as usize + parts.len() * 40);
        for w in [self.load_ns, self.resume_ns, self.cpu_ns] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        for p in parts {
            let mut end = p.name.len().min(MAX_PART_NAME);
            while !p.name.is_char_boundary(end) {
                end -= 1;
            }
            b.extend_from_slice(&((p.ms * 1e6) as u64).to_le_bytes());
            b.extend_from_slice(&p.bytes.to_le_bytes());
            b.extend_from_slice(&(end as u16).to_le_bytes());
            b.extend_from_slice(&p.name.as_bytes()[..end]);
        }
        let header = Header::new(Kind::Resumed, parts.len() as u32, b.len() as u64);
        (header, b)
    }

    /// Decodes a payload whose header passed [`Header::decode`] (its count is the number of
    /// parts and its length within their bounds); every part must be whole, with a UTF-8
    /// name, and nothing may follow the last.
    pub fn decode(count: u32, payload: &[u8]) -> Result<ResumedRecord, WireError> {
        if payload.len() < RESUMED_SIZE as usize {
            return Err(WireError::Length {
                kind: Kind::Resumed,
                count,
                len: payload.len() as u64,
                expected: RESUMED_SIZE,
            });
        }
        let word = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let mut r = ResumedRecord {
            load_ns: word(payload, 0),
            resume_ns: word(payload, 8),
            cpu_ns: word(payload, 16),
            parts: Vec::with_capacity(count as usize),
        };
        let mut rest = &payload[RESUMED_SIZE as usize..];
        for index in 0..count {
            let bad = |why| WireError::StatePart { index, why };
            if rest.len() < PART_HEAD {
                return Err(bad("cut short"));
            }
            let name_len = usize::from(u16::from_le_bytes([rest[16], rest[17]]));
            if name_len > MAX_PART_NAME {
                return Err(bad("name longer than 64 bytes"));
            }
            let name = rest
                .get(PART_HEAD..PART_HEAD + name_len)
                .ok_or(bad("name cut short"))?;
            let name = std::str::from_utf8(name).map_err(|_| bad("name not UTF-8"))?;
            r.parts.push(crate::state_part::StatePart {
                name: name.to_string(),
                ms: word(rest, 0) as f64 / 1e6,
                bytes: word(rest, 8),
            });
            rest = &rest[PART_HEAD + name_len..];
        }
        if !rest.is_empty() {
            return Err(WireError::StatePart {
                index: count,
                why: "bytes after the last part",
            });
        }
        Ok(r)
    }
}

/// The first 64 bytes on a connection, in both directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub channel: u16,
    pub uuid: [u8; 16],
    /// Guest RAM bytes; the destination refuses a size different from its own.
    pub memory_size: u64,
    /// In the destination's reply: 0 = accepted, else a [`Refusal`].
    pub status: u32,
    /// In the main hello: how many data channels follow (1..=[`MAX_CHANNELS`]).
    pub channels: u16,
    /// In the main hello: the features the source asks for; in its reply, those granted.
    /// Zero on data connections.
    pub capabilities: Capabilities,
    /// In the destination's main reply when it grants postcopy: log2 of the host page in which
    /// it places postcopy pages ([`SMALL_PAGE_SHIFT`] or [`HUGE_PAGE_SHIFT`]), so that the
    /// source discards, sends and serves whole host pages. Zero everywhere else, and in a
    /// reply without postcopy.
    pub postcopy_page_shift: u8,
}

/// The hello's CRC32C of bytes 0..60 sits in its last four bytes.
const HELLO_CRC_AT: usize = HELLO_SIZE - 4;

/// Rewrites a hello's checksum after its bytes were changed on purpose (tests, fuzzing).
pub fn reseal_hello(b: &mut [u8; HELLO_SIZE]) {
    let crc = crc(&b[..HELLO_CRC_AT]);
    b[HELLO_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// Rewrites a header's own checksum after its bytes were changed on purpose (tests, fuzzing).
pub fn reseal_header(b: &mut [u8; HEADER_SIZE]) {
    let crc = crc(&b[..20]);
    b[20..24].copy_from_slice(&crc.to_le_bytes());
}

/// `postcopy_page_shift` for 4 KiB host pages (shmem, anonymous memory).
pub const SMALL_PAGE_SHIFT: u8 = 12;
/// `postcopy_page_shift` for 2 MiB host pages (hugetlbfs): userfaultfd places a huge page
/// whole, so postcopy moves guest memory in units of 512 wire pages.
pub const HUGE_PAGE_SHIFT: u8 = 21;

/// Why a destination refused a connection (the reply hello's `status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Refusal {
    Accepted = 0,
    MemorySize = 1,
    Role = 2,
    /// A data channel named a migration uuid the destination is not receiving.
    UnknownMigration = 3,
    /// A data channel's id is out of range or already connected.
    ChannelId = 4,
    /// Another migration is under way on this destination (or has ended there).
    Busy = 5,
    /// A recovery for a migration that is not paused in postcopy here.
    NotPaused = 6,
    /// The destination VM cannot take the source's (its [`Kind::VmConfig`] differs: vCPUs,
    /// devices, CPU); an Error record after the hello says what and how to fix it.
    Config = 7,
}

impl Hello {
    /// `magic[8] version:u32 role:u16 channel:u16 uuid[16] memory_size:u64 page_size:u32
    /// status:u32 channels:u16 capabilities:u64 postcopy_page_shift:u8 reserved[1] crc:u32`.
    pub fn encode(&self) -> [u8; HELLO_SIZE] {
        let mut b = [0u8; HELLO_SIZE];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..14].copy_from_slice(&(self.role as u16).to_le_bytes());
        b[14..16].copy_from_slice(&self.channel.to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        b[32..40].copy_from_slice(&self.memory_size.to_le_bytes());
        b[40..44].copy_from_slice(&(PAGE_SIZE as u32).to_le_bytes());
        b[44..48].copy_from_slice(&self.status.to_le_bytes());
        b[48..50].copy_from_slice(&self.channels.to_le_bytes());
        b[50..58].copy_from_slice(&self.capabilities.0.to_le_bytes());
        b[58] = self.postcopy_page_shift;
        reseal_hello(&mut b);
        b
    }

    pub fn decode(b: &[u8; HELLO_SIZE]) -> Result<Hello, WireError> {
        let magic: [u8; 8] = b[0..8].try_into().unwrap();
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        if crc(&b[..HELLO_CRC_AT]).to_le_bytes() != b[HELLO_CRC_AT..] {
            return Err(WireError::HelloChecksum("hello"));
        }
        let role = match u16::from_le_bytes([b[12], b[13]]) {
            1 => Role::Main,
            2 => Role::Data,
            3 => Role::Preempt,
            4 => Role::Resume,
            r => return Err(WireError::Role(r)),
        };
        let page_size = u32::from_le_bytes(b[40..44].try_into().unwrap());
        if u64::from(page_size) != PAGE_SIZE {
            return Err(WireError::PageSize(page_size));
        }
        if b[59..HELLO_CRC_AT].iter().any(|&x| x != 0) {
            return Err(WireError::Reserved("hello"));
        }
        let postcopy_page_shift = b[58];
        if ![0, SMALL_PAGE_SHIFT, HUGE_PAGE_SHIFT].contains(&postcopy_page_shift)
            || (role != Role::Main && postcopy_page_shift != 0)
        {
            return Err(WireError::PostcopyPage(postcopy_page_shift));
        }
        let capabilities = Capabilities(u64::from_le_bytes(b[50..58].try_into().unwrap()));
        if !matches!(role, Role::Main | Role::Resume) && capabilities != Capabilities::NONE {
            return Err(WireError::DataCapabilities(capabilities.0));
        }
        Ok(Hello {
            role,
            channel: u16::from_le_bytes([b[14], b[15]]),
            uuid: b[16..32].try_into().unwrap(),
            memory_size: u64::from_le_bytes(b[32..40].try_into().unwrap()),
            status: u32::from_le_bytes(b[44..48].try_into().unwrap()),
            channels: u16::from_le_bytes([b[48], b[49]]),
            capabilities,
            postcopy_page_shift,
        })
    }

    /// Wire pages per host page of postcopy, from the destination's main reply (a reply
    /// without a shift means 4 KiB pages).
    pub fn postcopy_unit_pages(&self) -> u64 {
        match self.postcopy_page_shift {
            0 => 1,
            s => 1 << (s - SMALL_PAGE_SHIFT),
        }
    }
}

/// A record header: `kind:u16 reserved:u16 count:u32 len:u64 payload_crc:u32
/// header_crc:u32`, the last a CRC32C of the 20 bytes before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    /// Pages, runs or the pass number, by kind; 0 for the others.
    pub count: u32,
    /// Payload bytes that follow.
    pub len: u64,
    /// CRC32C of the payload ([`Header::covered`] bytes of it): 0 for an empty one, which
    /// [`Header::new`] gives; [`Header::seal`] sets it.
    pub crc: u32,
}

impl Header {
    pub fn new(kind: Kind, count: u32, len: u64) -> Header {
        Header {
            kind,
            count,
            len,
            crc: 0,
        }
    }

    /// This header with `crc` as its payload checksum.
    pub fn with_crc(self, crc: u32) -> Header {
        Header { crc, ..self }
    }

    /// This header with the checksum of `payload` (all of the payload).
    pub fn seal(self, payload: &[u8]) -> Header {
        debug_assert_eq!(self.len, payload.len() as u64);
        self.with_crc(crc(payload))
    }

    /// How many leading payload bytes the payload checksum covers: all of them, except in a
    /// Pages record without page checksums, where only the addresses are covered.
    pub fn covered(&self, checksum_pages: bool) -> u64 {
        match self.kind {
            Kind::Pages if !checksum_pages => u64::from(self.count) * 8,
            _ => self.len,
        }
    }

    /// Compares the payload checksum with what the receiver computed over the covered bytes.
    pub fn check(&self, got: u32, what: &'static str) -> Result<(), WireError> {
        if got == self.crc {
            Ok(())
        } else {
            Err(WireError::PayloadChecksum {
                kind: self.kind,
                what,
                sent: self.crc,
                got,
            })
        }
    }

    pub fn pages(count: u32) -> Header {
        Header::new(Kind::Pages, count, u64::from(count) * (8 + PAGE_SIZE))
    }

    pub fn zero_runs(count: u32) -> Header {
        Header::runs(Kind::ZeroRuns, count)
    }

    /// A record of `count` runs `gpa:u64 pages:u64`: ZeroRuns, Discard or PageRequest.
    pub fn runs(kind: Kind, count: u32) -> Header {
        Header::new(kind, count, u64::from(count) * 16)
    }

    /// A DeviceState record whose section carries `data_len` bytes after its header.
    pub fn device_state(data_len: u64) -> Header {
        Header::new(Kind::DeviceState, 0, SECTION_HEADER_SIZE as u64 + data_len)
    }

    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..2].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[4..8].copy_from_slice(&self.count.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.crc.to_le_bytes());
        reseal_header(&mut b);
        b
    }

    /// Decodes and checks a header: its own checksum, known kind, counts and lengths within the
    /// limits and consistent with each other. What follows the header is then safe to read.
    pub fn decode(b: &[u8; HEADER_SIZE]) -> Result<Header, WireError> {
        if crc(&b[..20]).to_le_bytes() != b[20..24] {
            return Err(WireError::HeaderChecksum);
        }
        let raw_kind = u16::from_le_bytes([b[0], b[1]]);
        if b[2..4] != [0, 0] {
            return Err(WireError::Reserved("record header"));
        }
        let h = Header {
            kind: Kind::from_u16(raw_kind),
            count: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            len: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            crc: u32::from_le_bytes(b[16..20].try_into().unwrap()),
        };
        if h.kind == Kind::Invalid {
            return Err(WireError::UnknownKind(raw_kind));
        }
        h.validate()?;
        Ok(h)
    }

    fn validate(&self) -> Result<(), WireError> {
        let (kind, count, len) = (self.kind, self.count, self.len);
        let batch = |max: u32, per: u64| {
            if count == 0 {
                return Err(WireError::Empty { kind });
            }
            if count > max {
                return Err(WireError::TooMany { kind, count, max });
            }
            let expected = u64::from(count) * per;
            if len != expected {
                return Err(WireError::Length {
                    kind,
                    count,
                    len,
                    expected,
                });
            }
            Ok(())
        };
        let bounded = |max: u64| {
            if len > max {
                Err(WireError::TooLong { kind, len, max })
            } else {
                Ok(())
            }
        };
        let countless = matches!(
            kind,
            Kind::DeviceState
                | Kind::Complete
                | Kind::Received
                | Kind::Postcopy
                | Kind::Done
                | Kind::Resume
                | Kind::VmConfig
        );
        if (countless && count != 0) || (kind == Kind::Error && count > ERROR_CANCELLED) {
            return Err(WireError::Reserved("record count"));
        }
        match kind {
            Kind::Pages => batch(MAX_PAGES_PER_RECORD, 8 + PAGE_SIZE),
            Kind::ZeroRuns | Kind::Discard | Kind::PageRequest | Kind::Missing => {
                batch(MAX_ZERO_RUNS_PER_RECORD, 16)
            }
            Kind::DeviceState if len < SECTION_HEADER_SIZE as u64 => {
                Err(WireError::SectionHeader(len as usize))
            }
            Kind::DeviceState => bounded(SECTION_HEADER_SIZE as u64 + MAX_SECTION_BYTES),
            Kind::Error => bounded(MAX_ERROR_BYTES),
            Kind::VmConfig => bounded(MAX_CONFIG_BYTES),
            Kind::Resumed if count > MAX_STATE_PARTS => Err(WireError::TooMany {
                kind,
                count,
                max: MAX_STATE_PARTS,
            }),
            Kind::Resumed if len < RESUMED_SIZE => Err(WireError::Length {
                kind,
                count,
                len,
                expected: RESUMED_SIZE,
            }),
            Kind::Resumed => {
                bounded(RESUMED_SIZE + u64::from(count) * (PART_HEAD + MAX_PART_NAME) as u64)
            }
            Kind::Received if len != RECEIVED_SIZE => Err(WireError::Length {
                kind,
                count,
                len,
                expected: RECEIVED_SIZE,
            }),
            Kind::Received => Ok(()),
            Kind::Done if len != DONE_SIZE => Err(WireError::Length {
                kind,
                count,
                len,
                expected: DONE_SIZE,
            }),
            Kind::Done => Ok(()),
            Kind::EndOfPass | Kind::Complete | Kind::Postcopy | Kind::Resume => match len {
                0 => Ok(()),
                _ => Err(WireError::NotEmpty { kind, len }),
            },
            Kind::Invalid => Err(WireError::UnknownKind(0)),
        }
    }
}

/// Encodes runs `(gpa, pages)` as the payload of a ZeroRuns, Discard or PageRequest record.
pub fn encode_runs(runs: &[(u64, u64)]) -> Vec<u8> {
    runs.iter()
        .flat_map(|&(gpa, pages)| [gpa.to_le_bytes(), pages.to_le_bytes()])
        .flatten()
        .collect()
}

/// Decodes the little-endian u64 words of a Pages address list or a ZeroRuns payload.
pub fn decode_addresses(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
}

#[cfg(test)]
mod tests;
