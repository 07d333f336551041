//! A snapshot file on disk (docs/snapshot.md): the [`Writer`] that fills one in parallel with
//! positioned writes and makes it complete only at the end (its reader is `read.rs`).
//!
//! Invariants:
//! - Until [`Writer::finish`] returns, the file is `PATH.XXXXXX.partial` with a header that
//!   says it is incomplete: a snapshot that fails half way leaves nothing that reads as a
//!   snapshot.
//! - Every page the writer is given is recorded in the CRC table as it is written, so a later
//!   pass that overwrites a page leaves the table matching the file; a zero page is a hole
//!   (punched, if a page was written there before) with the zero page's CRC.

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::error::{SnapshotError, zero_page_crc};
use super::format::{Header, MAGIC, MAX_STATE_BYTES};
use crate::wire::{PAGE_SIZE, crc};

/// A page of memory aligned to its size, as direct I/O (`O_DIRECT`) needs its buffers.
#[derive(
    Clone, zerocopy::FromBytes, zerocopy::IntoBytes, zerocopy::Immutable, zerocopy::KnownLayout,
)]
#[repr(C, align(4096))]
pub(crate) struct AlignedPage([u8; PAGE_SIZE as usize]);

/// A buffer of whole pages at a page-aligned address: what the snapshot's writers fill and
/// write, with or without direct I/O.
pub(crate) struct PageBuf(Vec<AlignedPage>);

impl PageBuf {
    /// `pages` zeroed pages (the memory is touched: see [`PageBuf::touch`] for why it matters).
    pub(crate) fn new(pages: usize) -> PageBuf {
        PageBuf(vec![AlignedPage([0; PAGE_SIZE as usize]); pages])
    }

    /// Writes a byte of every page, so that none is still to be faulted in when it is used.
    pub(crate) fn touch(&mut self) {
        for p in &mut self.0 {
            p.0[0] = 1;
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        zerocopy::IntoBytes::as_bytes(&self.0[..])
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        zerocopy::IntoBytes::as_mut_bytes(&mut self.0[..])
    }
}

/// Mode of a new snapshot file unless the request names another: it holds the whole of guest
/// RAM, so only its owner reads it.
pub const DEFAULT_MODE: u32 = 0o600;

/// What may stand at the snapshot's path before it is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Replace {
    /// Nothing, or an earlier ferry snapshot (a regular file that starts with its magic),
    /// which the new one replaces once complete.
    #[default]
    Snapshot,
    /// Anything but a directory: the request says to replace it.
    Any,
}

/// How a snapshot file is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileOptions {
    /// Write the pages with direct I/O (`O_DIRECT`), past the page cache.
    pub direct_io: bool,
    /// The file's mode (permission bits), set exactly, whatever the umask.
    pub mode: u32,
    /// What may stand at the path already.
    pub replace: Replace,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            direct_io: false,
            mode: DEFAULT_MODE,
            replace: Replace::Snapshot,
        }
    }
}

/// Fills a snapshot file; shared by the threads that write pages (`&self`).
#[derive(Debug)]
pub struct Writer {
    file: File,
    /// With direct I/O, a second descriptor of the file opened `O_DIRECT`, for the pages (the
    /// metadata areas are not whole pages, so they go through `file`).
    direct: Option<File>,
    /// `PATH.XXXXXX.partial`, made with `O_EXCL` (so never through a planted symlink and never
    /// shared by two snapshots to one path). Removed when dropped: a writer dropped before it
    /// finished leaves nothing of a snapshot that failed, whatever step failed.
    partial: tempfile::TempPath,
    path: PathBuf,
    replace: Replace,
    header: Header,
    /// Room reserved for the device state and the hot set (their lengths come at the end).
    reserved: (u64, u64),
    crcs: Vec<AtomicU32>,
    /// The file system refused to punch a hole: zero pages are written as zeros.
    pub(super) no_punch: AtomicBool,
}

/// The most zeros written at once where holes cannot be punched: 1 MiB, a few hundred
/// microseconds of a disk's bandwidth, so a writer's buffer stays small.
const ZERO_WRITE_BYTES: u64 = 1 << 20;

/// The error of an I/O step on `path`: the file size limit named as such (with SIGXFSZ caught,
/// a write past it fails with `EFBIG` instead of killing the process).
fn io_error(during: &'static str, path: &Path, source: std::io::Error) -> SnapshotError {
    let path = path.to_owned();
    match source.raw_os_error() {
        Some(libc::EFBIG) => SnapshotError::FileSizeLimit { path, source },
        _ => SnapshotError::Io {
            during,
            path,
            source,
        },
    }
}

