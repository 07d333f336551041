//! The VMM's devices and the port bus that routes vCPU I/O exits to them.

pub mod serial;
pub mod telemetry;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use ferry_guest_abi::report::REPORT_SIZE;
use ferry_guest_abi::{SERIAL_PORT, TELEMETRY_PORT};

use crate::memory::GuestRam;
use serial::Uart;
use telemetry::GuestTelemetry;

/// Ports of the 16550: base and the seven registers after it.
const SERIAL_PORTS: std::ops::Range<u16> = SERIAL_PORT..SERIAL_PORT + 8;

/// Port and MMIO devices of one VM.
pub struct Devices {
    uart: Uart,
    telemetry: Arc<Mutex<GuestTelemetry>>,
    ram: Arc<GuestRam>,
    /// Ports and MMIO pages already reported as unknown: each is logged once, then ignored.
    unknown_ports: HashSet<u16>,
    unknown_mmio: HashSet<u64>,
}

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Devices").finish_non_exhaustive()
    }
}

impl Devices {
    pub fn new(uart: Uart, telemetry: Arc<Mutex<GuestTelemetry>>, ram: Arc<GuestRam>) -> Devices {
        Devices {
            uart,
            telemetry,
            ram,
            unknown_ports: HashSet::new(),
            unknown_mmio: HashSet::new(),
        }
    }

    /// The UART's state, for migration.
    pub fn uart_state(&self) -> vm_superio::serial::SerialState {
        self.uart.state()
    }

    /// Replaces the UART (with one rebuilt from migrated state).
    pub fn set_uart(&mut self, uart: Uart) {
        self.uart = uart;
    }

    pub fn io_out(&mut self, port: u16, data: &[u8]) {
        match port {
            p if SERIAL_PORTS.contains(&p) => {
                if let Err(e) = self.uart.write((p - SERIAL_PORT) as u8, data[0]) {
                    tracing::warn!("serial output failed: {e:?}");
                }
            }
            TELEMETRY_PORT if data.len() == 4 => {
                let gpa = u64::from(u32::from_le_bytes(data.try_into().unwrap()));
                self.telemetry_report(gpa);
            }
            _ => self.unknown_port(port, "write"),
        }
    }

    pub fn io_in(&mut self, port: u16, data: &mut [u8]) {
        match port {
            p if SERIAL_PORTS.contains(&p) => data[0] = self.uart.read((p - SERIAL_PORT) as u8),
            _ => {
                data.fill(0xff);
                self.unknown_port(port, "read");
            }
        }
    }

    pub fn mmio(&mut self, addr: u64, data: Option<&mut [u8]>) {
        let write = data.is_none();
        if let Some(d) = data {
            d.fill(0xff);
        }
        if self.unknown_mmio.insert(addr & !0xfff) {
            let what = if write { "write to" } else { "read from" };
            tracing::warn!(
                "guest {what} unhandled MMIO address {addr:#x} ignored (logged once per page)"
            );
        }
    }

    fn telemetry_report(&mut self, gpa: u64) {
        let host_ns = telemetry::host_monotonic_ns();
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

    fn unknown_port(&mut self, port: u16, what: &str) {
        if self.unknown_ports.insert(port) {
            tracing::warn!(
                "guest {what} of unhandled I/O port {port:#x} ignored (logged once per port)"
            );
        }
    }
}
