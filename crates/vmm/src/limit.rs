//! How much RAM a VM may have on this host, and why: the limit `ferry run --memory` is
//! checked against, and what `--memory max` asks for.
//!
//! Three bounds, the lowest wins:
//! - the guest physical address width this host's KVM gives guests (CPUID leaf 0x8000_0008,
//!   as KVM reports it supported): RAM and the MMIO hole must fit under `2^bits`;
//! - half of x86-64's 47-bit user address space, 64 TiB: guest RAM is one mapping in the VMM
//!   process, and `ferry demo` maps a source's and a destination's in one process;
//! - for ferry's built-in guest, the 512 GiB of addresses it maps RAM with (one PML4 entry).
//!
//! What this does not bound: KVM's own bookkeeping per memory slot, which on a host with
//! shadow paging costs 8 bytes of kernel memory per 4 KiB guest page when the slot is
//! registered (a 511 GiB guest: 1 GiB of kernel memory, 0.3-2 s; 4 TiB: 8 GiB, 27 s measured
//! on the project's machine); a host without that memory refuses the slot
//! (`KvmError::OutOfMemory` says so, and what to do).
//!
//! The arithmetic is here, pure; asking the host's KVM (`MemoryLimit::of_host`) is in
//! `kvm/host.rs`.

#![forbid(unsafe_code)]

use crate::memory::{MMIO_HOLE_END, MMIO_HOLE_START, MemoryError, Size};
use crate::vm::config::GuestKind;

pub use crate::memory::MAPPABLE_TOP;

/// The built-in guest maps RAM with one PML4 entry: 512 GiB of addresses, less the MMIO hole.
pub const BUILTIN_GUEST_MAX_MEMORY: u64 =
    ferry_guest_abi::layout::MAX_RAM_TOP - (MMIO_HOLE_END - MMIO_HOLE_START);

/// What KVM's supported CPUID leaf 0x8000_0008 says when a host leaves it out: the 36 bits
/// every x86-64 CPU has.
pub const DEFAULT_PHYS_BITS: u8 = 36;

/// The most RAM a VM may have here, and the bound that sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    pub bytes: u64,
    /// The guest physical address width this host's KVM gives guests.
    pub phys_bits: u8,
    /// What the host allows any guest (without the built-in guest's own bound).
    pub host_bytes: u64,
    pub why: String,
}

impl MemoryLimit {
    /// The limit for a guest of kind `guest` on a host whose KVM gives `phys_bits`-bit guest
    /// physical addresses.
    pub fn new(phys_bits: u8, guest: GuestKind) -> MemoryLimit {
        let top = 1u64
            .checked_shl(u32::from(phys_bits))
            .unwrap_or(u64::MAX)
            .min(MAPPABLE_TOP);
        let host_bytes = top.saturating_sub(MMIO_HOLE_END - MMIO_HOLE_START);
        let host_why = if top == MAPPABLE_TOP {
            format!(
                "this host's KVM gives guests {phys_bits}-bit physical addresses, and ferry maps at most {} of guest addresses (half of the process's address space)",
                Size(MAPPABLE_TOP)
            )
        } else {
            format!("this host's KVM gives guests {phys_bits}-bit physical addresses")
        };
        match guest {
            GuestKind::FerryGuest if BUILTIN_GUEST_MAX_MEMORY < host_bytes => MemoryLimit {
                bytes: BUILTIN_GUEST_MAX_MEMORY,
                phys_bits,
                host_bytes,
                why: format!(
                    "the built-in guest maps 512 GiB of addresses; {host_why}: {} for another PVH kernel",
                    Size(host_bytes)
                ),
            },
            _ => MemoryLimit {
                bytes: host_bytes,
                phys_bits,
                host_bytes,
                why: host_why,
            },
        }
    }

    /// Refuses `size` above the limit, naming it and why.
    pub fn check(&self, size: u64) -> Result<(), MemoryError> {
        if size > self.bytes {
            return Err(MemoryError::TooLarge {
                size,
                max: self.bytes,
                why: self.why.clone(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_lowest_bound_wins_and_is_named() {
        let builtin = MemoryLimit::new(48, GuestKind::FerryGuest);
        assert_eq!(builtin.bytes, 511 * GIB);
        assert_eq!(builtin.host_bytes, (64 << 10) * GIB - GIB);
        assert!(builtin.why.contains("512 GiB"), "{}", builtin.why);
        let foreign = MemoryLimit::new(48, GuestKind::Foreign);
        assert_eq!(
            foreign.bytes,
            (64 << 10) * GIB - GIB,
            "half the address space"
        );
        assert!(foreign.why.contains("48-bit"), "{}", foreign.why);
        let narrow = MemoryLimit::new(39, GuestKind::FerryGuest);
        assert_eq!(narrow.bytes, 511 * GIB, "2^39 is 512 GiB: the same bound");
        let narrower = MemoryLimit::new(36, GuestKind::FerryGuest);
        assert_eq!(narrower.bytes, 63 * GIB, "36 bits: 64 GiB of addresses");
        assert!(narrower.why.contains("36-bit"), "{}", narrower.why);
    }

    #[test]
    fn a_size_above_the_limit_is_refused_with_the_reason() {
        let limit = MemoryLimit::new(48, GuestKind::FerryGuest);
        assert!(limit.check(511 * GIB).is_ok());
        let msg = limit.check(512 * GIB).unwrap_err().to_string();
        assert!(
            msg.contains("512G") && msg.contains("511G") && msg.contains("--memory max"),
            "{msg}"
        );
    }
}