/// The directory `path` is in.
fn directory(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// What stands at `path`, if anything, and whether a snapshot may replace it.
fn check_replaceable(path: &Path, replace: Replace) -> Result<(), SnapshotError> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(io_error("looking at", path, source)),
        Ok(m) => m,
    };
    let kind = meta.file_type();
    let what = if kind.is_dir() {
        "a directory"
    } else if kind.is_symlink() {
        "a symbolic link"
    } else if !kind.is_file() {
        "a special file"
    } else {
        use std::os::unix::fs::OpenOptionsExt;
        let mut start = [0u8; MAGIC.len()];
        // Never through a link, never blocking (a FIFO swapped in since the lstat): only a
        // regular file, as its own descriptor says, is read.
        let magic = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .and_then(|f| {
                if !f.metadata()?.is_file() {
                    return Err(std::io::ErrorKind::InvalidInput.into());
                }
                f.read_exact_at(&mut start, 0)
            })
            .is_ok()
            && start == MAGIC;
        if magic {
            return Ok(());
        }
        "a file that is not a ferry snapshot"
    };
    match (replace, kind.is_dir()) {
        (Replace::Any, false) => Ok(()),
        (Replace::Any, true) | (Replace::Snapshot, _) => Err(SnapshotError::Exists {
            path: path.to_owned(),
            what,
        }),
    }
}

