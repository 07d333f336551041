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
