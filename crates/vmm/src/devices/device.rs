//! What a device is to the VMM: bus accesses at an offset into its range, and its state as a
//! section of a kind and layout version it names ([`Device`]); which bus it sits on.

#![forbid(unsafe_code)]

use ferry_migrate::wire::SectionId;

/// What a device's state section is: its id and the layout version this VMM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionKind {
    pub id: SectionId,
    pub version: u32,
}

/// Why a device's saved state could not be restored.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceStateError {
    #[error(
        "{device} state version {got} is not the supported {want}; use matching ferry versions"
    )]
    Version {
        device: &'static str,
        got: u32,
        want: u32,
    },
    #[error("{device} state is malformed: {reason}")]
    Malformed {
        device: &'static str,
        reason: String,
    },
}

impl DeviceStateError {
    /// Refuses `got` unless it is `want`.
    pub fn check_version(device: &'static str, got: u32, want: u32) -> Result<(), Self> {
        match got == want {
            true => Ok(()),
            false => Err(DeviceStateError::Version { device, got, want }),
        }
    }
}

/// A device on a bus, with state that migrates.
pub trait Device: Send {
    /// Reads `data.len()` bytes at `offset` into the device's range.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
    /// The section its state travels in.
    fn kind(&self) -> SectionKind;
    /// Its state, in the layout of `kind().version`; taken while the vCPUs are paused.
    fn save(&self) -> Vec<u8>;
    /// Replaces its state with a saved one of layout `version`, validating every byte.
    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError>;
}

/// Which bus a device sits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BusKind {
    Pio,
    Mmio,
}
