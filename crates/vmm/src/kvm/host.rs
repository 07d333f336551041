//! What this host's KVM offers guests: the guest physical address width (supported CPUID leaf
//! 0x8000_0008), and the memory limit it sets (`crate::limit` holds the arithmetic).

#![forbid(unsafe_code)]

use kvm_ioctls::Kvm;

use crate::limit::{DEFAULT_PHYS_BITS, MemoryLimit};
use crate::vm::config::GuestKind;

impl MemoryLimit {
    /// The limit on this host, asking its KVM.
    pub fn of_host(kvm: &Kvm, guest: GuestKind) -> MemoryLimit {
        MemoryLimit::new(guest_phys_bits(kvm), guest)
    }
}

/// The guest physical address width KVM offers (supported CPUID leaf 0x8000_0008, EAX bits
/// 7:0), or the x86-64 minimum when it does not say.
pub fn guest_phys_bits(kvm: &Kvm) -> u8 {
    kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .ok()
        .and_then(|cpuid| {
            cpuid
                .as_slice()
                .iter()
                .find(|e| e.function == 0x8000_0008)
                .map(|e| (e.eax & 0xff) as u8)
        })
        .filter(|&bits| bits >= DEFAULT_PHYS_BITS)
        .unwrap_or(DEFAULT_PHYS_BITS)
}
