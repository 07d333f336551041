//! Everything that talks to KVM. No other module of the VMM imports `kvm-ioctls`.
//!
//! - `mod.rs`: open `/dev/kvm`, create the VM, register guest RAM as memory slots.
//! - `vcpu.rs`: configure a vCPU for PVH entry and run it, turning exits into device calls.
//! - `kick.rs`: get a vCPU thread out of `KVM_RUN` without racing it.
//! - `irqchip.rs`: the in-kernel interrupt controller, its irqfds and its state.
//! - `state.rs`: a vCPU's and the VM clock's state as bytes; `dirty.rs`: the dirty log.

pub mod dirty;
pub mod irqchip;
pub mod kick;
pub mod state;
pub mod vcpu;

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VmFd};

use crate::memory::GuestRam;

/// Why KVM could not be set up, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error(
        "cannot open /dev/kvm: permission denied; run ferry as root or add your user to the kvm group (sudo usermod -aG kvm $USER, then log in again)"
    )]
    PermissionDenied,
    #[error(
        "cannot open /dev/kvm: it does not exist; enable virtualisation in the firmware and load the kvm module (modprobe kvm_intel or kvm_amd)"
    )]
    NotPresent,
    #[error("cannot open /dev/kvm: {0}")]
    Open(vmm_sys_util::errno::Error),
    #[error("KVM API version {0} is not the stable version 12 ferry needs")]
    ApiVersion(i32),
    #[error("cannot create a KVM VM: {0}")]
    CreateVm(vmm_sys_util::errno::Error),
    #[error("cannot register guest RAM at {gpa:#x} ({size} bytes) with KVM: {source}")]
    MemorySlot {
        gpa: u64,
        size: u64,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("cannot set up vCPU {id}: {what}: {source}")]
    Vcpu {
        id: u8,
        what: &'static str,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    #[error("cannot create the in-kernel interrupt controller: {0}")]
    Irqchip(vmm_sys_util::errno::Error),
    #[error("cannot connect an interrupt line to GSI {gsi}: {source}")]
    Irqfd {
        gsi: u32,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
}

/// Opens `/dev/kvm`, mapping the common failures to advice.
pub fn open() -> Result<Kvm, KvmError> {
    let kvm = Kvm::new().map_err(|e| match e.errno() {
        libc::EACCES | libc::EPERM => KvmError::PermissionDenied,
        libc::ENOENT | libc::ENXIO | libc::ENODEV => KvmError::NotPresent,
        _ => KvmError::Open(e),
    })?;
    match kvm.get_api_version() {
        12 => Ok(kvm),
        v => Err(KvmError::ApiVersion(v)),
    }
}

/// For test suites that boot real VMs: panics, loudly and with the fix, when `/dev/kvm` cannot
/// be opened. Every machine of this project has KVM, so a test must fail rather than skip.
pub fn require_for_tests() {
    if let Err(e) = open() {
        panic!("\n\n*** THIS TEST NEEDS /dev/kvm AND CANNOT USE IT ***\n*** {e} ***\n\n");
    }
}

/// A KVM VM with guest RAM registered, one memory slot per RAM region.
#[derive(Debug)]
pub struct KvmVm {
    pub kvm: Kvm,
    pub vm: VmFd,
}

impl KvmVm {
    pub fn new(kvm: Kvm, ram: &GuestRam) -> Result<KvmVm, KvmError> {
        let vm = kvm.create_vm().map_err(KvmError::CreateVm)?;
        for (slot, r) in ram.regions().iter().enumerate() {
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: r.gpa,
                memory_size: r.size,
                userspace_addr: r.host_addr,
            };
            // SAFETY: the region describes a live mapping owned by `ram`, which the VM's
            // owner keeps alive for as long as the VM (see `Vm`); slots do not overlap.
            unsafe { vm.set_user_memory_region(region) }.map_err(|source| {
                KvmError::MemorySlot {
                    gpa: r.gpa,
                    size: r.size,
                    source,
                }
            })?;
        }
        Ok(KvmVm { kvm, vm })
    }
}
