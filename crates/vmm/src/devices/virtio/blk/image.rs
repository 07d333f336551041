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
use std::os::fd::AsRawFd;
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

/// Opens the image at `path` as `options` say (read-write unless read-only, O_DIRECT with
/// cache=none).
fn open_as(path: &Path, options: &DiskOptions) -> std::io::Result<File> {
    let direct = options.cache == Cache::None;
    OpenOptions::new()
        .read(true)
        .write(!options.readonly)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
        .open(path)
}

/// An open file's status flags (`F_GETFL`), read from `/proc/self/fdinfo` (its `flags:`
/// line, octal), which needs no `unsafe`.
fn status_flags(file: &File) -> std::io::Result<i32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", file.as_raw_fd()))?;
    info.lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .and_then(|v| i32::from_str_radix(v.trim(), 8).ok())
        .ok_or_else(|| std::io::Error::other("no flags in fdinfo"))
}

/// Whether flags `flags` open the image as `options` ask: the access mode and O_DIRECT.
fn flags_fit(flags: i32, options: &DiskOptions) -> bool {
    let writes = flags & libc::O_ACCMODE == libc::O_RDWR;
    let direct = flags & libc::O_DIRECT != 0;
    (writes, direct) == (!options.readonly, options.cache == Cache::None)
}

/// The cache mode as `--disk` spells it.
fn cache_name(options: &DiskOptions) -> &'static str {
    match options.cache {
        Cache::None => "cache=none",
        Cache::Writeback => "cache=writeback",
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
        let file = open_as(&path, options).map_err(open_error)?;
        Image::over(file, options)
    }

    /// The image over `file`, the descriptor a local handover's source passed for this disk
    /// (the source's own open file, whatever became of its path): the same file, taken over,
    /// not opened again by its name. It must be a regular file. Its access mode and `O_DIRECT`
    /// are status flags of the open file description, which both processes share: where they
    /// differ from `options` (the source ran cache=writeback and this side asks cache=none,
    /// or the reverse), the file is reopened through `/proc/self/fd` with this side's flags, a
    /// description of its own, the same inode; changing the shared one (`F_SETFL`) would
    /// change the source's mode too, and the source runs its guest on if the handover fails.
    /// The size is the device's to check (`Block::attach`).
    pub(super) fn take_over(file: File, options: &DiskOptions) -> Result<Image, BlockError> {
        let path = &options.path;
        let meta = file.metadata().map_err(|source| BlockError::Open {
            path: path.clone(),
            readonly: options.readonly,
            source,
        })?;
        if !meta.is_file() {
            return Err(BlockError::PassedNotAFile {
                path: path.clone(),
                what: format!("{:?}", meta.file_type()),
            });
        }
        let same = |m: &std::fs::Metadata| (m.dev(), m.ino()) == (meta.dev(), meta.ino());
        match std::fs::metadata(path) {
            Ok(m) if same(&m) => {}
            Ok(_) => tracing::warn!(
                "disk: {} names another file than the image the source passed (device {:#x}, \
                 inode {}); the guest keeps the source's image, which it was using",
                path.display(),
                meta.dev(),
                meta.ino()
            ),
            Err(e) => tracing::warn!(
                "disk: {} cannot be read ({e}); the guest keeps the image the source passed \
                 (device {:#x}, inode {}), which it was using",
                path.display(),
                meta.dev(),
                meta.ino()
            ),
        }
        let file = match status_flags(&file) {
            Ok(flags) if flags_fit(flags, options) => file,
            _ => {
                let through = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
                tracing::info!(
                    "disk: the source opened {} otherwise than {} asks here; reopened it, same \
                     file, with this side's options",
                    path.display(),
                    cache_name(options)
                );
                open_as(&through, options).map_err(|source| {
                    match (options.cache, source.raw_os_error()) {
                        (Cache::None, Some(libc::EINVAL)) => BlockError::DirectUnsupported {
                            path: path.clone(),
                            source,
                        },
                        _ => BlockError::Reopen {
                            path: path.clone(),
                            source,
                        },
                    }
                })?
            }
        };
        Image::over(file, options)
    }

    /// The image over an open `file`, checked: with O_DIRECT, a storage that takes the
    /// device's 512-byte sectors.
    fn over(file: File, options: &DiskOptions) -> Result<Image, BlockError> {
        let path = options.path.clone();
        let direct = options.cache == Cache::None;
        let meta = file.metadata().map_err(|source| BlockError::Open {
            path: path.clone(),
            readonly: options.readonly,
            source,
        })?;
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

    /// A second descriptor of the image's open file description (`dup`), for a local
    /// handover to pass to the VMM that takes the guest over.
    pub(super) fn descriptor(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.file.try_clone().map(Into::into)
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

    /// A second, read-only descriptor of the same file (reopened through `/proc/self/fd`, so
    /// the same inode whatever became of its path, and buffered whatever the cache mode: a
    /// copier's reads need no alignment).
    pub(super) fn try_clone(&self) -> std::io::Result<File> {
        File::open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// Makes written data durable (fdatasync).
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
