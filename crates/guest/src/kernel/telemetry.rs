//! Sending reports to the VMM through the telemetry port.

use core::ptr::addr_of_mut;
use core::sync::atomic::{AtomicU64, Ordering};

use ferry_guest_abi::TELEMETRY_PORT;
use ferry_guest_abi::report::{REPORT_SIZE, Report};

use super::arch;

#[repr(C, align(128))]
struct Buffer([u8; REPORT_SIZE]);

/// The one report buffer, in the image so it lies below 4 GiB (the port takes 32 bits).
static mut BUFFER: Buffer = Buffer([0; REPORT_SIZE]);
static SEQ: AtomicU64 = AtomicU64::new(0);

/// Sends `report`, numbering it. Under a VMM without the port (QEMU) this is a no-op write.
pub fn send(report: &Report) {
    let mut r = *report;
    r.seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let buf = addr_of_mut!(BUFFER);
    // SAFETY: the guest has one vCPU and the buffer is written only here; the exception
    // handler may interrupt a send, which at worst makes the VMM read the newer report twice.
    unsafe { (*buf).0 = r.to_bytes() };
    arch::outl(TELEMETRY_PORT, buf as u64 as u32);
}
