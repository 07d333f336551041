//! The MC146818 as a pure value: 128 bytes of CMOS, the index register, the guest's time as an
//! offset from the host's wall clock, and the interrupt flags; every call takes the host's
//! wall clock (`now`, ns since the Unix epoch) as an argument, so the model is tested without
//! a clock or a thread.
//!
//! Time. The guest's time is `now + offset` (ns): it follows the host's wall clock, a step of
//! it (NTP setting the host's clock) included. While register B's SET bit is clear the time
//! registers read that time in B's format; setting SET freezes them (the clock's value copied
//! into CMOS, the update cycle stopped) for the guest to write; clearing SET makes the written
//! time the clock's, from that instant: `offset` becomes the written time minus `now`. A time
//! register written with SET clear changes that field at once, the clock running on from it.
//!
//! Divider. The periodic interrupt and the second's update count the same 32.768 kHz divider,
//! which runs on the guest's time: a periodic flag is set each time the guest's time crosses a
//! multiple of the period (register A's rate: 2^(RS-1) ticks of 32.768 kHz, RS 1 and 2 being
//! 128 and 256 ticks, RS 0 none), and the update-ended flag each time it crosses a second
//! (not while SET is set; the divider, and so the periodic flag, runs on under SET). So
//! the phase of both follows from the time and needs no state of its own. Register A's divider
//! bits (DV) are kept and read back, but do not stop or reset the divider.
//!
//! Flags and the line. Register C's PF, AF and UF are set as their events pass (whether or not
//! enabled), found when the model is brought up to date ([`Rtc::update`]): by the timer when an
//! enabled event is due, and before any access to registers A, B or C. IRQF is set when a flag
//! and its enable (PIE, AIE, UIE in B, at the same bits) are both set; then the IRQ line goes
//! high, which the caller turns into one edge on IRQ 8. Reading C returns the flags, clears
//! them and lowers the line; no new edge comes until it is read, as on a PC, where IRQ 8 is
//! edge-triggered. The alarm matches seconds, minutes and hours in B's format, a value with
//! its two top bits set matching any.
//!
//! UIP. Register A's update-in-progress bit reads 1 in the last 244 µs of each second of the
//! guest's time (the datasheet's warning time before the update), 0 while SET is set.

#![forbid(unsafe_code)]

use ferry_guest_abi::rtc::{self as calendar, TIME_REGISTERS, Time};
pub use ferry_guest_abi::rtc::{
    AF, AIE, IRQF, NMI_MASK, PF, PIE, REG_A, REG_B, REG_C, REG_D, SET, UF, UIE, UIP, VRT,
};

pub const CMOS_BYTES: usize = 128;
const SECONDS_ALARM: usize = 0x01;
const MINUTES_ALARM: usize = 0x03;
const HOURS_ALARM: usize = 0x05;
/// Register A's rate select bits.
const RATE: u8 = 0x0f;
const FLAGS: u8 = PF | AF | UF;

/// Register A at power on as a PC BIOS leaves it: the 32.768 kHz divider (DV = 010) and a
/// 1024 Hz periodic rate (RS = 6). Register B: 24-hour, BCD, no interrupt.
pub const A_AT_BOOT: u8 = 0x26;
pub const B_AT_BOOT: u8 = calendar::HOURS_24;

const NS: i128 = 1_000_000_000;
const DIVIDER_HZ: i128 = 32_768;
/// The warning the datasheet gives before an update: UIP is high for 244 µs before it.
const UIP_NS: i128 = 244_000;
/// The most seconds an alarm check looks back over: a day holds every hour, minute and
/// second an alarm can name.
const ALARM_LOOKBACK_S: i128 = 86_400;

/// The RTC's state; see the module doc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rtc {
    pub cmos: [u8; CMOS_BYTES],
    /// The index port's last write: the register selected (bits 6-0) and the NMI mask (7).
    pub index: u8,
    /// The guest's time minus the host's wall clock, ns.
    pub offset_ns: i128,
    /// The guest's time the flags were last brought up to, ns since the Unix epoch.
    pub seen_ns: i128,
    /// The IRQ line: high from an enabled flag until register C is read.
    pub line: bool,
}

