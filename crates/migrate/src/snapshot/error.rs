//! Why a snapshot could not be written or read, and the CRC a hole stands for: what the
//! Writer (`file.rs`) and the Reader (`read.rs`) share, below both.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use super::format::FormatError;
use crate::wire::{PAGE_SIZE, crc};

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{during} {}: {source}", path.display())]
    Io {
        during: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Format {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    #[error(
        "{}: its {area} is damaged (its checksum does not match); restore another copy or take a new snapshot",
        path.display()
    )]
    AreaChecksum { path: PathBuf, area: &'static str },
    #[error(
        "{}: the page at {gpa:#x} is damaged (its checksum does not match); restore another copy or take a new snapshot",
        path.display()
    )]
    PageChecksum { path: PathBuf, gpa: u64 },
    #[error(
        "the file system of {} does not take direct I/O (O_DIRECT: {source}); snapshot without --direct-io",
        path.display()
    )]
    NoDirectIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} would pass this process's file size limit ({source}; `ulimit -f`, systemd's LimitFSIZE=): raise the limit or snapshot to another file",
        path.display()
    )]
    FileSizeLimit {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} is {what}: choose another path, or replace it on purpose (`--replace`, \"replace\": \"any\")",
        path.display()
    )]
    Exists { path: PathBuf, what: &'static str },
    #[error(
        "{}: a read (the page at {gpa:#x}) has not returned after {waited:?}: the storage holding the snapshot hangs, and the guest, whose memory cannot be completed, was stopped; check the storage, then restore again",
        path.display()
    )]
    ReadStalled {
        path: PathBuf,
        gpa: u64,
        waited: std::time::Duration,
    },
    #[error(
        "{}: guest RAM at {gpa:#x} lies at file offset {offset:#x}, not a multiple of the {page}-byte page a mapping needs, so it cannot be restored with --map (ferry writes every region page aligned: the file was not written by ferry, or is damaged); restore it without --map",
        path.display()
    )]
    Unmappable {
        path: PathBuf,
        gpa: u64,
        offset: u64,
        page: u64,
    },
    #[error("a snapshot writer thread panicked (a bug in ferry)")]
    WriterPanicked,
    #[error("{gpa:#x} is not guest RAM in this snapshot")]
    OutsideRam { gpa: u64 },
    #[error("{what} of {len} bytes is more than the {reserved} bytes the snapshot reserved for it")]
    TooLarge {
        what: &'static str,
        len: u64,
        reserved: u64,
    },
}

/// The CRC32C of a page of zeros: what a hole holds.
pub(crate) fn zero_page_crc() -> u32 {
    crc(&[0u8; PAGE_SIZE as usize])
}
