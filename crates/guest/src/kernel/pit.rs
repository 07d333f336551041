//! The TSC calibrated against PIT channel 2, the way Linux's `pit_calibrate_tsc` does it: the
//! channel's gate opened and the speaker kept off through port 0x61, a one-shot count (mode 0)
//! of a known length loaded, and the TSC read when port 0x61's bit 5 (the channel's output)
//! rises, which it does when the count has elapsed. The boot vCPU does it at CPL3 (each read
//! of port 0x61 is one exit to the VMM), once at boot and then every `calibrate-ms`, and
//! reports each result (`report::clock`), with the RTC's time of day read just before
//! (`rtc.rs`). The figure is reported, not used: the clock keeps the source `clock.rs` picked.
//!
//! Under a VMM without port 0x61 (it reads all-ones) or without a PIT behind it (bit 5 never
//! rises) the calibration fails within [`GIVE_UP_NS`] and says so on the serial port; the
//! guest goes on with its clock as it was.

use ferry_guest_abi::params::Params;
use ferry_guest_abi::report::{self, Kind, Report};

use super::arch;
use super::clock::Clock;
use super::telemetry;
use crate::sprintln;

/// The PIT's input clock: 1.193182 MHz (the PC's 14.31818 MHz crystal divided by 12).
const PIT_HZ: u64 = 1_193_182;
/// The window: 50 ms, Linux's too. Long next to the ~90 µs a port read costs where every one
/// exits to the VMM (each edge is timed to a read or two: under 0.2% of the window), short
/// enough that the boot vCPU's workload does not miss it.
const WINDOW_MS: u64 = 50;
/// The count that lasts the window: 59,659 ticks, within the channel's 16 bits.
const COUNT: u16 = (PIT_HZ * WINDOW_MS / 1000) as u16;
const _: () = assert!(PIT_HZ * WINDOW_MS / 1000 <= u16::MAX as u64);
/// A window is good when its edges are known to 0.25% (125 µs). An edge's span is one or two
/// port accesses, each an exit to the VMM: measured under ferry on this nested KVM, 1,500 to
/// 1,900 ppm for the two edges together, while a vCPU preempted at an edge (a window seen 5%
/// long on a busy host) is tens of thousands. A calibration times up to [`WINDOWS`] until one
/// is good, and keeps the best.
const GOOD_PPM: u64 = 2500;
/// At most a second of windows per calibration (it was a quarter second: on this 2-core host
/// at a load average of 26, a restored guest's TSC once read 1.5% short of kvmclock at its
/// calibration, as a best of five windows each preempted at an edge can be).
const WINDOWS: u64 = 20;
/// The wait for the output gives up after five windows by the guest's clock: a PIT that is
/// there has risen by one.
const GIVE_UP_NS: u64 = 5 * WINDOW_MS * 1_000_000;

/// System control port B, and its bits.
const PORT_B: u16 = 0x61;
const GATE_2: u8 = 1 << 0;
const SPEAKER: u8 = 1 << 1;
const OUT_2: u8 = 1 << 5;
/// Channel 2's data port and the PIT's mode port.
const CHANNEL_2: u16 = 0x42;
const MODE: u16 = 0x43;
/// Channel 2 (bits 7-6 = 10), low byte then high byte (5-4 = 11), mode 0 (3-1 = 000,
/// interrupt on terminal count), binary (0 = 0).
const CHANNEL_2_ONE_SHOT: u8 = 0b1011_0000;

/// The boot vCPU's calibrations: when the next is due, and how many were made.
pub struct Calibrator {
    every_ns: u64,
    next_ns: u64,
    calibrations: u64,
    /// The last calibration's uncertainty (ppm) and windows timed.
    last: (u64, u64),
    /// The RTC's time (s since 1970) and register B, as the last calibration read them.
    rtc: Option<(u64, u8)>,
    /// The latest good calibration's frequency (Hz); 0 before one.
    hz: u64,
}

impl Calibrator {
    /// The boot calibration, reported and said on the serial port.
    pub fn boot(p: &Params, clock: &Clock) -> Calibrator {
        let mut c = Calibrator {
            every_ns: u64::from(p.calibrate_ms) * 1_000_000,
            next_ns: 0,
            calibrations: 0,
            last: (0, 0),
            rtc: None,
            hz: 0,
        };
        if p.rtc_set != 0 {
            super::rtc::set(p.rtc_set);
        }
        let hz = c.calibrate(clock);
        match hz {
            0 => sprintln!(
                "ferry-guest: no PIT answers on port 0x61 (channel 2's output did not rise as a count elapsed); the clock stays on {:?}",
                clock.source()
            ),
            hz => sprintln!(
                "ferry-guest: TSC calibrated against the PIT: {hz} Hz (within {} ppm, {} window(s) of 50 ms; clock {:?})",
                c.last.0,
                c.last.1,
                clock.source()
            ),
        }
        match c.rtc {
            None => sprintln!(
                "ferry-guest: no RTC answers on ports 0x70-0x71 (its update-in-progress bit never cleared)"
            ),
            Some((seconds, b)) => {
                sprintln!("ferry-guest: the RTC reads {seconds} s since 1970 (register B {b:#04x})")
            }
        }
        c
    }

