//! The RTC's state section (`section_ids::RTC`, instance 0), layout version 1, little-endian:
//!
//! | offset | bytes | what |
//! | --- | --- | --- |
//! | 0 | 128 | CMOS, registers A-C as stored (A without UIP, which is computed) |
//! | 128 | 1 | the index port: register selected (bits 6-0), NMI mask (bit 7) |
//! | 129 | 1 | bit 0: the IRQ line is high; other bits 0 |
//! | 130 | 2 | reserved, 0 |
//! | 132 | 16 | the guest's time minus the host's wall clock, ns (signed) |
//! | 148 | 16 | the guest's time the flags were last brought up to, ns since 1970 (signed) |
//!
//! Both times are on the wall clock, which hosts share (NTP), not the host's monotonic clock,
//! so a destination shows the guest the time of day the source did, plus the time the move
//! took; and nothing in the section is a reading of the host's clock at the save, so a state
//! saved, loaded and saved again is the same bytes (the flags are brought up to date only by
//! the guest's accesses and by the timer of an enabled interrupt).

#![forbid(unsafe_code)]

use super::model::{CMOS_BYTES, IRQF, REG_A, REG_C, Rtc, UIP};

/// Size of a version 1 section.
pub const STATE_BYTES: usize = CMOS_BYTES + 4 + 16 + 16;
const LINE: u8 = 1 << 0;
/// The farthest a time may be from 1970 (or the offset from zero): 10,000 years, in ns; a
/// guest's RTC spans years 0-9999 at most (a century register of 99), and the bound keeps all
/// arithmetic on it far from overflow.
const TIME_BOUND_NS: i128 = 10_000 * 366 * 86_400 * 1_000_000_000;

pub fn encode(rtc: &Rtc) -> Vec<u8> {
    let mut out = Vec::with_capacity(STATE_BYTES);
    out.extend_from_slice(&rtc.cmos);
    out.push(rtc.index);
    out.push(if rtc.line { LINE } else { 0 });
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&rtc.offset_ns.to_le_bytes());
    out.extend_from_slice(&rtc.seen_ns.to_le_bytes());
    out
}

/// A version 1 section as the RTC it describes; the reason when it is not one this VMM wrote.
pub fn decode(data: &[u8]) -> Result<Rtc, String> {
    if data.len() != STATE_BYTES {
        return Err(format!("{} bytes, want {STATE_BYTES}", data.len()));
    }
    let (cmos, rest) = data.split_at(CMOS_BYTES);
    let cmos: [u8; CMOS_BYTES] = cmos.try_into().expect("split at its size");
    let (index, flags, reserved) = (rest[0], rest[1], &rest[2..4]);
    let time = |at: usize| i128::from_le_bytes(rest[at..at + 16].try_into().expect("16 bytes"));
    let (offset_ns, seen_ns) = (time(4), time(20));
    if flags & !LINE != 0 || reserved != [0, 0] {
        return Err(format!(
            "flags {flags:#04x} and reserved bytes {reserved:02x?}: a layout this ferry does not know"
        ));
    }
    if cmos[REG_A] & UIP != 0 || cmos[REG_C] & 0x0f != 0 {
        return Err(format!(
            "register A {:#04x} with UIP stored, or register C {:#04x} with bits 3-0 set",
            cmos[REG_A], cmos[REG_C]
        ));
    }
    let line = flags & LINE != 0;
    if line && cmos[REG_C] & IRQF == 0 {
        return Err("the IRQ line high with register C's IRQF clear".into());
    }
    if offset_ns.abs() > TIME_BOUND_NS || seen_ns.abs() > TIME_BOUND_NS {
        return Err(format!(
            "time offset {offset_ns} ns or last update {seen_ns} ns beyond 10,000 years"
        ));
    }
    Ok(Rtc {
        cmos,
        index,
        offset_ns,
        seen_ns,
        line,
    })
}
