//! The guest's clock: kvmclock when the hypervisor offers it (KVM does, under ferry and under
//! QEMU alike), else the TSC at a frequency CPUID states, else the TSC at a guessed frequency
//! (the guest says so on its serial port, because every rate it then reports is approximate).

use core::ptr::addr_of;

use super::arch;

/// The frequency assumed when nothing states one: a typical server core.
const GUESSED_TSC_HZ: u64 = 2_000_000_000;

/// `pvclock_vcpu_time_info`, written by the hypervisor.
#[repr(C)]
struct PvClock {
    version: u32,
    pad0: u32,
    tsc_timestamp: u64,
    system_time: u64,
    tsc_to_system_mul: u32,
    tsc_shift: i8,
    flags: u8,
    pad: [u8; 2],
}
const _: () = assert!(size_of::<PvClock>() == 32);

/// One vCPU's kvmclock page: a `PvClock` in a 64-byte slot.
#[repr(C, align(64))]
struct PvClockSlot(PvClock);

unsafe extern "C" {
    /// Slot n registered with MSR_KVM_SYSTEM_TIME_NEW by vCPU n (`entry.rs`) when KVM offers
    /// kvmclock.
    static pvclock: [PvClockSlot; ferry_guest_abi::smp::MAX_VCPUS];
    /// 1 if `entry.rs` registered `pvclock`.
    static kvmclock_enabled: u32;
}

/// Which source the clock uses; also the value of the Boot report's clock word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Source {
    KvmClock = 1,
    TscFromCpuid = 2,
    TscGuessed = 3,
}

#[derive(Clone, Copy, Debug)]
pub struct ClockInfo {
    pub source: Source,
    pub tsc_hz: u64,
}

/// Picks the source: kvmclock if the entry code registered it, else the TSC.
pub fn start() -> ClockInfo {
    // SAFETY: written once at CPL0 before any Rust ran; a plain read of an integer.
    if unsafe { (&raw const kvmclock_enabled).read_volatile() } == 1 {
        return ClockInfo {
            source: Source::KvmClock,
            tsc_hz: 0,
        };
    }
    let max_leaf = arch::cpuid(0x4000_0000).0;
    let from_cpuid = if max_leaf >= 0x4000_0010 && arch::cpuid(0x4000_0010).0 != 0 {
        u64::from(arch::cpuid(0x4000_0010).0) * 1000
    } else {
        let (a, b, c, _) = arch::cpuid(0x15);
        if a != 0 && b != 0 && c != 0 {
            u64::from(c) * u64::from(b) / u64::from(a)
        } else {
            u64::from(arch::cpuid(0x16).0 & 0xffff) * 1_000_000
        }
    };
    match from_cpuid {
        0 => ClockInfo {
            source: Source::TscGuessed,
            tsc_hz: GUESSED_TSC_HZ,
        },
        hz => ClockInfo {
            source: Source::TscFromCpuid,
            tsc_hz: hz,
        },
    }
}

/// Nanoseconds since the boot vCPU created its clock, read on one vCPU (each reads its own
/// kvmclock page; KVM keeps them on one timeline).
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    info: ClockInfo,
    origin: u64,
    vcpu: usize,
}

impl Clock {
    /// The boot vCPU's clock, reading 0 now.
    pub fn new(info: ClockInfo) -> Clock {
        let mut c = Clock {
            info,
            origin: 0,
            vcpu: 0,
        };
        c.origin = c.raw_ns();
        c
    }

    /// The same clock read on vCPU `vcpu`.
    pub fn on_vcpu(&self, vcpu: usize) -> Clock {
        Clock {
            vcpu: vcpu.min(ferry_guest_abi::smp::MAX_VCPUS - 1),
            ..*self
        }
    }

    /// The vCPU this clock is read on.
    pub fn vcpu(&self) -> u8 {
        self.vcpu as u8
    }

    pub fn source(&self) -> Source {
        self.info.source
    }

    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.raw_ns().saturating_sub(self.origin)
    }

    /// [`Clock::now_ns`] and the TSC read at the same instant.
    #[inline]
    pub fn now_and_tsc(&self) -> (u64, u64) {
        let (ns, tsc) = self.raw_and_tsc();
        (ns.saturating_sub(self.origin), tsc)
    }

    /// TSC ticks in `ns` nanoseconds (for a deadline a short while ahead): from kvmclock's
    /// scale when it is the source (ns = ticks × mul / 2^32, shifted), else from the TSC rate.
    pub fn tsc_ticks(&self, ns: u64) -> u64 {
        if self.info.source != Source::KvmClock {
            return (u128::from(ns) * u128::from(self.info.tsc_hz) / 1_000_000_000) as u64;
        }
        let p = self.pvclock();
        // SAFETY: as in `raw_ns`; a torn read of the scale only misplaces one deadline, and the
        // caller looks at the clock again after waking.
        let (mul, shift) = unsafe {
            (
                addr_of!((*p).tsc_to_system_mul).read_volatile(),
                addr_of!((*p).tsc_shift).read_volatile(),
            )
        };
        let scaled = (u128::from(ns) << 32) / u128::from(mul.max(1));
        (if shift < 0 {
            scaled << -shift
        } else {
            scaled >> shift
        }) as u64
    }

    /// This vCPU's kvmclock page.
    #[inline]
    fn pvclock(&self) -> *const PvClock {
        // SAFETY: only the address is taken; `vcpu` is in range (see `on_vcpu`).
        unsafe { (&raw const pvclock[self.vcpu].0) }
    }

    #[inline]
    fn raw_ns(&self) -> u64 {
        self.raw_and_tsc().0
    }

    /// The clock (ns, before `origin` is taken off) and the TSC reading it was made from: one
    /// instant, however long the vCPU is put aside around the read (a move's pause that fell
    /// between a clock read and a separate TSC read would show as a gap on one clock only).
    #[inline]
    fn raw_and_tsc(&self) -> (u64, u64) {
        if self.info.source != Source::KvmClock {
            let tsc = arch::rdtsc();
            let ns = u128::from(tsc) * 1_000_000_000 / u128::from(self.info.tsc_hz);
            return (ns as u64, tsc);
        }
        let p = self.pvclock();
        loop {
            // SAFETY: `pvclock` is memory the hypervisor updates; the version protocol (odd =
            // update in progress, changed = torn read) makes the volatile reads consistent.
            let (v0, ts, sys, mul, shift, tsc, v1) = unsafe {
                let v0 = addr_of!((*p).version).read_volatile();
                let ts = addr_of!((*p).tsc_timestamp).read_volatile();
                let sys = addr_of!((*p).system_time).read_volatile();
                let mul = addr_of!((*p).tsc_to_system_mul).read_volatile();
                let shift = addr_of!((*p).tsc_shift).read_volatile();
                let tsc = arch::rdtsc();
                let v1 = addr_of!((*p).version).read_volatile();
                (v0, ts, sys, mul, shift, tsc, v1)
            };
            if v0 & 1 == 0 && v0 == v1 {
                let elapsed = tsc.wrapping_sub(ts);
                let delta = if shift < 0 {
                    elapsed >> -shift
                } else {
                    elapsed << shift
                };
                let ns = sys.wrapping_add(((u128::from(delta) * u128::from(mul)) >> 32) as u64);
                return (ns, tsc);
            }
            core::hint::spin_loop();
        }
    }
}
