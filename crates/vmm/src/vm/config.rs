//! What a VM is made of (`VmConfig`) and the guest's command line it builds from it: the
//! user's words, then the VM's own facts. Pure: checked before anything is built.

#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::boot::BootError;
use crate::devices::serial::SerialOutput;
use crate::devices::virtio::blk::DiskOptions;
use crate::devices::virtio::mmio;
use crate::devices::virtio::net::NetOptions;
use crate::memory::{HostPages, MMIO_HOLE_START};

/// What kind of kernel the VM boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestKind {
    /// ferry's test guest (or one that speaks its ABI): the command line is checked with the
    /// guest's own parser and the working set against the RAM before boot.
    FerryGuest,
    /// Any other PVH kernel: its command line is passed through unchecked.
    Foreign,
}

/// Everything needed to boot a VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub memory_bytes: u64,
    pub vcpus: u8,
    pub kernel: Arc<[u8]>,
    pub cmdline: String,
    pub guest: GuestKind,
    pub serial: SerialOutput,
    /// What guest RAM is made of: 4 KiB pages, or 2 MiB huge pages (`--hugepages`).
    pub host_pages: HostPages,
    /// A virtio-balloon on virtio-mmio (announced on the command line): free page hinting
    /// for migrations, inflate/deflate, statistics and free page reporting.
    pub balloon: bool,
    /// A virtio-blk disk on virtio-mmio over a raw image file (`ferry run --disk`), announced
    /// on the command line after the balloon.
    pub disk: Option<DiskOptions>,
    /// A virtio-net NIC on virtio-mmio over a tap (`ferry run --net`), announced on the
    /// command line after the disk.
    pub net: Option<NetOptions>,
    /// Track dirty pages with KVM's dirty ring of this many entries per vCPU instead of the
    /// slots' bitmaps (`ferry run --dirty-ring N`); `None`: the bitmap.
    pub dirty_ring: Option<u32>,
    /// Stands for a newer ferry in the version-range tests: the telemetry port writes its
    /// next section layout and loads today's too (`devices::telemetry_port::Layout::Next`),
    /// so a migration from this VM to an ordinary one is refused before the pause. Off
    /// everywhere else (`ferry run --next-section-layout`, hidden).
    #[doc(hidden)]
    pub next_layout: bool,
}

impl VmConfig {
    /// The guest's command line: the user's, for ferry's guest `vcpus=`, and a
    /// `virtio_mmio.device=` for the balloon and for the disk when the VM has them (later keys
    /// win, so the VM's own facts override the user's; the guest keeps every device key and
    /// tells the devices apart by their ids).
    pub fn full_cmdline(&self) -> String {
        let mut words: Vec<String> = Vec::new();
        if !self.cmdline.is_empty() {
            words.push(self.cmdline.clone());
        }
        if self.guest == GuestKind::FerryGuest {
            words.push(format!("vcpus={}", self.vcpus));
        }
        if self.balloon {
            words.push(mmio::cmdline_fragment(BALLOON_MMIO, BALLOON_GSI));
        }
        if self.disk.is_some() {
            words.push(mmio::cmdline_fragment(DISK_MMIO, DISK_GSI));
        }
        if self.net.is_some() {
            words.push(mmio::cmdline_fragment(NET_MMIO, NET_GSI));
        }
        words.join(" ")
    }

    /// For ferry's guest: refuses a `vcpus=` of the user's that contradicts `vcpus`, and a
    /// command line the guest's own parser refuses.
    pub fn check_cmdline(&self) -> Result<(), BootError> {
        // The VMM tells the guest its vCPU count; a vcpus= of the user's that says otherwise
        // was silently overridden.
        let asked = self
            .cmdline
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("vcpus="))
            .next_back();
        if let Some(n) = asked.filter(|n| *n != self.vcpus.to_string()) {
            return Err(BootError::Cmdline(format!(
                "vcpus={n} in --cmdline contradicts --vcpus {}: give the count with --vcpus alone (ferry tells the guest)",
                self.vcpus
            )));
        }
        ferry_guest_abi::params::parse(&self.full_cmdline())
            .map_err(|e| BootError::Cmdline(e.to_string()))?;
        Ok(())
    }
}

/// Most vCPUs a VM may have: the seeds' largest examples (32 and 40) with room, and what one
/// byte of local APIC id in CPUID leaf 1 and a flat PVH start allow without x2APIC.
pub const MAX_VCPUS: u8 = ferry_guest_abi::smp::MAX_VCPUS as u8;

/// Where the balloon's registers are: the first page of the 32-bit MMIO hole above the
/// 3 GiB of RAM below it, far from the IOAPIC and LAPIC windows at its top.
pub const BALLOON_MMIO: u64 = MMIO_HOLE_START + 0x1000_0000;
/// Its interrupt: the first legacy line free of the PC's devices (COM1 and COM2 take 4 and 3).
pub const BALLOON_GSI: u32 = 5;
/// Where the disk's registers are: the page after the balloon's.
pub const DISK_MMIO: u64 = BALLOON_MMIO + mmio::MMIO_SIZE;
/// Its interrupt: the next legacy line (a PC's floppy controller, which this VM has none of).
pub const DISK_GSI: u32 = 6;
/// Where the NIC's registers are: the page after the disk's.
pub const NET_MMIO: u64 = DISK_MMIO + mmio::MMIO_SIZE;
/// The NIC's interrupt line.
pub const NET_GSI: u32 = 7;
