#![forbid(unsafe_code)]
//! Wire protocol v5 (a v4 peer is read too: `format.rs`'s `OLDEST_VERSION`): pure encoding and
//! validation, no I/O and no `unsafe`. `docs/protocol.md` is the normative text; this module is
//! its implementation and its tests.
//!
//! A connection starts with a 64-byte [`Hello`] from the source and a 64-byte [`Hello`] reply
//! from the destination, then carries records: a 24-byte [`Header`] and a payload whose length
//! the header gives and `Header::validate` bounds. All integers are little-endian.
//!
//! Every hello and header carries a CRC32C of its own bytes, and every header a CRC32C of its
//! record's payload (of a Pages record: its addresses, and its page data too when
//! [`Capabilities::CHECKSUM_PAGES`] was granted), so a byte changed on the way is refused
//! before it is used rather than trusted to TCP's 16-bit checksum.
//!
//! Floors, each standing only on those below: `wire_enum.rs` (how an enum and its decoder are
//! declared), `format.rs` (the numbers and the CRC), `kind.rs` (roles and record kinds),
//! `error.rs`, `capabilities.rs`, `records.rs` (the fixed payloads), `local.rs` (a local
//! handover's), `hello.rs` and `header.rs`. Everything is re-exported here, as `wire::Hello`
//! and so on.

mod capabilities;
mod error;
mod format;
mod header;
mod hello;
mod kind;
mod local;
mod records;
mod wire_enum;

pub use capabilities::Capabilities;
pub use error::WireError;
pub use format::{
    DONE_SIZE, ERROR_CANCELLED, ERROR_FAILED, HEADER_SIZE, HELLO_SIZE, LATENCY_BUCKETS,
    LOCAL_DEVICE_SIZE, LOCAL_REGION_SIZE, MAGIC, MAIN_CHANNEL, MAX_CHANNELS, MAX_CONFIG_BYTES,
    MAX_ERROR_BYTES, MAX_LOCAL_DEVICES, MAX_LOCAL_FDS, MAX_LOCAL_REGIONS, MAX_PAGES_PER_RECORD,
    MAX_PART_NAME, MAX_SECTION_BYTES, MAX_SECTIONS, MAX_STATE_BYTES, MAX_STATE_PARTS,
    MAX_ZERO_RUN_PAGES, MAX_ZERO_RUNS_PER_RECORD, OLDEST_VERSION, PAGE_SIZE, PREEMPT_CHANNEL,
    RECEIVED_SIZE, RESUMED_SIZE, SECTION_HEADER_SIZE, VERSION, crc, crc_append,
};
pub use header::{Header, decode_addresses, encode_runs, reseal_header};
pub use hello::{HUGE_PAGE_SHIFT, Hello, Refusal, SMALL_PAGE_SHIFT, reseal_hello};
pub use kind::{Kind, Role};
pub use local::{LocalDevice, LocalRegion};
pub use records::{Latencies, Received, ResumedRecord, SectionHeader, SectionId};

#[cfg(test)]
mod tests;