    /// The TSC's frequency the latest good calibration measured (Hz); 0 before one.
    pub fn hz(&self) -> u64 {
        self.hz
    }

    /// Calibrates again if `calibrate-ms` says it is time.
    pub fn look(&mut self, clock: &Clock, now: u64) {
        if self.every_ns != 0 && now >= self.next_ns {
            self.calibrate(clock);
        }
    }

    /// One calibration, reported; its frequency (0: failed). Windows are timed until one's
    /// edges are known to [`GOOD_PPM`], at most [`WINDOWS`] of them; the best is reported.
    fn calibrate(&mut self, clock: &Clock) -> u64 {
        let mut best = measure(clock);
        let mut windows = 1;
        while best.outcome == report::clock::OUTCOME_OK
            && best.ppm() > GOOD_PPM
            && windows < WINDOWS
        {
            let w = measure(clock);
            windows += 1;
            if w.outcome == report::clock::OUTCOME_OK && w.ppm() < best.ppm() {
                best = w;
            }
        }
        let hz = match best.outcome {
            report::clock::OUTCOME_OK => best.ticks * PIT_HZ / u64::from(COUNT),
            _ => 0,
        };
        self.calibrations += 1;
        let mut detail = [0; report::DETAIL_WORDS];
        detail[report::clock::TSC_CALIBRATED_HZ] = hz;
        detail[report::clock::PIT_TICKS] = u64::from(COUNT);
        detail[report::clock::TSC_TICKS] = best.ticks;
        detail[report::clock::OUTCOME] = best.outcome;
        detail[report::clock::CALIBRATIONS] = self.calibrations;
        detail[report::clock::UNCERTAINTY_PPM] = best.ppm();
        detail[report::clock::WINDOWS] = windows;
        self.rtc = super::rtc::read();
        if let Some((seconds, b)) = self.rtc {
            detail[report::clock::RTC_UNIX_SECONDS] = seconds;
            detail[report::clock::RTC_REGISTER_B] = u64::from(b);
        }
        let now = clock.now_ns();
        telemetry::send(&Report {
            kind: Kind::Clock as u16,
            vcpu: clock.vcpu(),
            guest_ns: now,
            detail,
            ..Report::default()
        });
        self.next_ns = now + self.every_ns;
        self.last = (best.ppm(), windows);
        if hz != 0 {
            self.hz = hz;
        }
        hz
    }
}

/// One window as the TSC saw it.
struct Window {
    outcome: u64,
    /// TSC ticks from the middle of the start's span to the middle of the end's.
    ticks: u64,
    /// Half the two spans together: how far `ticks` may be off.
    uncertainty: u64,
}

impl Window {
    /// The uncertainty in parts per million of the window.
    fn ppm(&self) -> u64 {
        (self.uncertainty * 1_000_000)
            .checked_div(self.ticks)
            .unwrap_or(u64::MAX)
    }
}

/// One window. Each edge is known to a span of TSC readings: the count starts during the
/// `out` of its high byte, read between two TSC readings; the output rose after the last read
/// that saw it low began and before the first that saw it high ended. A span is a port
/// access (one exit to the VMM) unless the vCPU was preempted across it, which is what the
/// spans catch (on a busy host a late look at the output made a window 5% long). Port 0x61's
/// gate and speaker bits are left as they were found.
fn measure(clock: &Clock) -> Window {
    let found = arch::inb(PORT_B);
    arch::outb(PORT_B, (found & !SPEAKER) | GATE_2);
    arch::outb(MODE, CHANNEL_2_ONE_SHOT);
    arch::outb(CHANNEL_2, COUNT as u8);
    let before = arch::rdtsc();
    arch::outb(CHANNEL_2, (COUNT >> 8) as u8);
    let after = arch::rdtsc();
    let w = match arch::inb(PORT_B) & OUT_2 {
        0 => wait_for_output(clock, (before, after)),
        _ => Window {
            outcome: report::clock::OUTCOME_HIGH_AT_LOAD,
            ticks: 0,
            uncertainty: 0,
        },
    };
    arch::outb(PORT_B, found & (GATE_2 | SPEAKER));
    w
}

/// Spins on port 0x61 until channel 2's output rises, or [`GIVE_UP_NS`] has passed.
fn wait_for_output(clock: &Clock, (before, after): (u64, u64)) -> Window {
    let began = clock.now_ns();
    let mut low_since = after;
    loop {
        let t0 = arch::rdtsc();
        let out = arch::inb(PORT_B) & OUT_2;
        let t1 = arch::rdtsc();
        if out != 0 {
            let (start, end) = ((before + after) / 2, (low_since + t1) / 2);
            return Window {
                outcome: report::clock::OUTCOME_OK,
                ticks: end - start,
                uncertainty: ((after - before) + (t1 - low_since)) / 2,
            };
        }
        low_since = t0;
        if clock.now_ns() - began > GIVE_UP_NS {
            return Window {
                outcome: report::clock::OUTCOME_NEVER_ROSE,
                ticks: t1 - after,
                uncertainty: 0,
            };
        }
    }
}
