//! The 16550 UART at COM1 (vm-superio), its output sent to stdout, a file, or nowhere.

use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::PathBuf;

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};

/// Where the guest's serial output goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialOutput {
    Stdout,
    File(PathBuf),
    Discard,
}

/// The UART raises no interrupts: this VMM has no interrupt controller, and the built-in guest
/// polls the line status register. An interrupt-driven guest would see a UART that never
/// interrupts, which the 16550 permits (IER may be ignored by a polled driver).
#[derive(Debug)]
pub struct NoInterrupt;

impl Trigger for NoInterrupt {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        Ok(())
    }
}

pub type Uart = Serial<NoInterrupt, NoEvents, Box<dyn Write + Send>>;

/// Creates the UART writing to `out`, line-buffered so a reader of the file sees whole lines.
pub fn uart(out: &SerialOutput) -> std::io::Result<Uart> {
    let writer: Box<dyn Write + Send> = match out {
        SerialOutput::Stdout => Box::new(LineWriter::new(std::io::stdout())),
        SerialOutput::File(path) => Box::new(LineWriter::new(File::create(path)?)),
        SerialOutput::Discard => Box::new(std::io::sink()),
    };
    Ok(Serial::new(NoInterrupt, writer))
}

/// Version of the serial section layout.
pub const SERIAL_STATE_VERSION: u32 = 1;
/// The 16550's receive FIFO holds 64 bytes; a section claiming more is malformed.
const MAX_FIFO: usize = 64;

/// The UART's registers and receive buffer as bytes: nine registers, then the buffer.
pub fn encode_state(s: &vm_superio::serial::SerialState) -> Vec<u8> {
    let mut v = vec![
        s.baud_divisor_low,
        s.baud_divisor_high,
        s.interrupt_enable,
        s.interrupt_identification,
        s.line_control,
        s.line_status,
        s.modem_control,
        s.modem_status,
        s.scratch,
    ];
    v.extend_from_slice(&s.in_buffer[..s.in_buffer.len().min(MAX_FIFO)]);
    v
}

pub fn decode_state(b: &[u8]) -> Result<vm_superio::serial::SerialState, String> {
    if b.len() < 9 || b.len() > 9 + MAX_FIFO {
        return Err(format!(
            "serial state of {} bytes, want 9 to {}",
            b.len(),
            9 + MAX_FIFO
        ));
    }
    Ok(vm_superio::serial::SerialState {
        baud_divisor_low: b[0],
        baud_divisor_high: b[1],
        interrupt_enable: b[2],
        interrupt_identification: b[3],
        line_control: b[4],
        line_status: b[5],
        modem_control: b[6],
        modem_status: b[7],
        scratch: b[8],
        in_buffer: b[9..].to_vec(),
    })
}

/// Rebuilds the UART from migrated state, writing to `out`.
pub fn uart_from_state(b: &[u8], out: &SerialOutput) -> Result<Uart, String> {
    let state = decode_state(b)?;
    let fresh = uart(out).map_err(|e| e.to_string())?;
    let writer = fresh.into_writer();
    Serial::from_state(&state, NoInterrupt, NoEvents, writer).map_err(|e| format!("{e:?}"))
}
