//! What ferry's host side and its built-in test guest agree on: I/O ports, the guest's
//! command-line parameters, the page stamp that makes every written page checkable (and the
//! block stamp that does the same for the disk), the network workload's frames and echo
//! (`net`), the telemetry report layout, the VM generation ID (`vmgenid`), and the arithmetic
//! that sizes the guest's memory footprint.
//!
//! The ports: COM1 at 0x3f8, the telemetry port at 0x0fe4, the exit port at 0x0fe8, the start
//! port at 0x0fec (`smp`), and the VM generation ID at 0x0ff0..0x1000 (`vmgenid`), read-only;
//! all but COM1 unassigned on a PC, so that under QEMU a write is dropped and a read answers
//! all-ones.
//!
//! The crate is `no_std`, allocation-free and pure, so the guest links it at CPL3 and the
//! host uses the very same code to validate a command line before it boots anything.

#![no_std]
#![forbid(unsafe_code)]

pub mod disk;
pub mod help;
pub mod layout;
pub mod net;
pub mod params;
pub mod report;
pub mod rtc;
pub mod smp;
pub mod stamp;
pub mod virtio;
pub mod vmgenid;

/// Size of the pages the guest writes, stamps and verifies (x86 base page).
pub const PAGE_SIZE: u64 = 4096;

/// Base of the 16550 UART the guest prints to (COM1, the PC convention both ferry and QEMU
/// follow, so the same guest talks to either).
pub const SERIAL_PORT: u16 = 0x3f8;

/// The telemetry port. The guest writes, with one 32-bit `out`, the guest-physical address of
/// a [`report::Report`]; the VMM reads the report from guest memory and timestamps it with the
/// host's monotonic clock. 0x0fe4 is unassigned on a PC, so under QEMU the write is dropped
/// and the guest runs unchanged.
pub const TELEMETRY_PORT: u16 = 0x0fe4;

/// The exit port: the guest's last act before it halts for good is a byte written here, so
/// the VMM learns that it is done (a halted vCPU does not leave KVM when the interrupt
/// controller is in the kernel). Also unassigned on a PC; QEMU drops the write.
pub const EXIT_PORT: u16 = 0x0fe8;

/// Longest command line the guest accepts. PVH gives the guest a NUL-terminated string; one
/// page is ample for `key=value` pairs and bounds what the guest copies at CPL0.
pub const CMDLINE_MAX: usize = 4096;
