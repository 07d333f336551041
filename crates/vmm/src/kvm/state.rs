//! A vCPU's and the VM's KVM state as versioned byte sections for migration: registers,
//! special registers, XSAVE (FPU/SSE/AVX), XCRs, MSRs (TSC and kvmclock among them), pending
//! events, MP state, debug registers. The VM's clock, and the TSC's advance across the pause
//! that a restored `IA32_TSC` gets, are `clock.rs`'s.

use kvm_bindings::{
    Msrs, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use zerocopy::{FromBytes, IntoBytes};

/// Version of the vCPU section layout this VMM writes.
pub const VCPU_STATE_VERSION: u32 = 1;
/// The oldest vCPU layout it loads: the one it writes, no layout having changed since the
/// first (a change raises the version and keeps a loader for this one).
pub const VCPU_STATE_OLDEST: u32 = VCPU_STATE_VERSION;
/// `IA32_TSC`: the vCPU's TSC, which a restore advances by the pause (`clock::TscPlan`).
const IA32_TSC: u32 = 0x10;
/// Most MSRs a section may carry (the host's save list has ~40).
const MAX_MSRS: u32 = 256;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("KVM could not {what}: {source}")]
    Kvm {
        what: &'static str,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("vCPU state section is malformed: {0}")]
    Malformed(String),
    #[error(
        "{count} MSRs do not fit one KVM MSR list: {source}; the host offers, or the section \
         holds, more MSRs than KVM_GET_MSRS and KVM_SET_MSRS take at once"
    )]
    MsrList {
        count: usize,
        #[source]
        source: vmm_sys_util::fam::Error,
    },
    #[error(
        "the destination refused MSR {msr:#x} ({set} of {total} MSRs were set); the hosts' KVM versions or CPUs differ"
    )]
    Msrs { set: usize, total: usize, msr: u32 },
    #[error("the host's XSAVE state ({0} bytes) does not fit the 4 KiB KVM_GET_XSAVE buffer")]
    XsaveTooLarge(i32),
    #[error(transparent)]
    TscFrequency(#[from] super::tsc::TscFrequencyError),
}

pub(super) fn kvm(what: &'static str) -> impl FnOnce(vmm_sys_util::errno::Error) -> StateError {
    move |source| StateError::Kvm { what, source }
}

/// KVM's paravirtual wall clock MSRs (`MSR_KVM_WALL_CLOCK`, `MSR_KVM_WALL_CLOCK_NEW`): not
/// state but a command. KVM documents that writing one fills the wall clock structure in guest
/// memory at the address written; reading one returns the last address (0 if the guest never
/// wrote it). Restored with a vCPU, it could write 12 bytes into guest RAM during the state
/// load (at guest address 0 for a guest that never asked), after the pages arrived, and before
/// a local handover's Go into memory the source may still resume. A guest reads the wall clock
/// only right after it writes the MSR, so nothing is lost by not carrying it.
const WALL_CLOCK_MSRS: [u32; 2] = [0x11, 0x4b56_4d00];

