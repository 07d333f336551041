//! The CMOS bytes a PC guest's firmware or kernel reads at boot besides the clock, filled as
//! QEMU's PC machine fills them for SeaBIOS (the layout IBM's AT BIOS began):
//!
//! | bytes | what |
//! | --- | --- |
//! | 0x14 | equipment: bit 1, a math coprocessor; no floppy, no display adapter named |
//! | 0x15-0x16 | base memory in KiB: 640 |
//! | 0x17-0x18, 0x30-0x31 | memory from 1 MiB up to the 32-bit hole in KiB, at most 65,535 |
//! | 0x34-0x35 | memory from 16 MiB up to the 32-bit hole in 64 KiB units, at most 65,535 |
//! | 0x5b-0x5d | memory above 4 GiB in 64 KiB units (24 bits) |
//! | 0x5f | vCPUs less one |
//!
//! Little-endian, low byte first. Everything else is 0 (no floppy types at 0x10, no disk
//! types at 0x12, shutdown status 0 at 0x0f); the clock's registers are `model`'s.

#![forbid(unsafe_code)]

use super::model::CMOS_BYTES;
use crate::memory::{MMIO_HOLE_END, MMIO_HOLE_START};

const EQUIPMENT: usize = 0x14;
const BASE_KIB: usize = 0x15;
const EXTENDED_KIB: usize = 0x17;
const EXTENDED_KIB_COPY: usize = 0x30;
const ABOVE_16M: usize = 0x34;
const ABOVE_4G: usize = 0x5b;
const VCPUS_LESS_ONE: usize = 0x5f;

/// Equipment byte bit 1: a math coprocessor (every x86-64 vCPU has an FPU).
const FPU: u8 = 1 << 1;
/// The conventional memory below the EBDA and video memory: 640 KiB.
const BASE_MEMORY_KIB: u16 = 640;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const UNIT_64K: u64 = 64 << 10;

/// The boot bytes of a VM with `ram` bytes of RAM (laid out around the 32-bit hole as
/// `memory` lays it) and `vcpus` vCPUs; the clock's registers left 0.
pub fn at_boot(ram: u64, vcpus: u8) -> [u8; CMOS_BYTES] {
    let mut c = [0; CMOS_BYTES];
    let below_4g = ram.min(MMIO_HOLE_START);
    let above_4g = ram - below_4g;
    debug_assert!(above_4g == 0 || MMIO_HOLE_END == 4 << 30);
    let mut put16 = |at: usize, v: u64| {
        let v = v.min(u64::from(u16::MAX)) as u16;
        c[at..at + 2].copy_from_slice(&v.to_le_bytes());
    };
    put16(BASE_KIB, u64::from(BASE_MEMORY_KIB));
    let extended = below_4g.saturating_sub(MIB) / KIB;
    put16(EXTENDED_KIB, extended);
    put16(EXTENDED_KIB_COPY, extended);
    put16(ABOVE_16M, below_4g.saturating_sub(16 * MIB) / UNIT_64K);
    let high = (above_4g / UNIT_64K).min(0xff_ffff) as u32;
    c[ABOVE_4G..ABOVE_4G + 3].copy_from_slice(&high.to_le_bytes()[..3]);
    c[EQUIPMENT] = FPU;
    c[VCPUS_LESS_ONE] = vcpus.saturating_sub(1);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn memory_sizes_land_where_seabios_reads_them() {
        let small = at_boot(64 * MIB, 2);
        assert_eq!(small[0x15..0x17], [0x80, 0x02], "640 KiB");
        let extended = u16::from_le_bytes([small[0x17], small[0x18]]);
        assert_eq!(extended, 63 * 1024, "KiB above 1 MiB");
        assert_eq!(small[0x30..0x32], small[0x17..0x19]);
        assert_eq!(
            u16::from_le_bytes([small[0x34], small[0x35]]),
            48 * 16,
            "64 KiB above 16 MiB"
        );
        assert_eq!(small[0x5b..0x5e], [0, 0, 0]);
        assert_eq!((small[0x14], small[0x5f]), (FPU, 1));

        let large = at_boot(8 * GIB, 1);
        assert_eq!(large[0x17..0x19], [0xff, 0xff], "capped at 65,535 KiB");
        let above_16m = u16::from_le_bytes([large[0x34], large[0x35]]);
        assert_eq!(
            u64::from(above_16m),
            (3 * GIB - 16 * MIB) / UNIT_64K,
            "up to the hole"
        );
        let high = u32::from_le_bytes([large[0x5b], large[0x5c], large[0x5d], 0]);
        assert_eq!(u64::from(high), 5 * GIB / UNIT_64K, "the rest, above 4 GiB");
        assert_eq!(large[0x5f], 0);
    }
}
