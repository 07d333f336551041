//! ferry's built-in test guest: a PVH kernel that sets up long mode at CPL0 and then, at CPL3,
//! dirties a working set of stamped pages and verifies them. See `ferry_guest_abi::params` for
//! its command line and `ferry_guest_abi::report` for what it tells the VMM.

#![no_std]
#![no_main]

mod kernel;

use ferry_guest_abi::report::{HaltReason, Kind, Report};

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    crate::sprintln!("ferry-guest: panic: {info}");
    let mut detail = [0; ferry_guest_abi::report::DETAIL_WORDS];
    detail[0] = HaltReason::Panic as u64;
    kernel::telemetry::send(&Report {
        kind: Kind::Halt as u16,
        vcpu: kernel::arch::vcpu_index(),
        detail,
        ..Report::default()
    });
    kernel::arch::halt()
}
