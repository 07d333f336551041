//! A vCPU: PVH entry state, the run loop, and what each exit means.

#![forbid(unsafe_code)]

use kvm_bindings::CpuId;
use kvm_bindings::{
    KVM_MAX_CPUID_ENTRIES, kvm_cpuid_entry2, kvm_mp_state, kvm_regs, kvm_segment, kvm_sregs,
};
use kvm_ioctls::{Cap, VcpuExit};

/// The `mp_state` of a vCPU that runs (started, not waiting for a start-up IPI).
pub use kvm_bindings::KVM_MP_STATE_RUNNABLE;
/// A vCPU as KVM gives it: the VM's other modules hold it without importing KVM.
pub use kvm_ioctls::VcpuFd;

use super::{KvmError, KvmVm};
use crate::boot::BootSetup;
use ferry_guest_abi::smp::StartVcpu;

/// CPUID.1:ECX bit 24: the local APIC timer has TSC-deadline mode.
const CPUID_1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// CR0.PE | CR0.ET: protected mode, paging off, as PVH requires at entry.
const PVH_CR0: u64 = 0x11;
/// RFLAGS at entry: only the always-one bit.
const PVH_RFLAGS: u64 = 0x2;

/// Creates vCPU `id` with `cpuid`'s table. Its registers are set by [`set_pvh_entry`] for a
/// fresh boot, by [`start_secondary`] when the guest starts it, or by `state::restore_vcpu`
/// for an incoming migration.
pub fn create(vm: &KvmVm, id: u8) -> Result<VcpuFd, KvmError> {
    let err = |what| move |source| KvmError::Vcpu { id, what, source };
    let vcpu = vm.vm.create_vcpu(u64::from(id)).map_err(err("create"))?;
    vcpu.set_cpuid2(&cpuid(vm, id)?).map_err(err("set CPUID"))?;
    Ok(vcpu)
}

/// The TSC frequency KVM gives `vcpu`'s guest (`KVM_GET_TSC_KHZ`), in Hz; `None` where KVM
/// does not say.
pub fn tsc_hz(vcpu: &VcpuFd) -> Option<u64> {
    vcpu.get_tsc_khz().ok().map(|khz| u64::from(khz) * 1000)
}

/// The CPUID vCPU `id` gets: the host's supported CPUID (which includes KVM's paravirtual
/// leaves, so the guest finds kvmclock), with its APIC id and TSC-deadline timer.
fn cpuid(vm: &KvmVm, id: u8) -> Result<CpuId, KvmError> {
    let mut cpuid = vm
        .kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| KvmError::Vcpu {
            id,
            what: "read supported CPUID",
            source,
        })?;
    // KVM emulates the APIC timer's TSC-deadline mode with its in-kernel APIC but leaves the
    // CPUID bit to the VMM (it depends on the irqchip being in the kernel, which it is here).
    let tsc_deadline = vm.kvm.check_extension(Cap::TscDeadlineTimer);
    for entry in cpuid.as_mut_slice() {
        if entry.function == 1 {
            // Initial APIC ID in EBX[31:24].
            entry.ebx = (entry.ebx & 0x00ff_ffff) | (u32::from(id) << 24);
            if tsc_deadline {
                entry.ecx |= CPUID_1_ECX_TSC_DEADLINE;
            }
        }
    }
    Ok(cpuid)
}

/// A digest of the CPUID this VM's vCPUs get (what a migration's destination must match),
/// computed without a vCPU, so that a destination can answer before it creates its vCPUs.
pub fn cpuid_digest(vm: &KvmVm) -> Result<String, KvmError> {
    Ok(digest(cpuid(vm, 0)?.as_slice()))
}