/// MSRs worth saving: every MSR the host's KVM lists that this vCPU can read, but the wall
/// clock's (`WALL_CLOCK_MSRS`: 0x11 and 0x4b564d00).
pub fn readable_msrs(kvm_fd: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, StateError> {
    let list = kvm_fd.get_msr_index_list().map_err(kvm("list the MSRs"))?;
    Ok(list
        .as_slice()
        .iter()
        .copied()
        .filter(|index| !WALL_CLOCK_MSRS.contains(index))
        .filter(|&index| {
            let mut one = Msrs::from_entries(&[kvm_msr_entry {
                index,
                ..Default::default()
            }])
            .unwrap();
            matches!(vcpu.get_msrs(&mut one), Ok(1))
        })
        .collect())
}

/// Captures a paused vCPU.
pub fn save_vcpu(vm: &VmFd, vcpu: &VcpuFd, msrs: &[u32]) -> Result<Vec<u8>, StateError> {
    let xsave_size = vm.check_extension_int(Cap::Xsave2);
    if xsave_size > size_of::<kvm_xsave>() as i32 {
        return Err(StateError::XsaveTooLarge(xsave_size));
    }
    let mut out = Vec::with_capacity(8192);
    put(
        &mut out,
        vcpu.get_regs().map_err(kvm("read vCPU state"))?.as_bytes(),
    );
    put(
        &mut out,
        vcpu.get_sregs().map_err(kvm("read vCPU state"))?.as_bytes(),
    );
    put(
        &mut out,
        vcpu.get_xsave().map_err(kvm("read vCPU state"))?.as_bytes(),
    );
    put(
        &mut out,
        vcpu.get_xcrs().map_err(kvm("read vCPU state"))?.as_bytes(),
    );
    put(
        &mut out,
        vcpu.get_vcpu_events()
            .map_err(kvm("read vCPU state"))?
            .as_bytes(),
    );
    put(
        &mut out,
        vcpu.get_mp_state()
            .map_err(kvm("read vCPU state"))?
            .as_bytes(),
    );
    put(
        &mut out,
        vcpu.get_debug_regs()
            .map_err(kvm("read vCPU state"))?
            .as_bytes(),
    );
    let entries: Vec<kvm_msr_entry> = msrs
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut list = msr_list(&entries)?;
    let read = vcpu.get_msrs(&mut list).map_err(kvm("read the MSRs"))?;
    out.extend_from_slice(&(read as u32).to_le_bytes());
    for e in &list.as_slice()[..read] {
        out.extend_from_slice(e.as_bytes());
    }
    Ok(out)
}

/// Writes a captured state, and its local APIC's, into a vCPU that has its CPUID set and has
/// not run, its `IA32_TSC` advanced by `tsc_advance` ticks (the pause, `clock::TscPlan`). The
/// order is KVM's: the APIC after the special registers (which hold its base address), the
/// MSRs after the APIC (the TSC-deadline MSR means something only once the timer's mode is
/// set), MP state and pending events last.
pub fn restore_vcpu(
    vm: &VmFd,
    vcpu: &VcpuFd,
    bytes: &[u8],
    lapic: &kvm_lapic_state,
    tsc_advance: u64,
) -> Result<(), StateError> {
    let mut r = Reader(bytes);
    let regs: kvm_regs = r.value()?;
    let sregs: kvm_sregs = r.value()?;
    let xsave: kvm_xsave = r.value()?;
    let xcrs: kvm_xcrs = r.value()?;
    let events: kvm_vcpu_events = r.value()?;
    let mp_state: kvm_mp_state = r.value()?;
    let debugregs: kvm_debugregs = r.value()?;
    let count = r.u32()?;
    if count > MAX_MSRS {
        return Err(StateError::Malformed(format!(
            "{count} MSRs, more than {MAX_MSRS}"
        )));
    }
    let mut entries = (0..count)
        .map(|_| r.raw::<kvm_msr_entry>())
        .collect::<Result<Vec<_>, _>>()?;
    for e in entries.iter_mut().filter(|e| e.index == IA32_TSC) {
        e.data = e.data.wrapping_add(tsc_advance);
    }
    if !r.0.is_empty() {
        return Err(StateError::Malformed(format!(
            "{} trailing bytes",
            r.0.len()
        )));
    }
    if vm.check_extension_int(Cap::Xsave2) > size_of::<kvm_xsave>() as i32 {
        return Err(StateError::XsaveTooLarge(
            vm.check_extension_int(Cap::Xsave2),
        ));
    }
    vcpu.set_sregs(&sregs).map_err(kvm("write vCPU state"))?;
    vcpu.set_regs(&regs).map_err(kvm("write vCPU state"))?;
    // SAFETY: the host's XSAVE state fits the legacy 4 KiB buffer (checked above), which is
    // the condition under which KVM_SET_XSAVE reads only the struct it is given.
    unsafe { vcpu.set_xsave(&xsave) }.map_err(kvm("write vCPU state"))?;
    vcpu.set_xcrs(&xcrs).map_err(kvm("write vCPU state"))?;
    vcpu.set_debug_regs(&debugregs)
        .map_err(kvm("write vCPU state"))?;
    vcpu.set_lapic(lapic).map_err(kvm("write the local APIC"))?;
    restore_msrs(vcpu, &entries)?;
    vcpu.set_mp_state(mp_state)
        .map_err(kvm("write vCPU state"))?;
    vcpu.set_vcpu_events(&events)
        .map_err(kvm("write vCPU state"))?;
    Ok(())
}

/// `entries` as KVM's MSR list.
fn msr_list(entries: &[kvm_msr_entry]) -> Result<Msrs, StateError> {
    Msrs::from_entries(entries).map_err(|source| StateError::MsrList {
        count: entries.len(),
        source,
    })
}

/// Writes the MSRs in as few `KVM_SET_MSRS` calls as KVM allows: one, unless KVM stops at an
/// MSR it refuses. Some MSRs that KVM lets a vCPU read refuse a write of the value they already
/// hold (KVM's poll-control MSR does on some hosts); such a refusal is harmless, so a refused
/// write is accepted only if the destination already holds the saved value, and the writes go
/// on after it. (One call per MSR cost ~2 µs each, most of a vCPU's load.)
fn restore_msrs(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<(), StateError> {
    let mut i = 0;
    while i < entries.len() {
        let batch = msr_list(&entries[i..])?;
        i += vcpu.set_msrs(&batch).map_err(kvm("write the MSRs"))?;
        let Some(refused) = entries.get(i) else {
            break;
        };
        let mut current = msr_list(&[kvm_msr_entry {
            index: refused.index,
            ..Default::default()
        }])?;
        let same = matches!(vcpu.get_msrs(&mut current), Ok(1))
            && current.as_slice()[0].data == refused.data;
        if !same {
            return Err(StateError::Msrs {
                set: i,
                total: entries.len(),
                msr: refused.index,
            });
        }
        i += 1;
    }
    Ok(())
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Reads length-prefixed values, checking every length against the type it fills.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], StateError> {
        if self.0.len() < n {
            return Err(StateError::Malformed(format!(
                "truncated: want {n} bytes, {} left",
                self.0.len()
            )));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, StateError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    fn raw<T: FromBytes>(&mut self) -> Result<T, StateError> {
        let bytes = self.take(size_of::<T>())?;
        T::read_from_bytes(bytes).map_err(|_| StateError::Malformed("bad value".into()))
    }

    fn value<T: FromBytes>(&mut self) -> Result<T, StateError> {
        let len = self.u32()? as usize;
        if len != size_of::<T>() {
            return Err(StateError::Malformed(format!(
                "{} of {len} bytes, want {}",
                std::any::type_name::<T>(),
                size_of::<T>()
            )));
        }
        self.raw()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYSENTER_CS: u32 = 0x174;
    const SYSENTER_ESP: u32 = 0x175;
    /// No MSR: KVM refuses to write (or read) it.
    const NO_SUCH_MSR: u32 = 0xdead_0000;

    fn msr(index: u32, data: u64) -> kvm_msr_entry {
        kvm_msr_entry {
            index,
            data,
            ..Default::default()
        }
    }

    fn read_msr(vcpu: &VcpuFd, index: u32) -> u64 {
        let mut one = Msrs::from_entries(&[msr(index, 0)]).unwrap();
        assert_eq!(vcpu.get_msrs(&mut one).unwrap(), 1);
        one.as_slice()[0].data
    }

    #[test]
    fn msrs_are_written_in_one_batch_and_a_refused_one_is_named() {
        crate::kvm::require_for_tests();
        let vm = Kvm::new().unwrap().create_vm().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        restore_msrs(&vcpu, &[msr(SYSENTER_CS, 9), msr(SYSENTER_ESP, 11)]).unwrap();
        assert_eq!(
            (read_msr(&vcpu, SYSENTER_CS), read_msr(&vcpu, SYSENTER_ESP)),
            (9, 11)
        );
        let entries = [
            msr(SYSENTER_CS, 5),
            msr(NO_SUCH_MSR, 1),
            msr(SYSENTER_ESP, 7),
        ];
        match restore_msrs(&vcpu, &entries) {
            Err(StateError::Msrs { set, total, msr }) => {
                assert_eq!((set, total, msr), (1, 3, NO_SUCH_MSR))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            read_msr(&vcpu, SYSENTER_CS),
            5,
            "the ones before it were written"
        );
    }

    /// The wall clock MSRs are a command, not state (see [`WALL_CLOCK_MSRS`]): the MSRs carried
    /// leave them out. Whether this host's KVM writes guest RAM when one is restored is printed
    /// (KVM's documentation says a write fills the structure; the project's nested host was
    /// seen not to for a write from the VMM).
    #[test]
    fn the_wall_clock_msrs_are_not_carried() {
        crate::kvm::require_for_tests();
        let kvm = Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
        // SAFETY: a non-zero size; the page is leaked, never freed.
        let page = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!page.is_null());
        let region = kvm_bindings::kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: 4096,
            userspace_addr: page as u64,
        };
        // SAFETY: the region is a leaked, page-aligned page, mapped for the rest of the
        // process.
        unsafe { vm.set_user_memory_region(region) }.unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let carried = readable_msrs(&kvm, &vcpu).unwrap();
        assert!(!carried.iter().any(|m| WALL_CLOCK_MSRS.contains(m)));
        if restore_msrs(&vcpu, &[msr(WALL_CLOCK_MSRS[1], 0)]).is_ok() {
            // SAFETY: reads the leaked page through the mapping KVM would write.
            let written = unsafe { std::ptr::read_volatile(page.cast::<[u8; 12]>()) };
            eprintln!(
                "restoring MSR_KVM_WALL_CLOCK_NEW here {} guest RAM",
                if written == [0; 12] {
                    "left alone"
                } else {
                    "wrote"
                }
            );
        }
    }

    #[test]
    fn reader_checks_lengths() {
        let mut bytes = Vec::new();
        put(&mut bytes, kvm_regs::default().as_bytes());
        assert!(Reader(&bytes).value::<kvm_regs>().is_ok());
        assert!(
            Reader(&bytes)
                .value::<kvm_sregs>()
                .unwrap_err()
                .to_string()
                .contains("want")
        );
        assert!(
            Reader(&bytes[..10])
                .value::<kvm_regs>()
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
    }
}
