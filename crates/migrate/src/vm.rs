//! What a VMM implements to be migrated by ferry: [`SourceVm`] on the sending side,
//! [`DestinationVm`] on the receiving side. Device state travels as opaque, versioned
//! [`Section`]s the VMM encodes and validates itself.
//!
//! Methods a VMM cannot support return [`VmError::Unsupported`]; the engine never assumes a
//! silent success.

use std::time::Duration;

use crate::bitmap::DirtyBitmap;
use crate::ram::RamRegion;
use crate::wire::{SectionHeader, SectionId};

/// A piece of non-RAM state: a vCPU, a device, the VM clock. The VMM chooses the id and
/// version and encodes the data; the engine carries it, bounded, and never looks inside.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub id: SectionId,
    /// Which of several sections with the same id this is (vCPU 3); 0 for a single one.
    pub instance: u32,
    pub version: u32,
    pub data: Vec<u8>,
}

impl Section {
    /// The header that precedes the data on the wire.
    pub fn header(&self) -> SectionHeader {
        SectionHeader {
            id: self.id,
            instance: self.instance,
            version: self.version,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{operation} is not supported by this VMM")]
    Unsupported { operation: &'static str },
    #[error("{operation} failed: {message}")]
    Failed {
        operation: &'static str,
        message: String,
    },
}

/// The sending side of a migration.
///
/// # Safety
///
/// [`SourceVm::ram`] must describe mappings that are readable for as long as the value
/// lives, each backed by `fd` at `file_offset`, so that the engine may read guest memory through
/// them while the guest runs.
pub unsafe trait SourceVm: Send {
    /// Guest RAM.
    fn ram(&self) -> Vec<RamRegion>;

    /// Starts dirty tracking with every page considered dirty ("initially set"): nothing is
    /// tracked for a page until [`SourceVm::clear_dirty`] re-arms it.
    fn start_dirty_log(&mut self) -> Result<(), VmError>;

    /// Re-arms tracking for `pages` pages from `gpa` (which the engine is about to send),
    /// dropping their dirty state.
    fn clear_dirty(&mut self, gpa: u64, pages: u64) -> Result<(), VmError>;

    /// Fetch-and-clear: ORs into `into` every page written since it was last fetched or
    /// cleared, by the guest or by the VMM itself, and re-arms tracking for them.
    fn fetch_dirty(&mut self, into: &mut DirtyBitmap) -> Result<(), VmError>;

    /// Ends dirty tracking (after completion, failure or cancel).
    fn stop_dirty_log(&mut self);

    /// Stops the vCPUs; returns once none runs guest code.
    fn pause(&mut self) -> Result<(), VmError>;

    fn resume(&mut self) -> Result<(), VmError>;

    /// All non-RAM state, taken while paused.
    fn save_state(&mut self) -> Result<Vec<Section>, VmError>;
}

/// The receiving side of a migration.
///
/// # Safety
///
/// [`DestinationVm::ram`] must describe mappings that are readable and writable for as long as
/// the value lives, each backed by `fd` at `file_offset`, and no vCPU may run before
/// [`DestinationVm::resume`].
pub unsafe trait DestinationVm: Send {
    fn ram(&self) -> Vec<RamRegion>;

    /// Loads all non-RAM state; refuses a section it does not know or cannot validate.
    fn load_state(&mut self, sections: &[Section]) -> Result<(), VmError>;

    /// Starts the guest. Returns how long starting took (part of the downtime breakdown).
    fn resume(&mut self) -> Result<Duration, VmError>;
}
