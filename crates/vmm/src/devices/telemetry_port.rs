//! The telemetry port as a bus device: the guest writes, with one 32-bit `out`, the address of
//! a report in its memory; the device reads it and records it, stamped with the host's clock,
//! in the [`GuestTelemetry`] that the VM's status shows. Its state is the telemetry itself, so
//! counters and heartbeats continue across a migration.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use ferry_guest_abi::report::REPORT_SIZE;
use ferry_migrate::wire::SectionId;

use super::device::{Device, DeviceStateError, SectionKind};
use super::telemetry::{GuestTelemetry, host_monotonic_ns};
use crate::memory::GuestRam;

/// The section id of the telemetry state.
pub const SECTION: SectionId = SectionId(4);
/// Version of the telemetry section layout (2: counters per vCPU).
pub const VERSION: u32 = 2;
/// The port takes one 32-bit write.
pub const LEN: u64 = 4;

#[derive(Debug)]
pub struct TelemetryPort {
    telemetry: Arc<Mutex<GuestTelemetry>>,
    ram: Arc<GuestRam>,
}

impl TelemetryPort {
    pub fn new(telemetry: Arc<Mutex<GuestTelemetry>>, ram: Arc<GuestRam>) -> TelemetryPort {
        TelemetryPort { telemetry, ram }
    }
}

impl Device for TelemetryPort {
    fn read(&mut self, _: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write(&mut self, _: u64, data: &[u8]) {
        let Ok(word) = <[u8; 4]>::try_from(data) else {
            tracing::warn!("telemetry port written with {} bytes, not 4", data.len());
            return;
        };
        let gpa = u64::from(u32::from_le_bytes(word));
        let host_ns = host_monotonic_ns();
        let mut bytes = [0u8; REPORT_SIZE];
        let result = match self.ram.read(gpa, &mut bytes) {
            Ok(()) => self
                .telemetry
                .lock()
                .unwrap()
                .record_bytes(&bytes, host_ns)
                .map(|_| ())
                .map_err(|e| format!("{e:?}")),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = result {
            tracing::warn!("invalid telemetry report at {gpa:#x}: {e}");
        }
    }

    fn kind(&self) -> SectionKind {
        SectionKind {
            id: SECTION,
            version: VERSION,
        }
    }

    fn save(&self) -> Vec<u8> {
        self.telemetry.lock().unwrap().encode_state()
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version("telemetry port", version, VERSION)?;
        *self.telemetry.lock().unwrap() = GuestTelemetry::decode_state(data)?;
        Ok(())
    }
}
