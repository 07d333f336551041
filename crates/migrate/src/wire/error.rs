//! Why bytes do not form a valid hello, header or payload.

#![forbid(unsafe_code)]

use super::format::{OLDEST_VERSION, VERSION};
use super::kind::Kind;

/// Why bytes do not form a valid hello or header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}: the peer is not a ferry migration endpoint")]
    BadMagic([u8; 8]),
    #[error(
        "protocol version {0} is not supported (this side speaks versions {OLDEST_VERSION} to {VERSION}); use ferry releases whose versions overlap"
    )]
    Version(u32),
    #[error("local region {index} is invalid: {why}")]
    LocalRegion { index: usize, why: &'static str },
    #[error("local device descriptor {index} is invalid: {why}")]
    LocalDevice { index: usize, why: &'static str },
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
    #[error(
        "CompressedPages record of {count} pages is {len} bytes: no room for a frame after its addresses"
    )]
    NoFrame { count: u32, len: u64 },
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
