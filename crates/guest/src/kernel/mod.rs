//! The guest kernel: CPL0 setup in assembly (`entry`), then at CPL3 the boot (`boot`, and its
//! first reports, `announce`), the workload (`workload`, or `compute` on a computing vCPU;
//! `disk` and `net` beside it on the boot vCPU) and exception reporting (`exception`), with
//! their leaf modules for instructions, memory, the clock, its gaps (`clockgap`) and its
//! calibration against the PIT (`pit`), the RTC's time of day (`rtc`), the UART, telemetry, the VM generation ID and the virtio devices (`virtio_mmio`, `balloon`, `blk`, `nic`).

pub mod announce;
pub mod arch;
pub mod balloon;
pub mod blk;
pub mod boot;
pub mod boot_info;
pub mod clock;
pub mod clockgap;
pub mod compute;
pub mod disk;
pub mod entry;
pub mod exception;
pub mod freemem;
pub mod libc;
pub mod memory;
pub mod net;
pub mod nic;
pub mod pit;
pub mod rtc;
pub mod serial;
pub mod smp;
pub mod telemetry;
pub mod timer;
pub mod virtio_mmio;
pub mod vmgenid;
pub mod workload;
