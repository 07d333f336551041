//! The TSC's controls that kvm-ioctls does not wrap on x86: a vCPU's TSC offset (the vCPU
//! device attribute `KVM_VCPU_TSC_CTRL` / `KVM_VCPU_TSC_OFFSET`, Linux 5.16+), the VM's
//! default guest TSC frequency (`KVM_GET_TSC_KHZ` on the VM), and the host's TSC and wall
//! clock read by the VMM itself where `KVM_GET_CLOCK` does not give them (a host whose
//! kvmclock is not on its master clock). The kernel's `Documentation/virt/kvm/devices/
//! vcpu.rst` describes the attribute and the migration it is for; `kvm::clock` does it. Below
//! them, the rule for a guest TSC frequency a destination is asked to give ([`frequency`]).

use kvm_bindings::{KVM_VCPU_TSC_CTRL, KVM_VCPU_TSC_OFFSET, KVMIO, kvm_device_attr};
use kvm_ioctls::{Cap, VcpuFd, VmFd};
#[allow(unused_imports)] // used inside the ioctl_*_nr! expansions
use vmm_sys_util::ioctl_ioc_nr;
use vmm_sys_util::{ioctl_io_nr, ioctl_iow_nr};

ioctl_iow_nr!(KVM_SET_DEVICE_ATTR, KVMIO, 0xe1, kvm_device_attr);
ioctl_iow_nr!(KVM_GET_DEVICE_ATTR, KVMIO, 0xe2, kvm_device_attr);
ioctl_iow_nr!(KVM_HAS_DEVICE_ATTR, KVMIO, 0xe3, kvm_device_attr);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);

/// KVM's default `tsc_tolerance_ppm`: a guest TSC frequency this close to the host's is taken
/// by `KVM_SET_TSC_KHZ` without scaling (the guest's TSC then runs at the host's rate).
pub const KVM_TSC_TOLERANCE_PPM: u32 = 250;

/// The attribute that names a vCPU's TSC offset, pointing at `value`.
fn offset_attr(value: *const u64) -> kvm_device_attr {
    kvm_device_attr {
        flags: 0,
        group: KVM_VCPU_TSC_CTRL,
        attr: u64::from(KVM_VCPU_TSC_OFFSET),
        addr: value as u64,
    }
}

/// Whether this KVM reads and writes `vcpu`'s TSC offset (Linux 5.16+).
pub fn has_offset(vcpu: &VcpuFd) -> bool {
    let attr = offset_attr(std::ptr::null());
    // SAFETY: KVM_HAS_DEVICE_ATTR reads the attribute struct only; `addr` is not followed.
    unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vcpu, KVM_HAS_DEVICE_ATTR(), &attr) == 0 }
}

/// `vcpu`'s TSC offset: the guest's TSC is the host's plus this (wrapping, as KVM adds it).
pub fn offset(vcpu: &VcpuFd) -> Result<u64, vmm_sys_util::errno::Error> {
    let mut value = 0u64;
    let attr = offset_attr(&raw mut value);
    // SAFETY: KVM_GET_DEVICE_ATTR writes one u64 at `addr`, which points at `value`, alive and
    // writable for the call.
    let ret = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vcpu, KVM_GET_DEVICE_ATTR(), &attr) };
    match ret {
        0 => Ok(value),
        _ => Err(vmm_sys_util::errno::Error::last()),
    }
}

/// Sets `vcpu`'s TSC offset (KVM also resynchronises the VM's master clock with it).
pub fn set_offset(vcpu: &VcpuFd, value: u64) -> Result<(), vmm_sys_util::errno::Error> {
    let attr = offset_attr(&raw const value);
    // SAFETY: KVM_SET_DEVICE_ATTR reads one u64 at `addr`, which points at `value`.
    let ret = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vcpu, KVM_SET_DEVICE_ATTR(), &attr) };
    match ret {
        0 => Ok(()),
        _ => Err(vmm_sys_util::errno::Error::last()),
    }
}

/// The guest TSC frequency a new vCPU of `vm` gets (kHz), before any vCPU exists; `None`
/// where this KVM does not answer on the VM (older than Linux 6.0).
pub fn vm_khz(vm: &VmFd) -> Option<u32> {
    // SAFETY: an ioctl on the VM's fd that takes no argument and returns the frequency.
    let ret = unsafe { vmm_sys_util::ioctl::ioctl(vm, KVM_GET_TSC_KHZ()) };
    u32::try_from(ret).ok().filter(|&khz| khz > 0)
}

