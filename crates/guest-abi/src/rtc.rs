//! The PC's RTC (an MC146818 and its CMOS) as host and guest both see it: its ports, its
//! registers and their bits, and the calendar behind the time registers: a count of seconds
//! since the Unix epoch turned into the chip's fields (seconds, minutes, hours, weekday, day
//! of month, month, year, century) in the format register B names, and back. The VMM's
//! device (`devices::rtc` in ferry-vmm) writes them; the guest (`kernel/rtc.rs`) reads them.
//!
//! Dates are the proleptic Gregorian calendar, days counted from 1970-01-01 by the civil-date
//! arithmetic of eras of 400 years (146,097 days each). Register B's DM bit chooses binary or
//! BCD for every field; its 24/12 bit chooses 0-23 hours or 1-12 with bit 7 meaning PM. A
//! field a guest wrote out of range (a BCD digit over 9, month 13, an hour 25) is clamped into
//! range when the time is decoded, so a garbled write gives a defined time, never an error.

/// The index port (bits 6-0: the register; bit 7: NMI disabled) and the data port.
pub const INDEX_PORT: u16 = 0x70;
pub const DATA_PORT: u16 = 0x71;
/// The index port's bit 7: NMI disabled.
pub const NMI_MASK: u8 = 1 << 7;

pub const REG_A: usize = 0x0a;
pub const REG_B: usize = 0x0b;
pub const REG_C: usize = 0x0c;
pub const REG_D: usize = 0x0d;
/// Register A: update in progress (read only).
pub const UIP: u8 = 1 << 7;
/// Register B: SET (the clock stopped for the guest to write), and the interrupt enables.
pub const SET: u8 = 1 << 7;
pub const PIE: u8 = 1 << 6;
pub const AIE: u8 = 1 << 5;
pub const UIE: u8 = 1 << 4;
/// Register C: an enabled flag is set; the periodic, alarm and update-ended flags, at the
/// bits of their enables in B.
pub const IRQF: u8 = 1 << 7;
pub const PF: u8 = PIE;
pub const AF: u8 = AIE;
pub const UF: u8 = UIE;
/// Register D: valid RAM and time (the battery is good).
pub const VRT: u8 = 1 << 7;

/// Register B's bits that shape a field: DM (1 = binary) and 24/12 (1 = 24-hour).
pub const DM_BINARY: u8 = 1 << 2;
pub const HOURS_24: u8 = 1 << 1;
/// Bit 7 of the hours register in 12-hour mode: PM.
const PM: u8 = 1 << 7;

pub const SECONDS: usize = 0x00;
pub const MINUTES: usize = 0x02;
pub const HOURS: usize = 0x04;
pub const WEEKDAY: usize = 0x06;
pub const DAY: usize = 0x07;
pub const MONTH: usize = 0x08;
pub const YEAR: usize = 0x09;
/// The century (19, 20, ...), where QEMU and SeaBIOS keep it and ACPI's FADT points by default.
pub const CENTURY: usize = 0x32;
/// The registers the clock itself keeps, in the order [`Time::registers`] gives them.
pub const TIME_REGISTERS: [usize; 8] =
    [SECONDS, MINUTES, HOURS, WEEKDAY, DAY, MONTH, YEAR, CENTURY];

const SECONDS_PER_DAY: i64 = 86_400;
const DAYS_PER_ERA: i64 = 146_097;

/// A moment as the RTC's fields, in plain numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Time {
    pub year: i64,
    /// 1-12.
    pub month: u8,
    /// 1-31.
    pub day: u8,
    /// 0-23.
    pub hour: u8,
    pub minute: u8,
    pub second: u8,
    /// 1 = Sunday ... 7 = Saturday, as the MC146818 counts.
    pub weekday: u8,
}

/// Days since 1970-01-01 of a civil date (`month` 1-12, `day` 1-31; a day past the month's
/// end runs into the next month).
pub fn days_from_civil(year: i64, month: u8, day: u8) -> i64 {
    let (m, d) = (i64::from(month), i64::from(day));
    let y = if m <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let month_from_march = (m + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + d - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * DAYS_PER_ERA + day_of_era - 719_468
}

/// The civil date (year, month, day) of a count of days since 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(DAYS_PER_ERA);
    let day_of_era = z - era * DAYS_PER_ERA;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u8;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    } as u8;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

impl Time {
    /// The moment `seconds` after the Unix epoch.
    pub fn from_unix(seconds: i64) -> Time {
        let days = seconds.div_euclid(SECONDS_PER_DAY);
        let in_day = seconds.rem_euclid(SECONDS_PER_DAY);
        let (year, month, day) = civil_from_days(days);
        Time {
            year,
            month,
            day,
            hour: (in_day / 3600) as u8,
            minute: (in_day / 60 % 60) as u8,
            second: (in_day % 60) as u8,
            // 1970-01-01 was a Thursday (5 when Sunday is 1).
            weekday: ((days + 4).rem_euclid(7) + 1) as u8,
        }
    }

