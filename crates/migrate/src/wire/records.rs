//! The fixed and bounded payloads the engine reads and writes whole: a device-state section's
//! header, Received, the postcopy latencies (Done), and Resumed (a local handover's
//! payloads are in `local.rs`).

#![forbid(unsafe_code)]

use super::error::WireError;
use super::format::{
    DONE_SIZE, LATENCY_BUCKETS, MAX_PART_NAME, MAX_STATE_PARTS, PART_HEAD, RECEIVED_SIZE,
    RESUMED_SIZE, SECTION_HEADER_SIZE,
};
use super::header::{Header, decode_addresses};
use super::kind::Kind;
use crate::state_part::StatePart;

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

/// The Resumed record: the destination's load, resume and CPU times, and where its state load
/// went part by part (the header's count says how many parts; each is `ns:u64 bytes:u64
/// name_len:u16` and the name in UTF-8, at most [`MAX_PART_NAME`] bytes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResumedRecord {
    pub load_ns: u64,
    pub resume_ns: u64,
    pub cpu_ns: u64,
    pub parts: Vec<StatePart>,
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
            r.parts.push(StatePart {
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
