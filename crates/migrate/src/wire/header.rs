//! The record header and its validation (each kind's count and length bounded), and the run
//! lists some payloads carry.

#![forbid(unsafe_code)]

use super::error::WireError;
use super::format::{
    DONE_SIZE, ERROR_CANCELLED, HEADER_SIZE, LOCAL_DEVICE_SIZE, LOCAL_REGION_SIZE,
    MAX_CONFIG_BYTES, MAX_ERROR_BYTES, MAX_LOCAL_DEVICES, MAX_LOCAL_REGIONS, MAX_PAGES_PER_RECORD,
    MAX_PART_NAME, MAX_SECTION_BYTES, MAX_STATE_PARTS, MAX_ZERO_RUNS_PER_RECORD, PAGE_SIZE,
    PART_HEAD, RECEIVED_SIZE, RESUMED_SIZE, SECTION_HEADER_SIZE, crc,
};
use super::kind::Kind;

/// Rewrites a header's own checksum after its bytes were changed on purpose (tests, fuzzing).
pub fn reseal_header(b: &mut [u8; HEADER_SIZE]) {
    let crc = crc(&b[..20]);
    b[20..24].copy_from_slice(&crc.to_le_bytes());
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

    pub(super) fn validate(&self) -> Result<(), WireError> {
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
                | Kind::RamAdopted
                | Kind::Loaded
                | Kind::Go
                | Kind::StateChunk
                | Kind::StateReady
                | Kind::DevicesAdopted
        );
        if (countless && count != 0) || (kind == Kind::Error && count > ERROR_CANCELLED) {
            return Err(WireError::Reserved("record count"));
        }
        match kind {
            Kind::Pages => batch(MAX_PAGES_PER_RECORD, 8 + PAGE_SIZE),
            Kind::CompressedPages if count == 0 => Err(WireError::Empty { kind }),
            Kind::CompressedPages if count > MAX_PAGES_PER_RECORD => Err(WireError::TooMany {
                kind,
                count,
                max: MAX_PAGES_PER_RECORD,
            }),
            Kind::CompressedPages if len <= u64::from(count) * 8 => {
                Err(WireError::NoFrame { count, len })
            }
            Kind::CompressedPages => bounded(u64::from(count) * (8 + PAGE_SIZE)),
            Kind::ZeroRuns | Kind::Discard | Kind::PageRequest | Kind::Missing => {
                batch(MAX_ZERO_RUNS_PER_RECORD, 16)
            }
            Kind::DeviceState | Kind::StateChunk if len < SECTION_HEADER_SIZE as u64 => {
                Err(WireError::SectionHeader(len as usize))
            }
            Kind::DeviceState | Kind::StateChunk => {
                bounded(SECTION_HEADER_SIZE as u64 + MAX_SECTION_BYTES)
            }
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
            Kind::LocalRam => batch(MAX_LOCAL_REGIONS, LOCAL_REGION_SIZE),
            Kind::LocalDevices => batch(MAX_LOCAL_DEVICES, LOCAL_DEVICE_SIZE),
            Kind::EndOfPass
            | Kind::Complete
            | Kind::Postcopy
            | Kind::Resume
            | Kind::RamAdopted
            | Kind::Loaded
            | Kind::Go
            | Kind::StateReady
            | Kind::DevicesAdopted => match len {
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