/// FNV-1a, as hex, over what CPUID says of the CPU's identity and features: the vendor (leaf
/// 0) and the feature flags of leaves 1, 7 and 0x80000001. Not over every entry: KVM fills
/// some (XSAVE sizes, topology) from state that differs between two VMs of one host, and the
/// OS-controlled bits (OSXSAVE, OSPKE) follow the guest's CR4.
fn digest(entries: &[kvm_cpuid_entry2]) -> String {
    const OSXSAVE: u32 = 1 << 27;
    const OSPKE: u32 = 1 << 4;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |w: u32| {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for e in entries {
        let words = match (e.function, e.index) {
            (0, _) => [e.ebx, e.ecx, e.edx],
            (1, _) => [0, e.ecx & !OSXSAVE, e.edx],
            (7, 0) => [e.ebx, e.ecx & !OSPKE, e.edx],
            (0x8000_0001, _) => [0, e.ecx, e.edx],
            _ => continue,
        };
        eat(e.function);
        words.into_iter().for_each(&mut eat);
    }
    format!("{h:016x}")
}

/// Where a kick of the vCPU's thread makes `KVM_RUN` return at once (`kick::Registration`):
/// the `immediate_exit` byte of its `kvm_run` mapping, valid as long as `vcpu` is.
pub fn immediate_exit(vcpu: &mut VcpuFd) -> *mut u8 {
    &raw mut vcpu.get_kvm_run().immediate_exit
}

/// Re-arms `KVM_RUN` after a kick made it return ([`Exit::Interrupted`]).
pub fn clear_immediate_exit(vcpu: &mut VcpuFd) {
    vcpu.set_kvm_immediate_exit(0);
}

/// Puts vCPU 0 in PVH entry state: flat 32-bit protected mode at `boot.entry` with %ebx =
/// start_info.
pub fn set_pvh_entry(vcpu: &VcpuFd, boot: &BootSetup) -> Result<(), KvmError> {
    set_entry_state(vcpu, 0, boot.entry, boot.start_info)
}

/// Starts secondary vCPU `id` as the guest asked (`ferry_guest_abi::smp`): PVH's entry state
/// at the request's entry with %ebx = its argument, and runnable (out of KVM's wait-for-SIPI).
pub fn start_secondary(vcpu: &VcpuFd, id: u8, request: &StartVcpu) -> Result<(), KvmError> {
    let (entry, arg) = (u64::from(request.entry), u64::from(request.arg));
    set_entry_state(vcpu, id, entry, arg)?;
    vcpu.set_mp_state(kvm_mp_state {
        mp_state: KVM_MP_STATE_RUNNABLE,
    })
    .map_err(|source| KvmError::Vcpu {
        id,
        what: "make it runnable",
        source,
    })
}

/// Flat 32-bit protected mode, paging off, at `entry` with %ebx = `ebx`.
fn set_entry_state(vcpu: &VcpuFd, id: u8, entry: u64, ebx: u64) -> Result<(), KvmError> {
    let err = |what| move |source| KvmError::Vcpu { id, what, source };
    let mut sregs = vcpu.get_sregs().map_err(err("read special registers"))?;
    let code = flat_segment(0x08, 0xb);
    let data = flat_segment(0x10, 0x3);
    sregs.cs = code;
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.cr0 = PVH_CR0;
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs)
        .map_err(err("set special registers"))?;

    let regs = kvm_regs {
        rip: entry,
        rbx: ebx,
        rflags: PVH_RFLAGS,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(err("set registers"))?;
    Ok(())
}

/// A present, flat (base 0, 4 GiB), 32-bit, ring 0 segment of `type_`.
fn flat_segment(selector: u16, type_: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// What one `KVM_RUN` came back with, in the VMM's terms.
#[derive(Debug)]
pub enum Exit<'a> {
    IoOut(u16, &'a [u8]),
    IoIn(u16, &'a mut [u8]),
    MmioRead(u64, &'a mut [u8]),
    MmioWrite(u64, &'a [u8]),
    /// A kick, or a signal: check the control state and run again.
    Interrupted,
    /// The vCPU's dirty ring is full: harvest and reset it before running again.
    DirtyRingFull,
    /// The VM cannot go on; the text says why.
    Fatal(String),
}

/// Runs the vCPU until its next exit.
pub fn run(vcpu: &mut VcpuFd) -> Exit<'_> {
    match vcpu.run() {
        Ok(VcpuExit::IoOut(port, data)) => Exit::IoOut(port, data),
        Ok(VcpuExit::IoIn(port, data)) => Exit::IoIn(port, data),
        Ok(VcpuExit::MmioRead(addr, data)) => Exit::MmioRead(addr, data),
        Ok(VcpuExit::MmioWrite(addr, data)) => Exit::MmioWrite(addr, data),
        Ok(VcpuExit::Intr) => Exit::Interrupted,
        Ok(VcpuExit::Unsupported(kvm_bindings::KVM_EXIT_DIRTY_RING_FULL)) => Exit::DirtyRingFull,
        Ok(VcpuExit::Shutdown) => Exit::Fatal("the guest shut down the CPU (triple fault)".into()),
        Ok(VcpuExit::FailEntry(reason, cpu)) => Exit::Fatal(format!(
            "KVM could not enter the guest (hardware entry failure reason {reason:#x} on host CPU {cpu})"
        )),
        Ok(VcpuExit::InternalError) => {
            Exit::Fatal("KVM internal error (often an instruction KVM cannot emulate)".into())
        }
        Ok(VcpuExit::SystemEvent(kind, data)) => Exit::Fatal(format!(
            "guest system event {kind} {data:x?} (reset or power off)"
        )),
        Ok(other) => Exit::Fatal(format!("unexpected KVM exit {other:?}")),
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Exit::Interrupted,
        Err(e) => Exit::Fatal(format!("KVM_RUN failed: {e}")),
    }
}

/// A register dump for a VM that stopped badly.
pub fn describe_registers(vcpu: &VcpuFd) -> String {
    let (Ok(r), Ok(s)) = (vcpu.get_regs(), vcpu.get_sregs()) else {
        return "registers unavailable".into();
    };
    format_registers(&r, &s)
}

fn format_registers(r: &kvm_regs, s: &kvm_sregs) -> String {
    format!(
        "RIP={:016x} RSP={:016x} RFLAGS={:08x} CPL={}\n\
         RAX={:016x} RBX={:016x} RCX={:016x} RDX={:016x}\n\
         RSI={:016x} RDI={:016x} RBP={:016x} R8 ={:016x}\n\
         R9 ={:016x} R10={:016x} R11={:016x} R12={:016x}\n\
         R13={:016x} R14={:016x} R15={:016x}\n\
         CS={:04x} SS={:04x} DS={:04x} TR={:04x} CR0={:08x} CR2={:016x} CR3={:016x} CR4={:08x} EFER={:x}",
        r.rip,
        r.rsp,
        r.rflags,
        s.cs.selector & 3,
        r.rax,
        r.rbx,
        r.rcx,
        r.rdx,
        r.rsi,
        r.rdi,
        r.rbp,
        r.r8,
        r.r9,
        r.r10,
        r.r11,
        r.r12,
        r.r13,
        r.r14,
        r.r15,
        s.cs.selector,
        s.ss.selector,
        s.ds.selector,
        s.tr.selector,
        s.cr0,
        s.cr2,
        s.cr3,
        s.cr4,
        s.efer
    )
}