/// The ticks of the 32.768 kHz divider in one periodic interrupt's period, for register A's
/// rate select; `None` for 0 (no periodic interrupt).
pub fn period_ticks(rate: u8) -> Option<i128> {
    match rate & RATE {
        0 => None,
        1 => Some(128),
        2 => Some(256),
        rs => Some(1 << (rs - 1)),
    }
}

impl Rtc {
    /// A powered-on RTC whose other CMOS bytes are `cmos`'s (`super::cmos`), at the host's time.
    pub fn new(mut cmos: [u8; CMOS_BYTES], now: i128) -> Rtc {
        cmos[REG_A] = A_AT_BOOT;
        cmos[REG_B] = B_AT_BOOT;
        cmos[REG_C] = 0;
        cmos[REG_D] = VRT;
        Rtc {
            cmos,
            index: 0,
            offset_ns: 0,
            seen_ns: now,
            line: false,
        }
    }

    /// The guest's time at `now`, ns since the Unix epoch.
    pub fn time_ns(&self, now: i128) -> i128 {
        now + self.offset_ns
    }

    fn frozen(&self) -> bool {
        self.cmos[REG_B] & SET != 0
    }

    /// A write to the index port.
    pub fn select(&mut self, value: u8) {
        self.index = value;
    }

    /// The register the index port selected.
    fn selected(&self) -> usize {
        usize::from(self.index & !NMI_MASK)
    }

    /// The time registers as the clock shows them at `now`: frozen in CMOS while SET is set.
    fn time_registers(&self, now: i128) -> [u8; 8] {
        match self.frozen() {
            true => TIME_REGISTERS.map(|r| self.cmos[r]),
            false => {
                let seconds = self.time_ns(now).div_euclid(NS) as i64;
                Time::from_unix(seconds).registers(self.cmos[REG_B])
            }
        }
    }

    /// A read of the data port at `now`; and whether the line went high (an edge to raise).
    pub fn read(&mut self, now: i128) -> (u8, bool) {
        let r = self.selected();
        if let Some(i) = TIME_REGISTERS.iter().position(|&t| t == r) {
            return (self.time_registers(now)[i], false);
        }
        match r {
            REG_A => {
                let edge = self.update(now);
                let in_second = self.time_ns(now).rem_euclid(NS);
                let uip = !self.frozen() && in_second >= NS - UIP_NS;
                (self.cmos[REG_A] | if uip { UIP } else { 0 }, edge)
            }
            REG_B => (self.cmos[REG_B], self.update(now)),
            REG_C => {
                self.update(now);
                let flags = std::mem::take(&mut self.cmos[REG_C]);
                self.line = false;
                (flags, false)
            }
            REG_D => (VRT, false),
            _ => (self.cmos[r], false),
        }
    }

    /// A write of the data port at `now`; and whether the line went high.
    pub fn write(&mut self, value: u8, now: i128) -> bool {
        let r = self.selected();
        if let Some(i) = TIME_REGISTERS.iter().position(|&t| t == r) {
            if self.frozen() {
                self.cmos[r] = value;
            } else {
                let mut regs = self.time_registers(now);
                regs[i] = value;
                let within = self.time_ns(now).rem_euclid(NS);
                self.set_time(&regs, within, now);
            }
            return false;
        }
        match r {
            REG_A => {
                let edge = self.update(now);
                self.cmos[REG_A] = value & !UIP;
                edge
            }
            REG_B => {
                let edge = self.update(now);
                self.write_b(value, now);
                edge | self.raise_if_due()
            }
            REG_C | REG_D => false,
            _ => {
                self.cmos[r] = value;
                false
            }
        }
    }

    /// Register B: SET rising freezes the time registers (in the new format), SET falling
    /// starts the clock from them; SET clears UIE, as the datasheet says.
    fn write_b(&mut self, value: u8, now: i128) {
        let was = self.cmos[REG_B];
        let value = if value & SET != 0 {
            value & !UIE
        } else {
            value
        };
        if value & SET != 0 && was & SET == 0 {
            let seconds = self.time_ns(now).div_euclid(NS) as i64;
            let regs = Time::from_unix(seconds).registers(value);
            for (r, v) in TIME_REGISTERS.into_iter().zip(regs) {
                self.cmos[r] = v;
            }
        }
        self.cmos[REG_B] = value;
        if value & SET == 0 && was & SET != 0 {
            let regs = TIME_REGISTERS.map(|r| self.cmos[r]);
            self.set_time(&regs, 0, now);
        }
    }

