//! A 16550 UART (vm-superio) as a bus device: its output goes to stdout, a file, or nowhere;
//! its interrupt goes to the VM's interrupt controller through an [`IrqLine`]. Its state is
//! the nine registers and the receive FIFO, version [`VERSION`], in section
//! `section_ids::SERIAL`.

#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::PathBuf;

use vm_superio::Serial;
use vm_superio::serial::{NoEvents, SerialState};

use super::device::{Device, DeviceStateError, SectionKind};
use super::irq::IrqLine;
use crate::section_ids::{self, SERIAL};

/// Where the guest's serial output goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialOutput {
    Stdout,
    File(PathBuf),
    Discard,
}

/// Version of the serial section layout.
pub const VERSION: u32 = 1;
/// The 16550's receive FIFO holds 64 bytes; a section claiming more is malformed.
const MAX_FIFO: usize = 64;
/// The nine registers that precede the FIFO in the section.
const REGISTERS: usize = 9;
const NAME: &str = section_ids::name(SERIAL);

type Uart = Serial<IrqLine, NoEvents, Box<dyn Write + Send>>;

/// One UART.
pub struct SerialDevice {
    uart: Uart,
    /// The line `uart` raises, kept to rebuild the UART around it on restore.
    irq: IrqLine,
}

fn writer(out: &SerialOutput) -> std::io::Result<Box<dyn Write + Send>> {
    // Line-buffered, so a reader of the file sees whole lines.
    Ok(match out {
        SerialOutput::Stdout => Box::new(LineWriter::new(std::io::stdout())),
        SerialOutput::File(path) => Box::new(LineWriter::new(File::create(path)?)),
        SerialOutput::Discard => Box::new(std::io::sink()),
    })
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice").finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A UART writing to `out` and interrupting through `irq`.
    pub fn new(out: &SerialOutput, irq: IrqLine) -> std::io::Result<SerialDevice> {
        Ok(SerialDevice {
            uart: Serial::new(irq.try_clone()?, writer(out)?),
            irq,
        })
    }
}

impl Device for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        data[0] = self.uart.read(offset as u8);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Err(e) = self.uart.write(offset as u8, data[0]) {
            tracing::warn!("serial output failed: {e:?}");
        }
    }

    fn kind(&self) -> SectionKind {
        SectionKind::single(SERIAL, VERSION)
    }

    fn save(&self) -> Vec<u8> {
        encode(&self.uart.state())
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version(NAME, version, self.kind().loads())?;
        let state = decode(data)?;
        // Rebuild around the same output and interrupt line: vm-superio restores only into a
        // new Serial, so take this one apart (a placeholder fills the slot meanwhile).
        let placeholder = Serial::new(
            IrqLine::unconnected().map_err(malformed)?,
            Box::new(std::io::sink()) as Box<dyn Write + Send>,
        );
        let out = std::mem::replace(&mut self.uart, placeholder).into_writer();
        let irq = self.irq.try_clone().map_err(malformed)?;
        self.uart = Serial::from_state(&state, irq, NoEvents, out)
            .map_err(|e| malformed(format!("{e:?}")))?;
        Ok(())
    }
}

fn malformed(reason: impl ToString) -> DeviceStateError {
    DeviceStateError::Malformed {
        device: NAME,
        reason: reason.to_string(),
    }
}

/// The registers, then the receive FIFO. A FIFO longer than the 16550's is refused rather
/// than cut: vm-superio bounds it to 64 bytes, and a longer one would be a bug worth seeing.
fn encode(s: &SerialState) -> Vec<u8> {
    assert!(
        s.in_buffer.len() <= MAX_FIFO,
        "a 16550 FIFO holds at most {MAX_FIFO} bytes"
    );
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
    v.extend_from_slice(&s.in_buffer);
    v
}

fn decode(b: &[u8]) -> Result<SerialState, DeviceStateError> {
    if b.len() < REGISTERS || b.len() > REGISTERS + MAX_FIFO {
        return Err(malformed(format!(
            "{} bytes, want {REGISTERS} to {}",
            b.len(),
            REGISTERS + MAX_FIFO
        )));
    }
    Ok(SerialState {
        baud_divisor_low: b[0],
        baud_divisor_high: b[1],
        interrupt_enable: b[2],
        interrupt_identification: b[3],
        line_control: b[4],
        line_status: b[5],
        modem_control: b[6],
        modem_status: b[7],
        scratch: b[8],
        in_buffer: b[REGISTERS..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uart() -> SerialDevice {
        SerialDevice::new(&SerialOutput::Discard, IrqLine::unconnected().unwrap()).unwrap()
    }

    #[test]
    fn state_round_trips_and_bad_state_is_refused_by_kind() {
        let mut a = uart();
        a.write(7, &[0x5a]); // scratch
        a.write(3, &[0x80]); // DLAB on, then the divisor
        a.write(0, &[0x0c]);
        let saved = a.save();
        let mut b = uart();
        b.restore(VERSION, &saved).unwrap();
        assert_eq!(b.save(), saved);
        assert_eq!(
            b.restore(2, &saved),
            Err(DeviceStateError::Version {
                device: NAME.into(),
                got: 2,
                oldest: 1,
                newest: 1
            })
        );
        for len in [REGISTERS - 1, REGISTERS + MAX_FIFO + 1] {
            assert!(matches!(
                b.restore(VERSION, &vec![0; len]),
                Err(DeviceStateError::Malformed { .. })
            ));
        }
        let mut fifo = saved.clone();
        fifo.extend_from_slice(b"queued");
        b.restore(VERSION, &fifo).unwrap();
        assert_eq!(b.save(), fifo, "the receive FIFO migrates whole");
    }

    #[test]
    fn an_enabled_interrupt_raises_the_line() {
        let irq = IrqLine::unconnected().unwrap();
        let probe = irq.eventfd().try_clone().unwrap();
        let mut u = SerialDevice::new(&SerialOutput::Discard, irq).unwrap();
        u.write(1, &[0x02]); // IER: transmitter holding register empty
        u.write(0, b"x");
        assert!(probe.read().unwrap() >= 1, "the UART raised its interrupt");
    }
}
