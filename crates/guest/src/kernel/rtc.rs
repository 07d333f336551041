//! The RTC's time of day read through ports 0x70-0x71, as Linux's `mc146818_get_time` reads
//! it: wait for register A's update-in-progress bit to clear, read the time registers and
//! register B, and read the seconds again; a read the second's update fell into (the seconds
//! changed) is made again. The fields are decoded per register B (BCD or binary, 12- or
//! 24-hour) with the calendar the VMM's RTC uses (`ferry_guest_abi::rtc`).
//!
//! Done at CPL3 with each calibration (`pit.rs`), whose report carries it: about 20 port
//! accesses, each one exit to the VMM (~90 µs where every exit is slow), so under 2 ms.
//!
//! [`set`] writes a time (`rtc-set=`), as a guest's `hwclock --systohc` does: SET in register
//! B stops the clock, the time registers are written in B's format, and clearing SET starts
//! the clock from them.

use ferry_guest_abi::rtc::{
    self, DATA_PORT, INDEX_PORT, REG_A, REG_B, SET, TIME_REGISTERS, Time, UIP,
};

use super::arch;

/// Reads of register A before giving up on UIP clearing: it is high for 244 µs, a few reads.
const UIP_READS: u32 = 1000;
/// Reads of the whole time before giving up on one the second's update did not split.
const TRIES: u32 = 5;

/// One of the RTC's registers. The index port's NMI mask bit is left clear (NMIs enabled),
/// as a PC guest's kernel leaves it.
fn register(r: usize) -> u8 {
    arch::outb(INDEX_PORT, r as u8);
    arch::inb(DATA_PORT)
}

fn write_register(r: usize, value: u8) {
    arch::outb(INDEX_PORT, r as u8);
    arch::outb(DATA_PORT, value);
}

/// Sets the RTC to `seconds` since the Unix epoch, in the format register B has.
pub fn set(seconds: u64) {
    let b = register(REG_B);
    write_register(REG_B, b | SET);
    let regs = Time::from_unix(seconds as i64).registers(b);
    for (r, v) in TIME_REGISTERS.into_iter().zip(regs) {
        write_register(r, v);
    }
    write_register(REG_B, b & !SET);
}

/// The RTC's time as seconds since the Unix epoch, and register B as read with it; `None`
/// when no RTC answers (UIP never clears: an unassigned port reads all-ones) or its time kept
/// changing under the reads.
pub fn read() -> Option<(u64, u8)> {
    for _ in 0..TRIES {
        if !(0..UIP_READS).any(|_| register(REG_A) & UIP == 0) {
            return None;
        }
        let regs = TIME_REGISTERS.map(register);
        let b = register(REG_B);
        if register(TIME_REGISTERS[0]) != regs[0] {
            continue;
        }
        let seconds = Time::from_registers(&regs, b).to_unix();
        return u64::try_from(seconds).ok().map(|s| (s, b));
    }
    None
}

const _: () = assert!(rtc::INDEX_PORT + 1 == rtc::DATA_PORT);
