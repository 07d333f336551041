//! The guest kernel: CPL0 setup in assembly (`entry`), then at CPL3 the boot (`boot`), the
//! workload (`workload`, or `compute` on a computing vCPU) and exception reporting (`exception`), with
//! their leaf modules for instructions, memory, the clock, the UART, telemetry and the VM
//! generation ID.

pub mod arch;
pub mod balloon;
pub mod boot;
pub mod boot_info;
pub mod clock;
pub mod compute;
pub mod entry;
pub mod exception;
pub mod freemem;
pub mod libc;
pub mod memory;
pub mod serial;
pub mod smp;
pub mod telemetry;
pub mod timer;
pub mod vmgenid;
pub mod workload;
