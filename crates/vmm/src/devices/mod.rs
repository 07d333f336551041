//! The VMM's device model: devices on an I/O-port bus and an MMIO bus, each device's state a
//! versioned section of its own.
//!
//! A device implements [`Device`]: bus accesses at an offset into its range, and `save` /
//! `restore` of its state as bytes of a layout version it names. [`Devices`] registers each
//! device on a bus under a section kind and an instance number (COM1 and COM2 are two instances
//! of one kind), routes vCPU exits to them, and saves and loads all of them as sections, so a
//! new device is an id declared in `section_ids`, one registration and an impl, and the
//! migration engine never learns of it. A registration is refused if another device has the
//! same id and instance.

pub mod bus;
pub mod device;
pub mod irq;
pub mod pit;
mod registry;
pub mod rtc;
pub mod serial;
#[allow(unsafe_code)] // one clock_gettime call
pub mod telemetry;
pub mod telemetry_clock;
pub mod telemetry_disk;
pub mod telemetry_free;
pub mod telemetry_move;
pub mod telemetry_net;
pub mod telemetry_port;
pub mod telemetry_rtc;
pub mod virtio;
pub mod vmgenid;

pub use bus::{Bus, BusError};
pub use device::{BusKind, Device, DeviceStateError, SectionKind, SectionNeed};
pub use registry::{Devices, LoadError, RegisterError};
