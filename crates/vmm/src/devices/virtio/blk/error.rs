//! Why a disk cannot be opened, attached or flushed, or its options not parsed: one enum for
//! the block device, each message naming the image and what to do.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use super::spec::BLK_SIZE;

/// A block device error, for the VMM and its user.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error(
        "disk option {text:?} names no image; give it as PATH[,readonly][,cache=none|writeback]"
    )]
    NoPath { text: String },
    #[error(
        "disk option {part:?} is unknown; the options after the path are readonly and cache=none|writeback (a path cannot contain a comma)"
    )]
    UnknownOption { part: String },
    #[error(
        "cache={value} is not a cache mode; use cache=writeback (the host's page cache) or cache=none (O_DIRECT, bypassing it)"
    )]
    UnknownCache { value: String },
    #[error("disk option {option} is given twice; give it once")]
    Repeated { option: &'static str },
    #[error(
        "disk image {} does not exist; create it first, e.g. `truncate -s 8G {}`",
        path.display(),
        path.display()
    )]
    Missing { path: PathBuf },
    #[error("disk image {} is not a regular file; give a raw image file", path.display())]
    NotAFile { path: PathBuf },
    #[error(
        "cannot open disk image {}: {source}; check that it exists and its permissions{}",
        path.display(),
        readonly_hint(*readonly)
    )]
    Open {
        path: PathBuf,
        readonly: bool,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the file system holding {} refuses O_DIRECT ({source}), which cache=none needs; use cache=writeback, or move the image to a file system with O_DIRECT (ext4, xfs)",
        path.display()
    )]
    DirectUnsupported {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the storage under {} needs O_DIRECT I/O aligned to more than {BLK_SIZE} bytes ({source}), which the guest's {BLK_SIZE}-byte sectors cannot promise; use cache=writeback",
        path.display()
    )]
    DirectAlignment {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "disk image {} holds {image_sectors} sectors ({} bytes), but the source's disk had {expected_sectors} ({} bytes); give the destination the source's image, or one of its size (`truncate -s {} {}`)",
        path.display(),
        *image_sectors * 512,
        *expected_sectors * 512,
        *expected_sectors * 512,
        path.display()
    )]
    SizeMismatch {
        path: PathBuf,
        image_sectors: u64,
        expected_sectors: u64,
    },
    #[error(
        "the descriptor the source passed for disk image {} is not a regular file ({what}); the source VMM passed something else than a raw image",
        path.display()
    )]
    PassedNotAFile { path: PathBuf, what: String },
    #[error(
        "cannot reopen the source's disk image (given here as {}) with this side's options ({source}); start the destination with the source's disk options",
        path.display()
    )]
    Reopen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("disk image {} is already attached; attach a deferred device once", path.display())]
    AlreadyAttached { path: PathBuf },
    #[error(
        "disk image {} is not open yet, so it cannot be copied; a migration's destination opens its image only when the guest's state arrives",
        path.display()
    )]
    NotAttached { path: PathBuf },
    #[error(
        "cannot flush disk image {}: {source}; the guest's last writes may not be on stable storage, check the host's storage before the guest runs elsewhere",
        path.display()
    )]
    Flush {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn readonly_hint(readonly: bool) -> &'static str {
    match readonly {
        true => "",
        false => ", or add ,readonly if the guest only reads it",
    }
}
