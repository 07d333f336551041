//! Snapshots to a file (docs/snapshot.md): the file's format today; the writer (a migration
//! target that is a file) and the restores come next.
//!
//! - [`format`]: the header, the layout of the areas and guest RAM in the file, and the checks a
//!   reader makes before it uses anything. Pure: no I/O, no `unsafe`.

#![forbid(unsafe_code)]

pub mod format;
