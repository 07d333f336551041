//! Hand-made protocol bytes for tests that play a hostile or broken source: hellos and records
//! built with the engine's own encoders, so a test states only what it changes.

use ferry_migrate::wire::{
    self, Capabilities, Header, Hello, Kind, Role, SectionHeader, SectionId,
};

const MIB: u64 = 1 << 20;

/// A hello of `role`, `channel`, a uuid of sixteen `uuid` bytes, `memory` bytes of RAM and
/// `channels` data channels.
pub fn hello(role: Role, channel: u16, uuid: u8, memory: u64, channels: u16) -> Vec<u8> {
    Hello {
        role,
        channel,
        uuid: [uuid; 16],
        memory_size: memory,
        status: 0,
        channels,
        capabilities: Capabilities::NONE,
        postcopy_page_shift: 0,
    }
    .encode()
    .to_vec()
}

/// [`main_hello`] asking for `capabilities`.
pub fn main_hello_asking(capabilities: Capabilities) -> Vec<u8> {
    let mut h = Hello::decode(main_hello().as_slice().try_into().unwrap()).unwrap();
    h.capabilities = capabilities;
    h.encode().to_vec()
}

/// A preempt connection's hello for migration `uuid` of [`main_hello`]'s shape.
pub fn preempt_hello(uuid: u8) -> Vec<u8> {
    hello(Role::Preempt, 0, uuid, 8 * MIB, 1)
}

/// A record of runs `(gpa, pages)`: Discard or PageRequest.
pub fn runs(kind: Kind, runs: &[(u64, u64)]) -> Vec<u8> {
    record(
        Header::runs(kind, runs.len() as u32),
        &ferry_migrate::wire::encode_runs(runs),
    )
}

/// The main hello of migration 1 into an 8 MiB guest with one data channel.
pub fn main_hello() -> Vec<u8> {
    hello(Role::Main, 0, 1, 8 * MIB, 1)
}

/// Data channel `channel`'s hello for [`main_hello`]'s migration.
pub fn data_hello(channel: u16) -> Vec<u8> {
    hello(Role::Data, channel, 1, 8 * MIB, 1)
}

/// A record: `h` with the checksum of `payload` (whatever its length), then `payload`.
pub fn record(h: Header, payload: &[u8]) -> Vec<u8> {
    let mut v = h.with_crc(wire::crc(payload)).encode().to_vec();
    v.extend_from_slice(payload);
    v
}

/// A DeviceState record: section `id`, `instance`, version 1, then `data`.
pub fn section(id: u32, instance: u32, data: &[u8]) -> Vec<u8> {
    let h = SectionHeader {
        id: SectionId(id),
        instance,
        version: 1,
    };
    let payload = [h.encode().as_slice(), data].concat();
    record(Header::device_state(data.len() as u64), &payload)
}

/// A Pages record of `gpas`, every byte of data 0xab, its checksum over the addresses only
/// (page checksums not granted).
pub fn pages(gpas: &[u64]) -> Vec<u8> {
    pages_checked(gpas, false)
}

/// A Pages record of `gpas` (data 0xab), its checksum covering the page data too if
/// `checksum_pages` (as [`Capabilities::CHECKSUM_PAGES`] granted demands).
pub fn pages_checked(gpas: &[u64], checksum_pages: bool) -> Vec<u8> {
    let addresses: Vec<u8> = gpas.iter().flat_map(|g| g.to_le_bytes()).collect();
    let data = vec![0xab; gpas.len() * 4096];
    let mut crc = wire::crc(&addresses);
    if checksum_pages {
        crc = wire::crc_append(crc, &data);
    }
    let h = Header::pages(gpas.len() as u32).with_crc(crc);
    cat(&[h.encode().to_vec(), addresses, data])
}

/// A ZeroRuns record of `(gpa, pages)` runs.
pub fn zero_runs(runs: &[(u64, u64)]) -> Vec<u8> {
    record(
        Header::zero_runs(runs.len() as u32),
        &wire::encode_runs(runs),
    )
}

pub fn end(pass: u32) -> Vec<u8> {
    record(Header::new(Kind::EndOfPass, pass, 0), &[])
}

pub fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}