/// Whether this host's KVM can give a guest another TSC frequency than its own: the CPU
/// scales the TSC (`KVM_CAP_TSC_CONTROL`, or `KVM_CAP_VM_TSC_CONTROL` for the VM's default).
/// Without it KVM takes a frequency within its tolerance of its own (`tsc_tolerance_ppm`,
/// 250 ppm by default) and runs the guest's TSC at the host's rate.
pub fn can_scale(vm: &VmFd) -> bool {
    vm.check_extension_int(Cap::TscControl) > 0
        || vm.check_extension_raw(u64::from(kvm_bindings::KVM_CAP_VM_TSC_CONTROL)) > 0
}

/// The flags `KVM_SET_CLOCK` and `KVM_GET_CLOCK` know on `vm` (`KVM_CAP_ADJUST_CLOCK`).
pub fn clock_flags(vm: &VmFd) -> u32 {
    u32::try_from(vm.check_extension_int(Cap::AdjustClock)).unwrap_or(0)
}

/// The host's TSC, read by the VMM: the counter KVM's `host_tsc` is a reading of.
pub fn host_tsc() -> u64 {
    // SAFETY: RDTSC reads a counter; it touches no memory.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// The host's wall clock (`CLOCK_REALTIME`) in ns since the epoch, as `KVM_GET_CLOCK`'s
/// `realtime` is; 0 for a clock set before 1970.
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// KVM's `tsc_tolerance_ppm` module parameter: how far a guest TSC frequency may be from the
/// host's for `KVM_SET_TSC_KHZ` to take it without scaling; KVM's default where it is not
/// readable.
pub fn tolerance_ppm() -> u32 {
    std::fs::read_to_string("/sys/module/kvm/parameters/tsc_tolerance_ppm")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(KVM_TSC_TOLERANCE_PPM)
}

/// A guest TSC frequency this host cannot give.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the guest's TSC runs at {source_khz} kHz on the source and would run at {own_khz} kHz here, {ppm} ppm apart: more than KVM's tolerance of {tolerance_ppm} ppm, and this host's CPU cannot scale the TSC (no KVM_CAP_TSC_CONTROL); move the guest to a host with the same TSC frequency, or to one whose CPU scales the TSC"
)]
pub struct TscFrequencyError {
    pub source_khz: u32,
    pub own_khz: u32,
    pub ppm: u64,
    pub tolerance_ppm: u32,
}

/// What a destination running its guest TSC at `own_khz` does with a guest whose TSC ran at
/// `source_khz`: nothing (the same), `Some(source_khz)` for `KVM_SET_TSC_KHZ` (the host scales
/// the TSC, or the difference is within KVM's tolerance, where KVM takes it unscaled), or a
/// refusal. KVM itself would take a higher frequency beyond its tolerance on a host that cannot
/// scale, by moving the TSC forward at each guest entry; a guest reading the TSC between
/// entries would see it run at the wrong rate, so that is refused here.
pub fn frequency(
    source_khz: u32,
    own_khz: u32,
    can_scale: bool,
    tolerance_ppm: u32,
) -> Result<Option<u32>, TscFrequencyError> {
    if source_khz == own_khz || source_khz == 0 || own_khz == 0 {
        return Ok(None);
    }
    let bound = |sign: i64| {
        (i64::from(own_khz) * (1_000_000 + sign * i64::from(tolerance_ppm)) / 1_000_000) as u32
    };
    if can_scale || (bound(-1)..=bound(1)).contains(&source_khz) {
        return Ok(Some(source_khz));
    }
    Err(TscFrequencyError {
        source_khz,
        own_khz,
        ppm: u64::from(source_khz.abs_diff(own_khz)) * 1_000_000 / u64::from(own_khz),
        tolerance_ppm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frequency_within_tolerance_or_scaled_is_set_and_else_refused_naming_both() {
        let own = 2_445_406;
        // (source kHz, host scales) -> what the destination does
        let table = [
            (own, false, Ok(None)),
            (0, false, Ok(None)),
            (own + 600, false, Ok(Some(own + 600))),
            (own - 600, false, Ok(Some(own - 600))),
            (own + own / 100, true, Ok(Some(own + own / 100))),
        ];
        for (source, scale, want) in table {
            assert_eq!(
                frequency(source, own, scale, KVM_TSC_TOLERANCE_PPM).map_err(|_| ()),
                want,
                "{source}"
            );
        }
        for source in [own + own / 100, own - own / 100, own + 700] {
            let e = frequency(source, own, false, KVM_TSC_TOLERANCE_PPM).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(&format!("{source} kHz on the source")),
                "{text}"
            );
            assert!(text.contains(&format!("{own} kHz here")), "{text}");
            assert!(text.contains("cannot scale"), "{text}");
        }
    }
}