    /// Makes `regs` (in B's format) the clock's time from `now` on, `within` ns into its
    /// second: a clock that was running keeps its place within the second, one started from
    /// SET starts the second at `now`.
    fn set_time(&mut self, regs: &[u8; 8], within: i128, now: i128) {
        let seconds = i128::from(Time::from_registers(regs, self.cmos[REG_B]).to_unix());
        self.offset_ns = seconds * NS + within - now;
        self.seen_ns = self.time_ns(now);
    }

    /// Brings the flags up to `now`: PF for each period crossed, UF and AF for each second
    /// (not while SET is set); then IRQF and the line. Whether the line went high.
    pub fn update(&mut self, now: i128) -> bool {
        let (from, to) = (self.seen_ns, self.time_ns(now));
        if to <= from {
            self.seen_ns = to;
            return self.raise_if_due();
        }
        if let Some(p) = period_ticks(self.cmos[REG_A]) {
            let periods = |t: i128| (t * DIVIDER_HZ).div_euclid(NS).div_euclid(p);
            if periods(to) > periods(from) {
                self.cmos[REG_C] |= PF;
            }
        }
        let (s0, s1) = (from.div_euclid(NS), to.div_euclid(NS));
        if !self.frozen() && s1 > s0 {
            self.cmos[REG_C] |= UF;
            let first = (s0 + 1).max(s1 - ALARM_LOOKBACK_S + 1);
            if (first..=s1).any(|s| self.alarm_at(s as i64)) {
                self.cmos[REG_C] |= AF;
            }
        }
        self.seen_ns = to;
        self.raise_if_due()
    }

    /// Whether the alarm registers match the guest's second `s` (a value with bits 7-6 set
    /// matches any).
    fn alarm_at(&self, s: i64) -> bool {
        let regs = Time::from_unix(s).registers(self.cmos[REG_B]);
        [(SECONDS_ALARM, 0), (MINUTES_ALARM, 1), (HOURS_ALARM, 2)]
            .iter()
            .all(|&(alarm, i)| self.cmos[alarm] & 0xc0 == 0xc0 || self.cmos[alarm] == regs[i])
    }

    /// Sets IRQF when a flag is enabled; the line goes high (true) if it was low.
    fn raise_if_due(&mut self) -> bool {
        if self.cmos[REG_C] & self.cmos[REG_B] & FLAGS == 0 {
            return false;
        }
        self.cmos[REG_C] |= IRQF;
        !std::mem::replace(&mut self.line, true)
    }

    /// When (the host's wall clock, ns) the model next needs [`Rtc::update`] to raise its
    /// line: the first enabled event after the time the flags were brought up to (so a time
    /// before `now` when one has passed since); `None` while the line is high (no edge until
    /// C is read) or no interrupt is enabled; `now` when an enabled flag is already set.
    pub fn next_event(&self, now: i128) -> Option<i128> {
        let enabled = self.cmos[REG_B] & FLAGS;
        if self.line || enabled == 0 {
            return None;
        }
        if self.cmos[REG_C] & enabled != 0 {
            return Some(now);
        }
        let t = self.seen_ns;
        let periodic = match (enabled & PIE, period_ticks(self.cmos[REG_A])) {
            (0, _) | (_, None) => None,
            (_, Some(p)) => {
                let next = ((t * DIVIDER_HZ).div_euclid(NS).div_euclid(p) + 1) * p;
                // The first ns at which the divider has counted `next` ticks.
                Some((next * NS + DIVIDER_HZ - 1).div_euclid(DIVIDER_HZ))
            }
        };
        let second = match enabled & (AIE | UIE) != 0 && !self.frozen() {
            true => Some((t.div_euclid(NS) + 1) * NS),
            false => None,
        };
        [periodic, second]
            .into_iter()
            .flatten()
            .min()
            .map(|at| at - self.offset_ns)
    }
}