    /// Seconds since the Unix epoch; the weekday is not looked at (the date names the day).
    pub fn to_unix(&self) -> i64 {
        days_from_civil(self.year, self.month, self.day) * SECONDS_PER_DAY
            + i64::from(self.hour) * 3600
            + i64::from(self.minute) * 60
            + i64::from(self.second)
    }

    /// The eight time registers ([`TIME_REGISTERS`]' order) in register B's format.
    pub fn registers(&self, b: u8) -> [u8; 8] {
        let f = |v: u8| encode(v, b);
        let hour = match b & HOURS_24 {
            0 => {
                let h12 = match self.hour % 12 {
                    0 => 12,
                    h => h,
                };
                f(h12) | if self.hour >= 12 { PM } else { 0 }
            }
            _ => f(self.hour),
        };
        let year = self.year.rem_euclid(100) as u8;
        let century = self.year.div_euclid(100).clamp(0, 99) as u8;
        [
            f(self.second),
            f(self.minute),
            hour,
            f(self.weekday),
            f(self.day),
            f(self.month),
            f(year),
            f(century),
        ]
    }

    /// The time that registers (in [`TIME_REGISTERS`]' order) in register B's format say, each
    /// field clamped into its range.
    pub fn from_registers(r: &[u8; 8], b: u8) -> Time {
        let f = |v: u8| decode(v, b);
        let hour = match b & HOURS_24 {
            0 => f(r[2] & !PM).clamp(1, 12) % 12 + if r[2] & PM != 0 { 12 } else { 0 },
            _ => f(r[2]).min(23),
        };
        Time {
            year: i64::from(f(r[7]).min(99)) * 100 + i64::from(f(r[6]).min(99)),
            month: f(r[5]).clamp(1, 12),
            day: f(r[4]).clamp(1, 31),
            hour,
            minute: f(r[1]).min(59),
            second: f(r[0]).min(59),
            weekday: f(r[3]).clamp(1, 7),
        }
    }
}

/// `v` (0-99) as register B's format writes it.
pub fn encode(v: u8, b: u8) -> u8 {
    match b & DM_BINARY {
        0 => ((v / 10) << 4) | (v % 10),
        _ => v,
    }
}

/// A register's value in register B's format as a number; a BCD digit over 9 counts as 9.
pub fn decode(v: u8, b: u8) -> u8 {
    match b & DM_BINARY {
        0 => (v >> 4).min(9) * 10 + (v & 0xf).min(9),
        _ => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BCD_24H: u8 = HOURS_24;
    const BINARY_12H: u8 = DM_BINARY;

    #[test]
    fn dates_round_trip_through_days_across_leap_years_and_eras() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(
            civil_from_days(11_016),
            (2000, 2, 29),
            "2000 was a leap year"
        );
        assert_eq!(
            civil_from_days(days_from_civil(2100, 3, 1) - 1),
            (2100, 2, 28)
        );
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    /// 2001-09-09 01:46:40 UTC, a Sunday, is Unix second 1,000,000,000.
    #[test]
    fn a_unix_second_becomes_the_fields_and_back() {
        let t = Time::from_unix(1_000_000_000);
        assert_eq!(
            t,
            Time {
                year: 2001,
                month: 9,
                day: 9,
                hour: 1,
                minute: 46,
                second: 40,
                weekday: 1
            }
        );
        assert_eq!(t.to_unix(), 1_000_000_000);
        assert_eq!(Time::from_unix(0).weekday, 5, "a Thursday");
    }

    #[test]
    fn registers_are_bcd_or_binary_and_24_or_12_hour_per_register_b() {
        let t = Time::from_unix(1_000_000_000 + 13 * 3600); // 14:46:40
        assert_eq!(
            t.registers(BCD_24H),
            [0x40, 0x46, 0x14, 0x01, 0x09, 0x09, 0x01, 0x20]
        );
        assert_eq!(t.registers(BINARY_12H), [40, 46, 2 | 0x80, 1, 9, 9, 1, 20]);
        assert_eq!(t.registers(0)[2], 0x82, "BCD 12-hour: 2 PM");
        let midnight = Time::from_unix(1_000_000_000 - 6400); // 00:00:00
        assert_eq!(midnight.registers(0)[2], 0x12, "12 AM");
        let noon = Time::from_unix(1_000_000_000 - 6400 + 12 * 3600);
        assert_eq!(noon.registers(0)[2], 0x92, "12 PM");
        for b in [0, BCD_24H, BINARY_12H, DM_BINARY | HOURS_24] {
            for t in [t, midnight, noon] {
                assert_eq!(Time::from_registers(&t.registers(b), b), t, "format {b:#x}");
            }
        }
    }

    #[test]
    fn fields_out_of_range_are_clamped() {
        let garbled = [0xff, 0x7a, 0x35, 0, 0x00, 0x13, 0x99, 0x20];
        let t = Time::from_registers(&garbled, BCD_24H);
        assert_eq!((t.second, t.minute, t.hour), (59, 59, 23));
        assert_eq!((t.day, t.month, t.year), (1, 12, 2099));
    }
}
