//! Text on the 16550 UART at COM1, polled (the guest runs with interrupts off).

use core::fmt;

use super::arch;
use ferry_guest_abi::SERIAL_PORT;

/// Line status register offset and its "transmit holding register empty" bit.
const LSR: u16 = 5;
const LSR_THRE: u8 = 1 << 5;
/// Polls of LSR before a byte is written anyway: a UART that never drains must not hang the
/// guest (at ~1 us per polled exit this is a few ms).
const MAX_POLLS: u32 = 10_000;

/// A `fmt::Write` onto the serial port.
#[derive(Clone, Copy, Debug)]
pub struct Serial;

impl fmt::Write for Serial {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            let mut polls = 0;
            while arch::inb(SERIAL_PORT + LSR) & LSR_THRE == 0 && polls < MAX_POLLS {
                polls += 1;
            }
            arch::outb(SERIAL_PORT, b);
        }
        Ok(())
    }
}

/// `println!` onto the serial port, errors ignored (there is nowhere to report them).
#[macro_export]
macro_rules! sprintln {
    ($($arg:tt)*) => {{
        use core::fmt::Write as _;
        let _ = writeln!($crate::kernel::serial::Serial, $($arg)*);
    }};
}
