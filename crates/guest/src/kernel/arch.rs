//! The x86 instructions the CPL3 Rust code uses, each behind a safe function that states why
//! it is sound in this kernel. This is the only module with inline assembly besides `entry`
//! and `libc`.

use core::arch::asm;

/// Writes a byte to an I/O port.
pub fn outb(port: u16, value: u8) {
    // SAFETY: the workload runs with IOPL=3 and the kernel at CPL0, so `out` never faults;
    // the only ports written are the UART, the telemetry port, the PIT's (0x42, 0x43, 0x61:
    // `pit.rs`) and the RTC's index port (0x70: `rtc.rs`), whose side effects are the point of writing them, and which touch no memory
    // this program relies on.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags))
    }
}

/// Writes a 32-bit value to an I/O port.
pub fn outl(port: u16, value: u32) {
    // SAFETY: as for `outb`; the telemetry port reads the report this program just wrote
    // (the compiler must not sink that write past the `out`, hence no `nomem`).
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") value, options(nostack, preserves_flags))
    }
}

/// Reads a byte from an I/O port.
pub fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: as for `outb`, `in` never faults; the ports read are 0x61 (`pit.rs`), whose
    // reads change nothing but its refresh toggle, and the RTC's data port 0x71 (`rtc.rs`),
    // whose reads change nothing but register C's flags, which this program does not use.
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") value, options(nomem, nostack, preserves_flags))
    }
    value
}

/// Reads a 32-bit value from an I/O port (`in eax, dx`, one of the forms the #GP handler of
/// `entry.rs` performs for a host that faults CPL3 port I/O).
pub fn inl(port: u16) -> u32 {
    let value: u32;
    // SAFETY: as for `outb`, `in` never faults; the only ports read are the VM generation ID's,
    // whose reads have no side effect (unassigned ports, under another VMM, read all-ones).
    unsafe {
        asm!("in eax, dx", in("dx") port, out("eax") value, options(nomem, nostack, preserves_flags))
    }
    value
}

/// The time-stamp counter.
#[inline(always)]
pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC only reads the counter; CR4.TSD is clear, so it is allowed at CPL3.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// CPUID leaf `leaf`, subleaf 0, as (eax, ebx, ecx, edx).
pub fn cpuid(leaf: u32) -> (u32, u32, u32, u32) {
    let r = core::arch::x86_64::__cpuid_count(leaf, 0);
    (r.eax, r.ebx, r.ecx, r.edx)
}

/// This vCPU's index, from the word its GS base points at (set at CPL0 by `entry.rs`). For
/// code that was not handed the index: reports of exceptions and panics.
pub fn vcpu_index() -> u8 {
    let index: u64;
    // SAFETY: `entry.rs` points every vCPU's GS base at a word of the image holding its index
    // before it drops to CPL3, and nothing changes GS afterwards; the load only reads it.
    unsafe { asm!("mov {}, gs:[0]", out(reg) index, options(nostack, readonly, preserves_flags)) };
    index as u8
}

/// `wrmsr` of `msr` = `value` at CPL3, which the entry code's #GP handler performs for
/// IA32_TSC_DEADLINE only, halting until an interrupt: the guest's way to sleep (see
/// `timer.rs`). Returns after the wake-up.
pub fn wrmsr_sleep(msr: u32, value: u64) {
    // SAFETY: at CPL3 `wrmsr` raises #GP; the handler arms the deadline, halts with interrupts
    // on, and resumes after the two-byte instruction with every register as it was.
    unsafe {
        asm!(
            "wrmsr",
            in("ecx") msr,
            in("eax") value as u32,
            in("edx") (value >> 32) as u32,
            options(nostack, nomem, preserves_flags)
        )
    }
}

/// Halts the machine for good. HLT is privileged, so at CPL3 it raises #GP, which the entry
/// code's #GP handler turns into a real halt at CPL0 (see `entry.rs`).
pub fn halt() -> ! {
    // SAFETY: HLT at CPL3 faults into the #GP handler, which halts and never returns here.
    unsafe { asm!("hlt", options(noreturn, nomem, nostack)) }
}

/// Raises #UD (the `fault-after-ms` test hook).
pub fn undefined_instruction() -> ! {
    // SAFETY: UD2 faults into the exception handler, which reports and halts.
    unsafe { asm!("ud2", options(noreturn)) }
}
