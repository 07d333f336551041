//! Guest RAM as the engine's regions: the mappings, and the memfd they are made from, which
//! both halves of a migration hand the engine.

use std::os::fd::AsRawFd;

use ferry_migrate::ram::RamRegion;

use crate::memory::GuestRam;

/// `ram`'s regions for the engine: each mapping with its guest address and its place in the
/// memfd.
pub(super) fn ram_regions(ram: &GuestRam) -> Vec<RamRegion> {
    ram.regions()
        .iter()
        .map(|r| RamRegion {
            gpa: r.gpa,
            size: r.size,
            host_addr: r.host_addr as usize,
            fd: ram.memfd().as_raw_fd(),
            file_offset: r.file_offset,
        })
        .collect()
}
