//! Snapshots to a file (docs/snapshot.md), and restores from one.
//!
//! - [`format`](mod@format): the header, the layout of the areas and guest RAM in the file, and the checks a
//!   reader makes before it uses anything. Pure: no I/O, no `unsafe`.
//! - [`file`](mod@file): the [`Writer`] that fills a file in parallel and makes it complete only at the
//!   end; [`read`](mod@read): the [`Reader`] that checks what it hands out;
//!   [`error`](mod@error): their errors, below both.
//! - [`state`] and [`hot`]: the device state area and the hot set.
//! - `target.rs`: the file as a migration session's target (writer threads); [`save()`] runs a
//!   live snapshot through it ([`mod@save`]).
//! - [`restore()`]: eager, lazy and mapped restores into any [`DestinationVm`](crate::DestinationVm);
//!   [`map`](mod@map): where a mapped restore's regions lie in the file.

#![forbid(unsafe_code)]

pub mod error;
pub mod file;
pub mod format;
pub mod hot;
pub mod map;
pub mod read;
pub mod restore;
pub mod save;
pub mod state;
mod target;
#[cfg(test)]
mod tests;

pub use error::SnapshotError;
pub use file::{FileOptions, Replace, Writer};
pub use read::Reader;
pub use restore::{
    DEFAULT_READ_DEADLINE, LazyLoad, LazyStats, Loading, RestoreParams, RestoreStats, Restored,
    restore,
};
pub use save::{DEFAULT_STAGING_LIMIT, SaveParams, save};
pub use target::AfterSave;
