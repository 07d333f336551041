//! CPL3: a vCPU's watch over its clocks (the pure part is `src/clockgap.rs`): a look at
//! kvmclock and the TSC at every turn of the workload loop (and inside a verify pass, where it
//! looks for a due heartbeat); a clock that went back is said on COM1 (the workload counts it
//! as a verify failure); the boot vCPU reports its longest gap after a heartbeat that followed
//! one (a ClockGap report), the TSC's made ns with its latest calibration against the PIT.

use ferry_guest::clockgap::Gaps;
use ferry_guest_abi::report::{Kind, Report};

use super::clock::Clock;
use super::telemetry;
use crate::sprintln;

/// Past the loop's longest wait between two looks (it sleeps at most until the next
/// heartbeat): 5 ms for the APIC timer's latency and a host that runs another thread for a
/// timeslice (4 ms at HZ=250) first. A gap longer than that is time the vCPU did not run.
const MARGIN_NS: u64 = 5_000_000;

pub struct ClockWatch(Gaps);

impl ClockWatch {
    /// The watch of a guest that sends a heartbeat every `heartbeat_ms`.
    pub fn new(heartbeat_ms: u32) -> ClockWatch {
        ClockWatch(Gaps::new(u64::from(heartbeat_ms) * 1_000_000 + MARGIN_NS))
    }

    /// A look at both clocks, read at one instant; whether a clock went back (said on COM1).
    pub fn look(&mut self, clock: &Clock) -> bool {
        let (now, tsc) = clock.now_and_tsc();
        let Some((ns0, tsc0)) = self.0.look(now, tsc) else {
            return false;
        };
        sprintln!(
            "ferry-guest: VERIFY FAILED: vCPU {}'s clocks went back: kvmclock from {ns0} to {now} ns, TSC from {tsc0} to {tsc}",
            clock.vcpu()
        );
        true
    }

    /// The boot vCPU's report of its longest gap since the last, if it saw one; `tsc_hz` is
    /// its calibrated TSC frequency (0: none).
    pub fn report(&mut self, clock: &Clock, tsc_hz: u64) {
        if clock.vcpu() != 0 {
            return;
        }
        if let Some(detail) = self.0.take(tsc_hz) {
            telemetry::send(&Report {
                kind: Kind::ClockGap as u16,
                vcpu: clock.vcpu(),
                guest_ns: clock.now_ns(),
                detail,
                ..Report::default()
            });
        }
    }
}
