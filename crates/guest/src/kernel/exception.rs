//! Reporting an unexpected exception. The CPL0 stub (`entry.rs`) copies the frame and CR2 to
//! `exception_frame` and drops here, to CPL3, where formatting is safe (see `entry.rs` for
//! why no Rust runs at CPL0). The guest prints the vector and RIP, tells the VMM, and halts.

use ferry_guest_abi::report::{self, Kind, Report};

use super::{arch, telemetry};

/// What the stub saved: the CPU's exception frame, the vector, and CR2.
#[repr(C)]
pub struct ExceptionFrame {
    vector: u64,
    error_code: u64,
    rip: u64,
    cs: u64,
    rflags: u64,
    rsp: u64,
    ss: u64,
    cr2: u64,
}

const EXCEPTION_NAMES: [&str; 32] = [
    "#DE divide error",
    "#DB debug",
    "NMI",
    "#BP breakpoint",
    "#OF overflow",
    "#BR bound range",
    "#UD invalid opcode",
    "#NM device not available",
    "#DF double fault",
    "coprocessor segment overrun",
    "#TS invalid TSS",
    "#NP segment not present",
    "#SS stack fault",
    "#GP general protection",
    "#PF page fault",
    "reserved",
    "#MF x87 error",
    "#AC alignment check",
    "#MC machine check",
    "#XM SIMD error",
    "#VE virtualization",
    "#CP control protection",
    "reserved",
    "reserved",
    "reserved",
    "reserved",
    "reserved",
    "reserved",
    "#HV hypervisor injection",
    "#VC VMM communication",
    "#SX security",
    "reserved",
];

#[unsafe(no_mangle)]
extern "C" fn exception_report(frame: &ExceptionFrame) -> ! {
    let name = EXCEPTION_NAMES
        .get(frame.vector as usize)
        .unwrap_or(&"unknown");
    let vcpu = arch::vcpu_index();
    crate::sprintln!(
        "ferry-guest: vCPU {vcpu}: exception {} ({}) at RIP {:#x} (CPL {}), error code {:#x}, CR2 {:#x}, RSP {:#x}, SS {:#x}, RFLAGS {:#x}; halting",
        frame.vector,
        name,
        frame.rip,
        frame.cs & 3,
        frame.error_code,
        frame.cr2,
        frame.rsp,
        frame.ss,
        frame.rflags
    );
    let mut detail = [0u64; report::DETAIL_WORDS];
    detail[report::exception::VECTOR] = frame.vector;
    detail[report::exception::ERROR_CODE] = frame.error_code;
    detail[report::exception::RIP] = frame.rip;
    detail[report::exception::CR2] = frame.cr2;
    detail[report::exception::CS] = frame.cs;
    telemetry::send(&Report {
        kind: Kind::Exception as u16,
        vcpu,
        detail,
        ..Report::default()
    });
    arch::halt()
}
