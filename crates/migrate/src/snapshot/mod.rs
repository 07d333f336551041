//! Snapshots to a file (docs/snapshot.md): the file's format and its reading and writing
//! today; the migration target that is a file (`ferry snapshot`) and the restores come next.
//!
//! - [`format`]: the header, the layout of the areas and guest RAM in the file, and the checks a
//!   reader makes before it uses anything. Pure: no I/O, no `unsafe`.
//! - [`file`]: the [`Writer`](file::Writer) that fills a file in parallel and makes it complete
//!   only at the end, and the [`Reader`](file::Reader) that checks what it hands out.

#![forbid(unsafe_code)]

pub mod file;
pub mod format;
pub mod hot;
pub mod restore;
pub mod save;
pub mod state;
mod target;

pub use file::{Reader, SnapshotError, Writer};
pub use restore::{LazyLoad, LazyStats, Loading, RestoreParams, RestoreStats, Restored, restore};
pub use save::{SaveParams, save};
