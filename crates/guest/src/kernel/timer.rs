//! Sleeping until a deadline: the local APIC timer in TSC-deadline mode.
//!
//! Set up at CPL3 through the xAPIC's registers (its page at the default base 0xfee00000 is in
//! the identity map, user-accessible like all of it): software-enable the APIC, point the timer
//! LVT at [`VECTOR`] in TSC-deadline mode, and mask the legacy PICs (nothing of theirs is
//! wanted). Sleeping is a `wrmsr` of IA32_TSC_DEADLINE, privileged at CPL3: the entry code's
//! #GP handler performs it and halts with interrupts on until the timer fires, then returns.
//! The deadline MSR and the APIC are vCPU state the VMM migrates, so a guest asleep across a
//! migration wakes on time on the destination.
//!
//! Without TSC-deadline support (CPUID.1:ECX[24], which a VMM offers with an in-kernel APIC)
//! the guest has no timer and keeps polling its clock, as it always did.

use super::arch;
use super::clock::Clock;

/// The timer's interrupt vector: the first above the 32 exception vectors, 0x20-0x2f left
/// for the legacy PICs' usual remapping.
pub const VECTOR: u32 = 0x40;

/// xAPIC registers at the default base.
const APIC_BASE: usize = 0xfee0_0000;
const SPURIOUS: usize = 0xf0;
const LVT_TIMER: usize = 0x320;
/// SVR: APIC software enable (bit 8), spurious vector 0xff.
const SVR_ENABLE: u32 = 0x100 | 0xff;
/// LVT timer mode bits 18:17 = 10b: TSC-deadline.
const TSC_DEADLINE_MODE: u32 = 2 << 17;
const IA32_TSC_DEADLINE: u32 = 0x6e0;
/// Legacy PIC data ports (interrupt masks).
const PIC_MASTER_DATA: u16 = 0x21;
const PIC_SLAVE_DATA: u16 = 0xa1;

/// Shortest sleep worth taking: the gate runs at CPL0, which some hypervisors emulate
/// instruction by instruction (about a thousand times slower), so a wait shorter than the
/// round trip is spent better polling the clock.
pub const MIN_SLEEP_NS: u64 = 200_000;

/// The timer, if this machine has one.
#[derive(Clone, Copy, Debug)]
pub struct Timer(());

impl Timer {
    /// Sets the timer up; `None` when the CPU offers no TSC-deadline APIC timer.
    pub fn start() -> Option<Timer> {
        let (_, _, ecx, edx) = arch::cpuid(1);
        let apic = edx & (1 << 9) != 0;
        let tsc_deadline = ecx & (1 << 24) != 0;
        if !(apic && tsc_deadline) {
            return None;
        }
        arch::outb(PIC_MASTER_DATA, 0xff);
        arch::outb(PIC_SLAVE_DATA, 0xff);
        write_apic(SPURIOUS, SVR_ENABLE);
        write_apic(LVT_TIMER, VECTOR | TSC_DEADLINE_MODE);
        Some(Timer(()))
    }

    /// Sleeps until `clock` reads `deadline_ns` (or a little after), or returns at once when
    /// that is too soon to be worth it. May return early; callers look at the clock again.
    pub fn sleep_until(&self, clock: &Clock, deadline_ns: u64) {
        let now = clock.now_ns();
        if deadline_ns <= now + MIN_SLEEP_NS {
            return;
        }
        let deadline_tsc = arch::rdtsc().wrapping_add(clock.tsc_ticks(deadline_ns - now));
        arch::wrmsr_sleep(IA32_TSC_DEADLINE, deadline_tsc);
    }
}

fn write_apic(register: usize, value: u32) {
    // SAFETY: the xAPIC register page is identity-mapped and user-accessible (entry.rs maps
    // all of the low 4 GiB so), this CPU has an APIC (checked by the caller), and the
    // registers written are the enable bit and the timer's LVT, which only this module uses.
    unsafe { ((APIC_BASE + register) as *mut u32).write_volatile(value) }
}
