//! PVH boot: load the guest ELF, write the command line, the memory map and `hvm_start_info`,
//! and say where the vCPU starts. For the built-in guest, also check before boot that its
//! command line parses and its working set fits, so a mistake is an error, not a halted guest.

use std::io::Cursor;

use ferry_guest_abi::layout::{Footprint, LOW_RAM_END, default_working_set, required_bytes};
use ferry_guest_abi::{CMDLINE_MAX, PAGE_SIZE, params};
use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{KernelLoader, load_cmdline};
use vm_memory::GuestAddress;

use crate::memory::GuestRam;

/// Where the boot data goes, all in the first MiB that the guest leaves alone
/// ([`LOW_RAM_END`]): start_info, then the memory map after it, then the command line.
pub const START_INFO_ADDR: u64 = 0x6000;
pub const MEMMAP_ADDR: u64 = 0x7000;
pub const CMDLINE_ADDR: u64 = 0x20000;
/// End of conventional low RAM; the rest of the first MiB is legacy ROM/VGA space.
const LOW_RAM_TOP: u64 = 0x9fc00;
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const E820_RAM: u32 = 1;

/// Why the guest could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot load the guest ELF: {0}; give a PVH-capable x86-64 ELF kernel")]
    Load(linux_loader::loader::Error),
    #[error(
        "the guest ELF has no PVH entry point (ELF note type 18, owner \"Xen\"); ferry boots PVH kernels only"
    )]
    NotPvh,
    #[error("bad guest command line: {0}")]
    Cmdline(String),
    #[error("bad guest command line: {source} (at most {most} printable ASCII bytes)", most = CMDLINE_MAX)]
    CmdlineText {
        #[source]
        source: linux_loader::cmdline::Error,
    },
    #[error("cannot write the guest command line into guest RAM at {CMDLINE_ADDR:#x}: {source}")]
    CmdlineLoad {
        #[source]
        source: linux_loader::loader::Error,
    },
    #[error("--memory {memory}M is too small for this guest: its working set of {ws}M needs {needed}M of RAM above the guest image (with the generation records of it and of disk=) but only {free}M is free; raise --memory to at least {suggest}M or lower ws=", memory = memory >> 20, ws = ws >> 20, needed = needed.div_ceil(1 << 20), free = free >> 20, suggest = suggest >> 20)]
    MemoryTooSmall {
        memory: u64,
        ws: u64,
        needed: u64,
        free: u64,
        suggest: u64,
    },
    #[error("cannot write PVH boot information: {0}")]
    Configure(linux_loader::configurator::Error),
}

/// Where the boot processor starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BootSetup {
    /// The 32-bit PVH entry point.
    pub entry: u64,
    /// The `hvm_start_info` address, passed in %ebx.
    pub start_info: u64,
    /// First byte after the loaded image.
    pub image_end: u64,
}

/// The PVH memory map for `ram`: low RAM, RAM from 1 MiB to the hole, RAM above 4 GiB.
pub fn memory_map(ram: &GuestRam) -> Vec<(u64, u64)> {
    let mut map = vec![(0, LOW_RAM_TOP)];
    for r in ram.regions() {
        let start = r.gpa.max(LOW_RAM_END);
        if start < r.gpa + r.size {
            map.push((start, r.gpa + r.size));
        }
    }
    map
}

/// Checks that a built-in guest command line parses and its working set fits in `ram` above
/// an image that ends at `image_end`, with its generation records: the working set's and the
/// disk's (`disk=`, a `u32` per 4 KiB block).
pub fn check_workload(cmdline: &str, ram: &GuestRam, image_end: u64) -> Result<(), BootError> {
    let p = params::parse(cmdline).map_err(|e| BootError::Cmdline(e.to_string()))?;
    let map = memory_map(ram);
    let ram_top = map.iter().map(|r| r.1).max().unwrap_or(0);
    let free: u64 = map
        .iter()
        .map(|&(s, e)| {
            let s = s.max(image_end).next_multiple_of(PAGE_SIZE);
            e.saturating_sub(s) / PAGE_SIZE * PAGE_SIZE
        })
        .sum();
    let tables = required_bytes(Footprint::default(), ram_top);
    let ws = p
        .working_set
        .unwrap_or(default_working_set(free.saturating_sub(tables)));
    if !p.shared && ws / PAGE_SIZE < u64::from(p.vcpus) {
        return Err(BootError::Cmdline(format!(
            "ws={}K is {} pages, fewer than the {} vCPUs that each write a share of it; raise ws= or give shared=1",
            ws >> 10,
            ws / PAGE_SIZE,
            p.vcpus
        )));
    }
    let needed = required_bytes(Footprint::of(&p, ws), ram_top);
    if p.free > 0 && needed.saturating_add(p.free) > free {
        return Err(BootError::Cmdline(format!(
            "free={}M is more than this guest has left to free: {}M of RAM above its image, {}M of it for its working set and tables; lower free= or raise --memory to at least {}M",
            p.free >> 20,
            free >> 20,
            needed.div_ceil(1 << 20),
            (ram.size() + (needed + p.free - free)).next_multiple_of(crate::memory::MEMORY_GRANULE)
                >> 20
        )));
    }
    if needed > free {
        let suggest = (ram.size() + needed - free).next_multiple_of(crate::memory::MEMORY_GRANULE);
        return Err(BootError::MemoryTooSmall {
            memory: ram.size(),
            ws,
            needed,
            free,
            suggest,
        });
    }
    Ok(())
}

