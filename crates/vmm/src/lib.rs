//! ferry's reference VMM: a small KVM virtual machine monitor that boots PVH kernels (the
//! built-in test guest above all) and that ferry's migration engine drives.
//!
//! - [`memory`]: guest RAM in one sparse memfd, around the 32-bit MMIO hole; [`writes`]: the
//!   bitmap that records every write the VMM makes to it.
//! - [`hugepages`]: the host's hugetlbfs pool, raised for a test or bench's huge-page guests.
//! - [`limit`]: the most RAM a VM may have on this host, and why.
//! - [`boot`]: PVH loading (linux-loader) and the pre-boot checks of the built-in guest.
//! - [`kvm`]: the only module that talks to KVM: VM, memory slots, vCPUs, kicks, the dirty
//!   log, the interrupt controller, vCPU and clock state.
//! - [`devices`]: the device model: the serial ports, the telemetry port, the VM generation ID
//!   and the virtio-mmio balloon on a port bus and an MMIO bus, each device's state a
//!   versioned section.
//! - [`vm`]: a VM: its configuration, building it, its vCPU threads, its
//!   pause/resume/stop control ([`VmHandle`]), and its balloon as the API shows it: a target
//!   and what was given.
//! - [`throttle`]: auto-converge's throttle of the vCPUs; [`dirty_limit`]: the per-vCPU dirty
//!   limit, which slows only the vCPUs that dirty memory faster than it.
//! - [`section_ids`]: every section id of this VMM, declared once with its name and owner;
//!   [`sections`]: this VMM's state as migration sections; [`part_timer`]: the timer that
//!   names each part of a save or load.
//! - [`vmconfig`]: what a migration's destination must match, checked at the hello.
//! - [`migration`]: the engine's `SourceVm` and `DestinationVm` on this VMM's VMs; [`landing`]:
//!   where received pages land by default.
//! - [`request`]: [`MigrationRequest`], the one migration request type (`PUT /migration`).
//! - [`api`]: the JSON-over-HTTP control API on a Unix socket, server and client.
//! - [`error`]: the VMM's top-level error.
//!
//! `unsafe` is denied here and allowed per module where it is argued: [`kvm`], [`memory`],
//! [`migration`] (the engine's unsafe traits), `vm::shared` and `vm::runner` (kicks of vCPU
//! threads), `devices::telemetry` (one clock read), [`tap`] (the tun driver's ioctls).

#![deny(unsafe_code)]

pub mod api;
pub mod boot;
pub mod devices;
pub mod dirty_limit;
pub mod disk_copy;
pub mod error;
pub mod file_size_limit;
pub mod hugepages;
#[allow(unsafe_code)] // KVM's ioctls on guest memory, the kick signal, XSAVE
pub mod kvm;
pub mod landing;
pub mod limit;
#[allow(unsafe_code)] // the memfd, its hole punching, and populating its mappings
pub mod memory;
#[allow(unsafe_code)] // implements the engine's unsafe VM traits: the promise is made here
pub mod migration;
pub mod part_timer;
pub mod request;
pub mod section_ids;
pub mod sections;
pub mod snapshot;
#[allow(unsafe_code)] // the tun driver's ioctls on a tap's descriptor
pub mod tap;
pub mod throttle;
pub mod vm;
pub mod vmconfig;
pub mod writes;

pub use devices::serial::SerialOutput;
pub use devices::virtio::blk::{Cache, DiskOptions};
pub use error::VmmError;
pub use migration::MigrationRequest;
pub use vm::{
    GuestKind, IncomingVm, Preparation, RunState, StopReason, Vm, VmConfig, VmHandle, VmStatus,
};