impl Writer {
    /// Creates `PATH.XXXXXX.partial` (see [`Writer`]) for a VM of `vcpus` vCPUs with RAM
    /// `regions` (`(gpa, size)`) and `config`, sized to hold all of RAM (a sparse file), with
    /// room for the device state's bound and the largest hot set a writer makes, and an
    /// incomplete header. Refuses a path that holds what `options.replace` does not allow.
    pub fn create(
        path: &Path,
        vcpus: u32,
        uuid: [u8; 16],
        regions: &[(u64, u64)],
        config: &[u8],
        options: &FileOptions,
    ) -> Result<Writer, SnapshotError> {
        check_replaceable(path, options.replace)?;
        let pages: u64 = regions.iter().map(|r| r.1 / PAGE_SIZE).sum();
        let mut header = Header::layout(
            vcpus,
            uuid,
            regions,
            config.len() as u64,
            MAX_STATE_BYTES,
            super::hot::max_hot_runs(regions),
        );
        let reserved = (header.state.len, header.hot.len);
        let name = path.file_name().ok_or_else(|| SnapshotError::Exists {
            path: path.to_owned(),
            what: "a path that names no file",
        })?;
        let mut prefix = name.to_owned();
        prefix.push(".");
        // O_CREAT | O_EXCL: never opens what is there already, a symlink included.
        let (file, partial) = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".partial")
            .permissions(std::fs::Permissions::from_mode(options.mode))
            .tempfile_in(directory(path))
            .map_err(|e| io_error("creating a file beside", path, e))?
            .into_parts();
        let at: &Path = &partial;
        let io = |during| move |source| io_error(during, at, source);
        // Exactly the mode asked for: the umask applied to the create.
        file.set_permissions(std::fs::Permissions::from_mode(options.mode))
            .map_err(io("setting the mode of"))?;
        file.set_len(header.file_len()).map_err(io("sizing"))?;
        file.write_all_at(config, header.config.offset)
            .map_err(io("writing the configuration to"))?;
        header.config_crc = crc(config);
        file.write_all_at(&header.encode(), 0)
            .map_err(io("writing the header of"))?;
        let direct = match options.direct_io {
            false => None,
            true => {
                use std::os::unix::fs::OpenOptionsExt;
                let opened = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW)
                    .open(&partial);
                Some(opened.map_err(|source| SnapshotError::NoDirectIo {
                    path: path.to_owned(),
                    source,
                })?)
            }
        };
        let zero = zero_page_crc();
        let crcs = (0..pages).map(|_| AtomicU32::new(zero)).collect();
        Ok(Writer {
            file,
            direct,
            partial,
            path: path.to_owned(),
            replace: options.replace,
            header,
            reserved,
            crcs,
            no_punch: AtomicBool::new(false),
        })
    }

    fn io(&self, during: &'static str) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
        move |source| io_error(during, &self.partial, source)
    }

    /// Writes the page at `gpa` (4096 bytes) where it belongs, and records its CRC. A page of
    /// zeros is punched instead (a hole reads as zeros and takes no space).
    pub fn write_page(&self, gpa: u64, page: &[u8]) -> Result<(), SnapshotError> {
        self.write_pages(&[gpa], page).map(drop)
    }

    /// Writes `data`, one page per address of `gpas`, where the pages belong, and records their
    /// CRCs: the pages that follow one another in the file in one write, and each run of zero
    /// pages punched in one call (or left alone where the file holds zeros already: a page
    /// never written, or punched before). Returns how many of the pages were zeros.
    pub fn write_pages(&self, gpas: &[u64], data: &[u8]) -> Result<u64, SnapshotError> {
        assert_eq!(data.len() as u64, gpas.len() as u64 * PAGE_SIZE);
        let zero_crc = zero_page_crc();
        // The run being gathered: (file offset, first page's index in `data`, pages, zeros).
        let mut run: Option<(u64, usize, usize, bool)> = None;
        let mut zeros = 0;
        for (k, (&gpa, page)) in gpas
            .iter()
            .zip(data.chunks_exact(PAGE_SIZE as usize))
            .enumerate()
        {
            let (at, index) = self
                .header
                .locate(gpa)
                .ok_or(SnapshotError::OutsideRam { gpa })?;
            let slot = &self.crcs[index as usize];
            let zero = crate::zero::is_zero(page);
            zeros += u64::from(zero);
            if zero && slot.load(Ordering::Relaxed) == zero_crc {
                self.flush_run(run.take(), data)?;
                continue;
            }
            slot.store(if zero { zero_crc } else { crc(page) }, Ordering::Relaxed);
            match &mut run {
                Some((start, _, pages, z))
                    if *z == zero && *start + *pages as u64 * PAGE_SIZE == at =>
                {
                    *pages += 1
                }
                _ => {
                    self.flush_run(run.take(), data)?;
                    run = Some((at, k, 1, zero));
                }
            }
        }
        self.flush_run(run, data)?;
        Ok(zeros)
    }

    /// Writes (or punches) a run [`Writer::write_pages`] gathered.
    fn flush_run(
        &self,
        run: Option<(u64, usize, usize, bool)>,
        data: &[u8],
    ) -> Result<(), SnapshotError> {
        let Some((at, first, pages, zero)) = run else {
            return Ok(());
        };
        let page = PAGE_SIZE as usize;
        if zero {
            return self.punch(at, pages as u64 * PAGE_SIZE);
        }
        // With direct I/O the offsets and lengths are whole pages, and the callers' buffers
        // page-aligned (`PageBuf`).
        self.direct
            .as_ref()
            .unwrap_or(&self.file)
            .write_all_at(&data[first * page..(first + pages) * page], at)
            .map_err(self.io("writing pages to"))
    }

    /// Makes `len` bytes at `at` zeros: a hole, or written zeros on a file system that cannot
    /// punch one (found at its first refusal, then not asked again).
    fn punch(&self, at: u64, len: u64) -> Result<(), SnapshotError> {
        use std::os::fd::AsFd;
        if !self.no_punch.load(Ordering::Relaxed) {
            let punched = nix::fcntl::fallocate(
                self.file.as_fd(),
                nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                    | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                at as i64,
                len as i64,
            );
            match punched {
                Ok(()) => return Ok(()),
                Err(nix::errno::Errno::EOPNOTSUPP) => self.no_punch.store(true, Ordering::Relaxed),
                Err(e) => {
                    return Err(self.io("punching zero pages out of")(std::io::Error::from(
                        e,
                    )));
                }
            }
        }
        let zeros = PageBuf::new(len.min(ZERO_WRITE_BYTES).div_ceil(PAGE_SIZE) as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZERO_WRITE_BYTES);
            self.direct
                .as_ref()
                .unwrap_or(&self.file)
                .write_all_at(&zeros.bytes()[..n as usize], at + done)
                .map_err(self.io("writing zero pages to"))?;
            done += n;
        }
        Ok(())
    }

    /// Ends the snapshot: writes the device `state` (sections as a migration carries them) and
    /// the `hot` runs, the CRC table, then, once all of it is on disk, the complete header;
    /// renames the file to its name. Returns the header written.
    pub fn finish(mut self, state: &[u8], hot: &[(u64, u64)]) -> Result<Header, SnapshotError> {
        let hot_bytes: Vec<u8> = hot
            .iter()
            .flat_map(|&(gpa, pages)| gpa.to_le_bytes().into_iter().chain(pages.to_le_bytes()))
            .collect();
        for (what, len, reserved) in [
            ("the device state", state.len() as u64, self.reserved.0),
            ("the hot set", hot_bytes.len() as u64, self.reserved.1),
        ] {
            if len > reserved {
                return Err(SnapshotError::TooLarge {
                    what,
                    len,
                    reserved,
                });
            }
        }
        let table: Vec<u8> = self
            .crcs
            .iter()
            .flat_map(|c| c.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        let h = &mut self.header;
        h.state.len = state.len() as u64;
        h.state_crc = crc(state);
        h.hot.len = hot_bytes.len() as u64;
        h.hot_crc = crc(&hot_bytes);
        h.crc_table_crc = crc(&table);
        h.complete = true;
        let (state_at, hot_at, table_at) = (h.state.offset, h.hot.offset, h.crc_table);
        let header = h.encode();
        let file = &self.file;
        file.write_all_at(state, state_at)
            .map_err(self.io("writing the device state to"))?;
        file.write_all_at(&hot_bytes, hot_at)
            .map_err(self.io("writing the hot set to"))?;
        file.write_all_at(&table, table_at)
            .map_err(self.io("writing the page checksums to"))?;
        file.sync_data().map_err(self.io("syncing"))?;
        file.write_all_at(&header, 0)
            .map_err(self.io("writing the header of"))?;
        file.sync_data().map_err(self.io("syncing"))?;
        // Looked at again: something may have been put there while the pages were written.
        check_replaceable(&self.path, self.replace)?;
        let Writer {
            partial,
            path,
            header,
            ..
        } = self;
        partial
            .persist(&path)
            .map_err(|e| io_error("renaming its partial file to", &path, e.error))?;
        // The rename is on disk only once the directory is.
        File::open(directory(&path))
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error("syncing the directory of", &path, e))?;
        Ok(header)
    }
}
