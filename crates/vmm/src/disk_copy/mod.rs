//! A disk no host shares, copied beside RAM (`ferry migrate --disk-copy`): the image's
//! allocated ranges go as iterative device state (the engine's `SourceVm::next_state_chunk`)
//! while the guest runs, then the ranges it wrote since, pass after pass; what is left goes in
//! the pause with the rest of the state. The engine counts what is pending as left to send,
//! so the switchover comes when the disk and RAM fit in the downtime together.
//!
//! - `chunk`: one range on the wire.
//! - `source`: the source's passes over its image.
//! - `incoming`: the destination's file, which becomes the image at the state load.
//! - `writeback`: a file synced in the background while data is written to it in bulk.

pub mod chunk;
pub mod incoming;
pub mod source;
#[allow(unsafe_code)] // sync_file_range, which std does not wrap
pub mod writeback;

pub use chunk::Chunk;
pub use incoming::{IncomingCopy, IncomingError};
pub use source::{CopyStats, DiskCopyStatus, GRANULE, SourceCopy, Written};
pub use writeback::Writeback;

#[cfg(test)]
mod tests;
