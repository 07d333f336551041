//! The host side of a disk: a raw image file, opened with or without O_DIRECT, and the I/O
//! the requests need on it, all through one 4096-aligned bounce buffer.
//!
//! Why a bounce buffer rather than reading and writing guest memory directly: guest memory
//! is written only through the dirty-tracked `GuestRam::memory()` (see the module doc of
//! `virtio`), and O_DIRECT needs memory aligned to the storage's block, which the guest's
//! buffers need not be. One copy through a buffer allocated once per device serves both
//! cache modes with one code path and no `unsafe`.
//!
//! Invariant: every read and write here is at a file offset and of a length the caller has
//! checked against the capacity and made whole sectors, so with O_DIRECT each is 512-aligned
//! in offset, length and memory.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ferry_guest_abi::virtio::blk::SECTOR_SIZE;
use vmm_sys_util::fallocate::{FallocateMode, fallocate};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::error::BlockError;
use super::options::{Cache, DiskOptions};
use super::spec::{DiskId, disk_id};

/// Bytes moved per bounce: 1 MiB is past the size where a read or write costs its bytes
/// rather than its system call (Linux issues requests of at most 1.25 MiB by default,
/// `BLK_DEF_MAX_SECTORS`), and small enough to keep per device.
pub(super) const CHUNK: usize = 1 << 20;

/// One page of the bounce buffer: its alignment makes the buffer's start, and so every I/O
/// from it, 4096-aligned, which O_DIRECT needs on any storage this device accepts.
#[derive(Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// The bounce buffer's bytes, allocated at first use.
fn bounce(pages: &mut Vec<Page>) -> &mut [u8] {
    if pages.is_empty() {
        *pages = vec![Page([0; 4096]); CHUNK / 4096];
    }
    pages.as_mut_bytes()
}

/// An open raw image.
pub(super) struct Image {
    file: File,
    path: PathBuf,
    sectors: u64,
    id: DiskId,
    /// [`CHUNK`] bytes, allocated at the first request that moves data.
    bounce: Vec<Page>,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("path", &self.path)
            .field("sectors", &self.sectors)
            .finish_non_exhaustive()
    }
}

/// The file's error as an `io::Error` (vmm-sys-util's carries only the errno).
fn io(e: vmm_sys_util::errno::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.errno())
}

impl Image {
    /// Opens the image as `options` says.
    pub(super) fn open(options: &DiskOptions) -> Result<Image, BlockError> {
        let path = options.path.clone();
        let direct = options.cache == Cache::None;
        let open_error = |source: std::io::Error| match source.kind() {
            ErrorKind::NotFound => BlockError::Missing { path: path.clone() },
            _ if direct && source.raw_os_error() == Some(libc::EINVAL) => {
                BlockError::DirectUnsupported {
                    path: path.clone(),
                    source,
                }
            }
            _ => BlockError::Open {
                path: path.clone(),
                readonly: options.readonly,
                source,
            },
        };
        let meta = std::fs::metadata(&path).map_err(open_error)?;
        if !meta.is_file() {
            return Err(BlockError::NotAFile { path: path.clone() });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(!options.readonly)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(&path)
            .map_err(open_error)?;
        let meta = file.metadata().map_err(open_error)?;
        let mut image = Image {
            sectors: meta.len() / SECTOR_SIZE,
            id: disk_id(meta.dev(), meta.ino()),
            file,
            path,
            bounce: Vec::new(),
        };
        if direct && image.sectors > 0 {
            // A storage whose block is larger than a sector refuses a 512-byte direct read:
            // find out now rather than at the guest's first odd sector.
            if let Err(source) = image.read(0, SECTOR_SIZE as usize).map(drop) {
                let path = image.path;
                return Err(match source.raw_os_error() {
                    Some(libc::EINVAL) => BlockError::DirectAlignment { path, source },
                    _ => BlockError::Open {
                        path,
                        readonly: options.readonly,
                        source,
                    },
                });
            }
        }
        Ok(image)
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Whole 512-byte sectors (a partial last sector is not counted).
    pub(super) fn sectors(&self) -> u64 {
        self.sectors
    }

    pub(super) fn id(&self) -> DiskId {
        self.id
    }

    /// The first `len` bytes (at most [`CHUNK`]) of the bounce buffer.
    pub(super) fn buffer(&mut self, len: usize) -> &mut [u8] {
        &mut bounce(&mut self.bounce)[..len]
    }

    /// Reads `len` bytes at `offset` into the bounce buffer and returns them. Bytes past the
    /// end of the file (a file shrunk under the device) read as zeros, as a raw image's would.
    pub(super) fn read(&mut self, offset: u64, len: usize) -> std::io::Result<&[u8]> {
        let file = &self.file;
        let buf = &mut bounce(&mut self.bounce)[..len];
        let mut done = 0;
        while done < len {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(buf)
    }

    /// Writes the first `len` bytes of the bounce buffer at `offset`.
    pub(super) fn write(&mut self, offset: u64, len: usize) -> std::io::Result<()> {
        let buf = &bounce(&mut self.bounce)[..len];
        self.file.write_all_at(buf, offset)
    }

    /// Makes written data durable (fdatasync).
    /// A second, read-only descriptor of the same file (reopened through `/proc/self/fd`, so
    /// the same inode whatever became of its path, and buffered whatever the cache mode: a
    /// copier's reads need no alignment).
    pub(super) fn try_clone(&self) -> std::io::Result<File> {
        use std::os::fd::AsRawFd;
        File::open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    pub(super) fn flush(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Deallocates `[offset, offset + len)`: it reads as zeros, and whole file system blocks
    /// in it are given back.
    pub(super) fn punch(&self, offset: u64, len: u64) -> std::io::Result<()> {
        fallocate(&self.file, FallocateMode::PunchHole, true, offset, len).map_err(io)
    }

    /// Makes `[offset, offset + len)` read as zeros, keeping it allocated: the file system
    /// zeroes the range if it can, else zeros are written, a bounce at a time.
    pub(super) fn zero(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        match fallocate(&self.file, FallocateMode::ZeroRange, true, offset, len) {
            Ok(()) => return Ok(()),
            Err(e) if e.errno() == libc::EOPNOTSUPP => {}
            Err(e) => return Err(io(e)),
        }
        self.buffer(CHUNK).fill(0);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK as u64);
            self.write(offset + done, n as usize)?;
            done += n;
        }
        Ok(())
    }
}
