//! What the guest learned at boot and hands to the workload.

/// RAM ranges kept from the PVH memory map (a PC map has two or three).
pub const MAX_RAM_RANGES: usize = 16;

/// What `boot::start` read from the PVH start_info and how it mapped RAM.
#[derive(Clone, Copy, Debug)]
pub struct BootInfo {
    pub start_info: u64,
    /// Guest-physical address of the NUL-terminated command line, 0 if none.
    pub cmdline: u64,
    /// Usable RAM as half-open (start, end) ranges, in map order.
    pub ram: [(u64, u64); MAX_RAM_RANGES],
    pub ram_count: usize,
    pub ram_bytes: u64,
    pub ram_top: u64,
    /// First byte after the loaded image.
    pub image_end: u64,
    /// First byte free for the workload (after the image and the high page directories).
    pub floor: u64,
}

impl BootInfo {
    pub const EMPTY: BootInfo = BootInfo {
        start_info: 0,
        cmdline: 0,
        ram: [(0, 0); MAX_RAM_RANGES],
        ram_count: 0,
        ram_bytes: 0,
        ram_top: 0,
        image_end: 0,
        floor: 0,
    };

    pub fn ram(&self) -> &[(u64, u64)] {
        &self.ram[..self.ram_count]
    }
}