/// Loads `elf` and writes the PVH boot data with `cmdline`.
pub fn load(ram: &GuestRam, elf: &[u8], cmdline: &str) -> Result<BootSetup, BootError> {
    let loaded = Elf::load(
        ram.memory(),
        None,
        &mut Cursor::new(elf),
        Some(GuestAddress(LOW_RAM_END)),
    )
    .map_err(|e| match e {
        linux_loader::loader::Error::Elf(e) => BootError::Load(linux_loader::loader::Error::Elf(e)),
        other => BootError::Load(other),
    })?;
    let PvhBootCapability::PvhEntryPresent(entry) = loaded.pvh_boot_cap else {
        return Err(BootError::NotPvh);
    };

    let text = |source| BootError::CmdlineText { source };
    let mut line = Cmdline::new(CMDLINE_MAX).map_err(text)?;
    if !cmdline.is_empty() {
        line.insert_str(cmdline).map_err(text)?;
    }
    load_cmdline(ram.memory(), GuestAddress(CMDLINE_ADDR), &line)
        .map_err(|source| BootError::CmdlineLoad { source })?;

    let memmap: Vec<hvm_memmap_table_entry> = memory_map(ram)
        .into_iter()
        .map(|(start, end)| hvm_memmap_table_entry {
            addr: start,
            size: end - start,
            type_: E820_RAM,
            reserved: 0,
        })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(START_INFO_ADDR));
    params.set_sections(&memmap, GuestAddress(MEMMAP_ADDR));
    PvhBootConfigurator::write_bootparams(&params, ram.memory()).map_err(BootError::Configure)?;

    Ok(BootSetup {
        entry: entry.0,
        start_info: START_INFO_ADDR,
        image_end: loaded.kernel_end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_map_skips_legacy_space_and_the_hole() {
        let ram = GuestRam::new(5 << 30).unwrap();
        assert_eq!(
            memory_map(&ram),
            vec![(0, LOW_RAM_TOP), (LOW_RAM_END, 3 << 30), (4 << 30, 6 << 30)]
        );
    }

    #[test]
    fn builtin_guest_loads_with_its_pvh_entry() {
        let ram = GuestRam::new(64 << 20).unwrap();
        let setup = load(&ram, ferry_guest_image::ELF, "ws=8M").unwrap();
        assert!(setup.entry >= LOW_RAM_END && setup.image_end > setup.entry);
        let mut magic = [0u8; 4];
        ram.read(START_INFO_ADDR, &mut magic).unwrap();
        assert_eq!(u32::from_le_bytes(magic), XEN_HVM_START_MAGIC);
        let mut line = [0u8; 5];
        ram.read(CMDLINE_ADDR, &mut line).unwrap();
        assert_eq!(&line, b"ws=8M");
    }

    #[test]
    fn non_pvh_and_garbage_images_are_refused() {
        let ram = GuestRam::new(64 << 20).unwrap();
        let err = load(&ram, b"not an elf at all, just bytes", "").unwrap_err();
        assert!(err.to_string().contains("PVH-capable"), "{err}");
    }

    #[test]
    fn working_set_must_fit() {
        let ram = GuestRam::new(64 << 20).unwrap();
        let err = check_workload("ws=256M", &ram, 2 << 20)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("too small") && err.contains("raise --memory to at least 260M"),
            "{err}"
        );
        check_workload("ws=32M", &ram, 2 << 20).unwrap();
        let err = check_workload("ws=12K vcpus=4", &ram, 2 << 20)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fewer than the 4 vCPUs"), "{err}");
        check_workload("ws=12K vcpus=4 shared=1", &ram, 2 << 20).unwrap();
        check_workload("", &ram, 2 << 20).unwrap();
        let err = check_workload("ws=1G pattern=wild", &ram, 2 << 20)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pattern"), "{err}");
    }

    #[test]
    fn a_disk_record_that_does_not_fit_is_refused_before_boot() {
        let ram = GuestRam::new(64 << 20).unwrap();
        check_workload("ws=32M disk=2G", &ram, 2 << 20).unwrap();
        // 64 GiB of disk is a 64 MiB record: more than the guest has beside its working set.
        let err = check_workload("ws=32M disk=64G", &ram, 2 << 20)
            .unwrap_err()
            .to_string();
        assert!(err.contains("too small") && err.contains("disk="), "{err}");
    }
}
