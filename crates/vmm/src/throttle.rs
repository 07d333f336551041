//! Auto-converge's throttle: every vCPU sleeps a share of its time, so that a guest that
//! dirties memory faster than a migration can send it slows down.
//!
//! As QEMU does it: a vCPU that has run for a timeslice ([`TIMESLICE`], 10 ms) sleeps
//! `percent / (100 - percent)` of the time it ran, so it runs `100 - percent`% of wall time in
//! slices short enough that the guest sees a slower CPU, not pauses. A ticker thread kicks the
//! vCPUs out of `KVM_RUN` every timeslice while a throttle is set (a guest that never exits
//! would otherwise never be looked at); the sleep itself is a parked wait in the vCPU loop, so
//! a pause or stop ends it at once and a paused VM's vCPUs are still.
//!
//! Invariant: at most one ticker runs per VM, and none while the throttle is 0.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

/// How long a vCPU runs between two throttle sleeps: QEMU's CPU_THROTTLE_TIMESLICE, short
/// enough that a guest's 10 ms heartbeat sees a slower CPU rather than gaps, long enough that
/// a kick per slice (one exit, ~10 µs) costs the guest nothing measurable.
pub const TIMESLICE: Duration = Duration::from_millis(10);

/// The highest throttle: at 100% a vCPU would never run.
pub const MAX_PERCENT: u8 = 99;

/// A VM's throttle: the percent in force and whether its ticker runs.
#[derive(Debug, Default)]
pub struct Throttle {
    percent: AtomicU8,
    ticking: AtomicBool,
    /// Wall time the vCPUs spent in throttle sleeps, summed over vCPUs, in ns.
    slept_ns: AtomicU64,
}

impl Throttle {
    pub fn percent(&self) -> u8 {
        self.percent.load(Ordering::Relaxed)
    }

    /// Sets the throttle; returns true when a ticker must be started (none runs yet and the
    /// throttle is now above 0). The ticker that is started must call [`Throttle::keep_ticking`]
    /// every slice and leave when it says no.
    pub fn set(&self, percent: u8) -> bool {
        self.percent
            .store(percent.min(MAX_PERCENT), Ordering::Relaxed);
        percent > 0 && !self.ticking.swap(true, Ordering::AcqRel)
    }

    /// For the ticker: whether to go on (false also marks it gone, so that a later
    /// [`Throttle::set`] starts another).
    pub fn keep_ticking(&self, vm_alive: bool) -> bool {
        if vm_alive && self.percent() > 0 {
            return true;
        }
        self.ticking.store(false, Ordering::Release);
        // A throttle set between the look above and the store would find a ticker still
        // marked running and start none: look again, and take the ticker back if so.
        vm_alive && self.percent() > 0 && !self.ticking.swap(true, Ordering::AcqRel)
    }

    /// For a ticker that could not be started: marks it gone, so that the next
    /// [`Throttle::set`] starts one again.
    pub fn no_ticker(&self) {
        self.ticking.store(false, Ordering::Release);
    }

    /// Counts a throttle sleep a vCPU came out of (a pause that began during it included).
    pub fn add_slept(&self, slept: Duration) {
        self.slept_ns
            .fetch_add(slept.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Wall time the vCPUs spent in throttle sleeps so far, summed over vCPUs, in ns: the share
    /// a throttle takes, whatever else the host's CPUs were doing meanwhile.
    pub fn slept_ns(&self) -> u64 {
        self.slept_ns.load(Ordering::Relaxed)
    }

    /// How long a vCPU that ran `ran` since its last sleep sleeps now; zero before a
    /// timeslice has passed or with no throttle.
    pub fn sleep_after(&self, ran: Duration) -> Duration {
        sleep_after(self.percent(), ran)
    }
}

/// The sleep for `percent` after running `ran`: `ran * percent / (100 - percent)`, once
/// `ran` reached a [`TIMESLICE`].
pub fn sleep_after(percent: u8, ran: Duration) -> Duration {
    let percent = u32::from(percent.min(MAX_PERCENT));
    if percent == 0 || ran < TIMESLICE {
        return Duration::ZERO;
    }
    ran * percent / (100 - percent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vcpu_sleeps_the_throttled_share_of_each_slice() {
        let ms = Duration::from_millis;
        // (percent, ran, sleep)
        let table = [
            (0, ms(10), ms(0)),
            (20, ms(9), ms(0)),
            (20, ms(10), Duration::from_micros(2500)),
            (50, ms(10), ms(10)),
            (50, ms(12), ms(12)),
            (80, ms(10), ms(40)),
            (99, ms(10), ms(990)),
            (100, ms(10), ms(990)),
        ];
        for (percent, ran, want) in table {
            assert_eq!(sleep_after(percent, ran), want, "{percent}% after {ran:?}");
            // The share of wall time the vCPU runs is what the throttle leaves.
            if !want.is_zero() {
                let share = ran.as_secs_f64() / (ran + want).as_secs_f64();
                let left = 1.0 - f64::from(percent.min(99)) / 100.0;
                assert!((share - left).abs() < 1e-9, "{percent}%: runs {share}");
            }
        }
    }

    #[test]
    fn one_ticker_at_a_time_and_none_without_a_throttle() {
        let t = Throttle::default();
        assert!(!t.set(0), "no ticker for no throttle");
        assert!(t.set(30), "the first throttle starts the ticker");
        assert!(!t.set(50), "a second does not");
        assert!(t.keep_ticking(true));
        t.set(0);
        assert!(!t.keep_ticking(true), "the ticker leaves once lifted");
        assert!(t.set(20), "and the next throttle starts a new one");
        assert!(!t.keep_ticking(false), "a stopped VM's ticker leaves");
        assert_eq!(t.percent(), 20);
        t.set(200);
        assert_eq!(t.percent(), MAX_PERCENT);
    }
}
