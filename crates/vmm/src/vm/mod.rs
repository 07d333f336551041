//! A VM: its RAM, its vCPU threads, its devices, and the control state that pauses, resumes
//! and stops it. [`Vm::boot`] starts a fresh guest; [`Vm::incoming`] prepares an empty VM that
//! a migration fills and then starts.
//!
//! - `config`: what a VM is made of, and the guest's command line built from it.
//! - `build`: building a VM (RAM, KVM VM, vCPUs, devices) and starting its vCPU threads;
//!   [`Vm`] and [`IncomingVm`].
//! - `state`: the run state and why a VM stopped.
//! - `shared`: what every thread of a VM shares, the control state and the kicks.
//! - `handle`: [`VmHandle`], the pause/resume/stop state machine, the throttle, status;
//!   `handle/balloon.rs`: the balloon's status and target as `GET`/`PUT /balloon` show them.
//! - `disk`: the disk at a migration's two ends (flushed at the source's pause, opened at the
//!   destination's state load) and its status.
//! - `holds`: who needs guest RAM left as it is (RAM still arriving, the balloon's discard ban),
//!   counted.
//! - `runner`: a vCPU thread's loop.
//! - `start_port`: how the guest starts its secondary vCPUs.

pub mod build;
pub mod config;
pub(crate) mod disk;
pub mod handle;
pub mod holds;
pub(crate) mod net;
#[allow(unsafe_code)] // registers the vCPU's kvm_run for kicks
mod runner;
#[allow(unsafe_code)] // kicks vCPU threads by id, under the rule that keeps the ids valid
pub(crate) mod shared;
mod start_port;
pub mod state;
#[cfg(test)]
mod tests;

pub use crate::disk_copy::DiskCopyStatus;
pub use build::{IncomingVm, Preparation, Vm};
pub use config::{BALLOON_GSI, BALLOON_MMIO, GuestKind, MAX_VCPUS, VmConfig};
pub use disk::DiskStatus;
pub use handle::balloon::{BalloonStatus, BalloonTargetError};
pub use handle::{ControlError, PAUSE_TIMEOUT, VmHandle, VmStatus};
pub use holds::Arrival;
pub use net::{Announce, NetStatus};
pub use state::{RunState, StopReason};
