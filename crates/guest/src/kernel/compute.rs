//! A computing vCPU (`compute=`): arithmetic in registers, counted in work units and reported
//! in its heartbeats (`Kind::Work` reports), so that a benchmark sees what a vCPU that writes no memory loses while
//! its guest migrates (a throttle that sleeps every vCPU costs it; a per-vCPU dirty limit
//! should not). It touches no memory but its stack and its report buffer.

use ferry_guest_abi::params::Params;
use ferry_guest_abi::report::{self, Kind, Report};
use ferry_guest_abi::stamp::mix;

use super::clock::Clock;
use super::telemetry;

/// Rounds of [`mix`] in a work unit: about 10 µs on a 3 GHz core, so that the clock is read
/// a hundred thousand times a second at most (~0.5% of the work).
const UNIT_ROUNDS: u32 = 2000;

const MS: u64 = 1_000_000;

/// Computes forever, a heartbeat every `heartbeat-ms`.
pub fn run(p: &Params, clock: Clock) -> ! {
    let mut x = p.seed | 1;
    let mut units = 0u64;
    let mut next_heartbeat = 0;
    loop {
        for _ in 0..UNIT_ROUNDS {
            x = mix(core::hint::black_box(x));
        }
        units += 1;
        let now = clock.now_ns();
        if now >= next_heartbeat {
            let mut detail = [0u64; report::DETAIL_WORDS];
            detail[report::work::UNITS] = units;
            telemetry::send(&Report {
                kind: Kind::Work as u16,
                vcpu: clock.vcpu(),
                guest_ns: now,
                detail,
                ..Report::default()
            });
            next_heartbeat = now + u64::from(p.heartbeat_ms) * MS;
        }
    }
}
