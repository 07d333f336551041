//! Sending reports to the VMM through the telemetry port, each vCPU from a buffer of its own.

use core::ptr::addr_of_mut;
use core::sync::atomic::{AtomicU64, Ordering};

use ferry_guest_abi::TELEMETRY_PORT;
use ferry_guest_abi::report::{REPORT_SIZE, Report};
use ferry_guest_abi::smp::MAX_VCPUS;

use super::arch;

#[repr(C, align(128))]
struct Buffer([u8; REPORT_SIZE]);

/// One report buffer per vCPU, in the image so they lie below 4 GiB (the port takes 32 bits).
static mut BUFFERS: [Buffer; MAX_VCPUS] = [const { Buffer([0; REPORT_SIZE]) }; MAX_VCPUS];
/// Each vCPU numbers its own reports.
static SEQ: [AtomicU64; MAX_VCPUS] = [const { AtomicU64::new(0) }; MAX_VCPUS];

/// Sends `report` from vCPU `report.vcpu`, numbering it. Under a VMM without the port (QEMU)
/// this is a no-op write.
pub fn send(report: &Report) {
    let vcpu = usize::from(report.vcpu).min(MAX_VCPUS - 1);
    let mut r = *report;
    r.seq = SEQ[vcpu].fetch_add(1, Ordering::Relaxed);
    let buf = addr_of_mut!(BUFFERS).cast::<Buffer>().wrapping_add(vcpu);
    // SAFETY: buffer `vcpu` is written only here, by vCPU `vcpu` (each vCPU sends its own
    // reports); the exception handler may interrupt a send, which at worst makes the VMM read
    // the newer report twice.
    unsafe { (*buf).0 = r.to_bytes() };
    arch::outl(TELEMETRY_PORT, buf as u64 as u32);
}
