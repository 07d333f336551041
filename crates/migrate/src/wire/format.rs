//! The format's fixed numbers: the magic, the version, the sizes of hellos, headers and fixed
//! payloads, every cap on a count or length, and the CRC32C every hello, header and payload
//! carries. The floor of `wire`: every other part stands on it.

#![forbid(unsafe_code)]

/// "FERRYMIG".
pub const MAGIC: [u8; 8] = *b"FERRYMIG";
/// Version 2 added opaque device-state sections (VMM-chosen id, instance, version) and
/// capability bits in the hello; version 3, the state parts in the Resumed record; version 4,
/// checksums on hellos, headers and payloads; version 5, the local handover (the LOCAL
/// capability and its four records), which a peer uses only when both granted it.
pub const VERSION: u32 = 5;
/// The oldest version this side still speaks: version 5 only adds what a capability gates, so
/// a version 4 peer, which never asks for it, meets the version 4 protocol here. A hello in
/// `OLDEST_VERSION..=VERSION` is read; any other is refused with the range. A hello carries
/// the version of what it asks for or grants (`Capabilities::version`), so a version 4 peer
/// reads this side's hellos too.
pub const OLDEST_VERSION: u32 = 4;
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
/// The channel id of the main connection's hello. Data channels are 1..=[`MAX_CHANNELS`], so
/// that a channel id names one connection of a migration whatever its role.
pub const MAIN_CHANNEL: u16 = 0;
/// The channel id of postcopy's preempt connection (role `Preempt`): not a data channel, so
/// outside their 1..=[`MAX_CHANNELS`], and never seen beside the main connection's, whose role
/// differs.
pub const PREEMPT_CHANNEL: u16 = 0;
/// A device-state section's data: a vCPU's state is a few KiB (XSAVE is the bulk); 1 MiB bounds
/// what a hostile source can make the destination buffer for one section, as Firecracker caps
/// snapshot state.
pub const MAX_SECTION_BYTES: u64 = 1 << 20;
/// The [`SectionHeader`](super::SectionHeader) that starts a DeviceState payload.
pub const SECTION_HEADER_SIZE: usize = 16;
/// Sections in one migration: 64 vCPUs × (vCPU + local APIC) is 128, the interrupt controller
/// and devices a few dozen more; 1024 leaves room for many virtio devices.
pub const MAX_SECTIONS: usize = 1024;
/// All device state of one migration: 64 vCPUs × ~16 KiB is 1 MiB; 64 MiB bounds what the
/// destination buffers before it loads (it holds every section until Complete).
pub const MAX_STATE_BYTES: u64 = 64 << 20;
/// An error message.
pub const MAX_ERROR_BYTES: u64 = 4096;
/// An Error record's count: the sayer failed (and always without
/// [`Capabilities::ERROR_CODES`](super::Capabilities::ERROR_CODES)).
pub const ERROR_FAILED: u32 = 0;
/// An Error record's count: the sayer's operator cancelled the migration.
pub const ERROR_CANCELLED: u32 = 1;
/// Cap on a VmConfig record: a VMM's description of its VM (vCPUs, devices, a CPUID digest)
/// is a few hundred bytes; 64 KiB leaves room for a CPUID table in full.
pub const MAX_CONFIG_BYTES: u64 = 64 << 10;
/// The Resumed payload's fixed part: `load_ns:u64 resume_ns:u64 cpu_ns:u64`; the header's
/// count of state parts follows (see [`ResumedRecord`](super::ResumedRecord)).
pub const RESUMED_SIZE: u64 = 24;
/// Most state parts a Resumed record lists: ferry's VMM names two per vCPU (64 at most), its
/// devices and its own steps; the rest is room.
pub const MAX_STATE_PARTS: u32 = 1024;
/// Longest name of a state part, in bytes of UTF-8.
pub const MAX_PART_NAME: usize = 64;
/// A state part in a Resumed record before its name: `ns:u64 bytes:u64 name_len:u16`.
pub(super) const PART_HEAD: usize = 18;
/// The Received payload: `bytes:u64 pages:u64`.
pub const RECEIVED_SIZE: u64 = 16;
/// Buckets of a [`Latencies`](super::Latencies) histogram: bucket k counts latencies in [2^k,
/// 2^(k+1)) µs.
pub const LATENCY_BUCKETS: usize = 32;
/// The Done payload: a [`Latencies`](super::Latencies), `requests:u64 sum_us:u64 max_us:u64` and
/// the buckets.
pub const DONE_SIZE: u64 = 8 * (3 + LATENCY_BUCKETS as u64);

/// A LocalRam record's region: `gpa:u64 size:u64 file_offset:u64 fd:u32 reserved:u32`.
pub const LOCAL_REGION_SIZE: u64 = 32;
/// Regions in a LocalRam record: ferry's VMM has two (below and above the 32-bit MMIO hole);
/// 64 leaves room for a VMM with memory hotplug slots, and bounds what a peer makes this side map.
pub const MAX_LOCAL_REGIONS: u32 = 64;
/// File descriptors a LocalRam record carries: one memfd per RAM backend (ferry's VMM has
/// one); 16 is far below the kernel's 253 per message.
pub const MAX_LOCAL_FDS: usize = 16;
/// A LocalDevices record's entry: `id:u32 instance:u32 fd:u32 reserved:u32`.
pub const LOCAL_DEVICE_SIZE: u64 = 16;
/// Device descriptors in a LocalDevices record: ferry's VMM passes one (its disk's image);
/// a VMM with a tap, a second disk or a vhost backend needs a few. All ride on one message,
/// so the bound is [`MAX_LOCAL_FDS`].
pub const MAX_LOCAL_DEVICES: u32 = MAX_LOCAL_FDS as u32;

/// CRC32C (Castagnoli) of `bytes`, with the CPU's instruction where it has one.
pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// CRC32C of `crc`'s bytes followed by `bytes`.
pub fn crc_append(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}
