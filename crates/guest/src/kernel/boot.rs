//! The first Rust code, at CPL3: read the PVH start_info and memory map, and map RAM above
//! 4 GiB (the assembly entry mapped the low 4 GiB). Page tables are ordinary memory in this
//! kernel's identity map, so a CPL3 write is enough; entries that go from not-present to
//! present need no TLB flush.

use ferry_guest_abi::CMDLINE_MAX;
use ferry_guest_abi::layout::{LARGE_PAGE, MAX_RAM_TOP};

use super::boot_info::{BootInfo, MAX_RAM_RANGES};

/// PVH's `hvm_start_info.magic`.
const START_INFO_MAGIC: u32 = 0x336e_c578;
/// Memory-map entry type for usable RAM (the E820 convention PVH reuses).
const MEMMAP_RAM: u32 = 1;
/// Page-table entry bits: present | writable | user, and large for 2 MiB directory entries.
const PT_TABLE: u64 = 0x7;
const PT_LARGE: u64 = 0x87;

unsafe extern "C" {
    static mut boot_pdpt: [u64; 512];
    static __image_end: u8;
}

/// Reads start_info and maps all RAM; `Err` says what is wrong with the boot information.
pub fn start(start_info: u64) -> Result<BootInfo, &'static str> {
    let mut boot = BootInfo::EMPTY;
    boot.image_end = &raw const __image_end as u64;
    read_start_info(start_info, &mut boot)?;
    map_high_ram(&mut boot);
    Ok(boot)
}

fn read_start_info(addr: u64, boot: &mut BootInfo) -> Result<(), &'static str> {
    if addr == 0 || addr >= 4 << 30 {
        return Err("no PVH start_info below 4 GiB; boot this guest with a PVH loader");
    }
    // SAFETY: the low 4 GiB are identity mapped; the loader placed start_info there, and the
    // fields read are plain integers (hvm_start_info in the PVH spec).
    let (magic, version, cmdline, memmap, entries) = unsafe {
        let p = addr as *const u8;
        (
            (p as *const u32).read_volatile(),
            (p.add(4) as *const u32).read_volatile(),
            (p.add(24) as *const u64).read_unaligned(),
            (p.add(40) as *const u64).read_unaligned(),
            (p.add(48) as *const u32).read_unaligned(),
        )
    };
    if magic != START_INFO_MAGIC {
        return Err("PVH start_info has a bad magic number");
    }
    if version < 1 || memmap == 0 || entries == 0 {
        return Err("PVH start_info has no memory map (version 1 required)");
    }
    if memmap >= 4 << 30 {
        return Err("PVH memory map lies above 4 GiB");
    }
    boot.start_info = addr;
    boot.cmdline = cmdline;
    for i in 0..entries as usize {
        // SAFETY: entry i of the loader's memory map, below 4 GiB as checked; each entry is
        // {addr: u64, size: u64, type: u32, reserved: u32}.
        let (base, size, kind) = unsafe {
            let e = (memmap as *const u8).add(24 * i);
            (
                (e as *const u64).read_unaligned(),
                (e.add(8) as *const u64).read_unaligned(),
                (e.add(16) as *const u32).read_unaligned(),
            )
        };
        let end = base.saturating_add(size).min(MAX_RAM_TOP);
        if kind == MEMMAP_RAM && base < end && boot.ram_count < MAX_RAM_RANGES {
            boot.ram[boot.ram_count] = (base, end);
            boot.ram_count += 1;
            boot.ram_bytes += end - base;
            boot.ram_top = boot.ram_top.max(end);
        }
    }
    Ok(())
}

/// Identity-maps RAM between 4 GiB and the top of RAM with 2 MiB user pages, taking one page
/// directory per GiB from RAM just above the image. Raises `boot.floor` past them.
fn map_high_ram(boot: &mut BootInfo) {
    boot.floor = boot.image_end;
    let directories = ferry_guest_abi::layout::high_page_directories(boot.ram_top);
    for gib in 0..directories {
        let dir = boot.floor;
        boot.floor += ferry_guest_abi::PAGE_SIZE;
        let base = (4 + gib) << 30;
        for i in 0..512u64 {
            let frame = base + i * LARGE_PAGE;
            let entry = if frame < boot.ram_top {
                frame | PT_LARGE
            } else {
                0
            };
            // SAFETY: `dir` is a page of RAM just above the image (so below 4 GiB and identity
            // mapped) that nothing else uses: the workload's plan starts at `boot.floor`.
            unsafe { (dir as *mut u64).add(i as usize).write_volatile(entry) };
        }
        // SAFETY: boot_pdpt is the live PDPT (mapped user-writable like all memory here);
        // entries 4.. were not present before, so no stale translation can exist.
        unsafe {
            (&raw mut boot_pdpt)
                .cast::<u64>()
                .add(4 + gib as usize)
                .write_volatile(dir | PT_TABLE)
        };
    }
}

/// The command line as text: empty when absent, cut at the first NUL or at `CMDLINE_MAX`.
pub fn command_line(addr: u64) -> &'static str {
    if addr == 0 {
        return "";
    }
    // SAFETY: the loader put a NUL-terminated string there; RAM is identity mapped, and the
    // scan stops at CMDLINE_MAX + 1 bytes so an unterminated string is refused by the parser.
    let bytes = unsafe { core::slice::from_raw_parts(addr as *const u8, CMDLINE_MAX + 1) };
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    core::str::from_utf8(&bytes[..len]).unwrap_or("\u{fffd}=not-utf8")
}
