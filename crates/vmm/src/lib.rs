//! ferry's reference VMM: a small KVM virtual machine monitor that boots PVH kernels (the
//! built-in test guest above all) and that ferry's migration engine drives.
//!
//! - [`memory`]: guest RAM in one sparse memfd, around the 32-bit MMIO hole.
//! - [`boot`]: PVH loading (linux-loader) and the pre-boot checks of the built-in guest.
//! - [`kvm`]: the only module that talks to KVM: VM, memory slots, vCPUs, kicks.
//! - [`devices`]: the 16550 UART and the telemetry port, behind a port bus.
//! - [`vm`]: a running VM and its pause/resume/stop control.
//! - [`api`]: the JSON-over-HTTP control API on a Unix socket, server and client.

#![deny(unsafe_code)]

pub mod api;
pub mod balloon;
pub mod boot;
pub mod devices;
pub mod error;
#[allow(unsafe_code)] // KVM's ioctls on guest memory, the kick signal, XSAVE
pub mod kvm;
pub mod limit;
#[allow(unsafe_code)] // the memfd, its hole punching, and populating its mappings
pub mod memory;
#[allow(unsafe_code)] // implements the engine's unsafe VM traits: the promise is made here
pub mod migration;
pub mod part_timer;
pub mod sections;
pub mod throttle;
pub mod vm;
pub mod vmconfig;
pub mod writes;

pub use devices::serial::SerialOutput;
pub use error::VmmError;
pub use migration::MigrationRequest;
pub use vm::{
    GuestKind, IncomingVm, Preparation, RunState, StopReason, Vm, VmConfig, VmHandle, VmStatus,
};
