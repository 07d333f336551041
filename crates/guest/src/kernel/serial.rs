//! Text on the 16550 UART at COM1 (the guest runs with interrupts off).

use core::fmt;

use super::arch;
use ferry_guest_abi::SERIAL_PORT;

/// A `fmt::Write` onto the serial port.
#[derive(Clone, Copy, Debug)]
pub struct Serial;

impl fmt::Write for Serial {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // No polling of the line status register: ferry's and QEMU's UARTs take a byte at any
        // time, and where port I/O is emulated through #GP (see entry.rs) each poll would
        // double the cost of a byte.
        for b in s.bytes() {
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
