//! The destination's side of a disk copy: chunks land in a file beside the image,
//! `<image>.ferry-incoming`, which becomes the image only when the guest's state is loaded
//! (a rename, so the image is whole or absent). A copy that ends any other way (cancelled,
//! failed, the source gone) removes that file, and the image the user named stays as it was:
//! absent, or empty.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::chunk::Chunk;
use super::writeback::{Progress, Writeback};

/// Why a chunk could not land, or the copy could not become the image.
#[derive(Debug, thiserror::Error)]
pub enum IncomingError {
    #[error(
        "the destination's image {path} holds {bytes} bytes: a disk copy writes only into an empty or missing file, so that no data is overwritten; give a new path to --disk, or remove the file"
    )]
    NotEmpty { path: PathBuf, bytes: u64 },
    #[error(
        "{} is in the way of the disk copy (left by a migration that was killed?); remove it and start the migration again",
        path.display()
    )]
    InTheWay { path: PathBuf },
    #[error("the source's disk is {0} bytes in one chunk and {1} in another")]
    Capacity(u64, u64),
    #[error("cannot write the copied disk to {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The copy arriving for one disk.
#[derive(Debug)]
pub struct IncomingCopy {
    image: PathBuf,
    part: PathBuf,
    file: File,
    capacity: u64,
    /// Bytes of ranges written with data, and written as zeros.
    pub data_bytes: u64,
    pub zero_bytes: u64,
    finished: bool,
    /// Syncs the copy as it arrives and counts what is on storage ([`IncomingCopy::ready`]).
    progress: Arc<Progress>,
    _writeback: Option<Writeback>,
}

/// The most of a copy not yet on storage with which the destination says it is ready for the
/// switchover: what the guest's first flush after the resume may have to write (about 0.1 s
/// of this host's storage).
pub const READY_UNSYNCED: u64 = 32 << 20;

impl IncomingCopy {
    /// Starts the copy of a disk of `capacity` bytes that will become `image`, which must be
    /// missing or empty.
    pub fn begin(image: &Path, capacity: u64) -> Result<IncomingCopy, IncomingError> {
        let io = |source| IncomingError::Io {
            path: image.into(),
            source,
        };
        match std::fs::metadata(image) {
            Ok(m) if m.len() > 0 => {
                return Err(IncomingError::NotEmpty {
                    path: image.into(),
                    bytes: m.len(),
                });
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        let mut part = image.as_os_str().to_owned();
        part.push(".ferry-incoming");
        let part = PathBuf::from(part);
        // A file of its own, made here (O_EXCL: never through a link someone planted, never
        // over a file that is there) and readable by this user alone: it holds the guest's disk.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&part)
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::AlreadyExists => IncomingError::InTheWay { path: part.clone() },
                _ => io(source),
            })?;
        let progress = Arc::new(Progress::default());
        let writeback = file
            .try_clone()
            .ok()
            .and_then(|f| Writeback::tracking(f, progress.clone()));
        let copy = IncomingCopy {
            image: image.into(),
            part,
            file,
            capacity,
            data_bytes: 0,
            zero_bytes: 0,
            finished: false,
            progress,
            _writeback: writeback,
        };
        copy.file.set_len(capacity).map_err(|e| copy.io(e))?;
        Ok(copy)
    }

    /// Writes one chunk. A range of zeros is written as zeros: the file started sparse, so
    /// only a range the copy wrote with data before reads otherwise.
    pub fn apply(&mut self, chunk: &Chunk<'_>) -> Result<(), IncomingError> {
        if chunk.capacity != self.capacity {
            return Err(IncomingError::Capacity(self.capacity, chunk.capacity));
        }
        match &chunk.data {
            Some(data) => {
                self.file
                    .write_all_at(data, chunk.offset)
                    .map_err(|e| self.io(e))?;
                self.data_bytes += chunk.len;
                self.progress.written.fetch_add(chunk.len, Ordering::AcqRel);
            }
            None => {
                let zeros = vec![0u8; chunk.len as usize];
                self.file
                    .write_all_at(&zeros, chunk.offset)
                    .map_err(|e| self.io(e))?;
                self.zero_bytes += chunk.len;
                self.progress.written.fetch_add(chunk.len, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    /// Whether all but [`READY_UNSYNCED`] of what arrived is on storage: the destination's
    /// readiness for the switchover (QEMU's switchover-ack), so that the guest does not pay
    /// for the copy's writeback after its resume.
    pub fn ready(&self) -> bool {
        let written = self.progress.written.load(Ordering::Acquire);
        written.saturating_sub(self.progress.synced.load(Ordering::Acquire)) <= READY_UNSYNCED
    }

    /// The disk's size, as the chunks say.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Makes the copy the image: renamed over the path the user named. Not synced here: that
    /// would be in the guest's pause (about 100 ms for 40 MB here). A background thread
    /// synced it as it arrived, and the switchover waited for it ([`IncomingCopy::ready`]);
    /// what came since its last sync is as durable as a write the guest has not flushed yet,
    /// and the guest's next flush (an fdatasync of the same file) makes it durable.
    pub fn finish(mut self) -> Result<(), IncomingError> {
        std::fs::rename(&self.part, &self.image).map_err(|e| self.io(e))?;
        self.finished = true;
        Ok(())
    }

    fn io(&self, source: std::io::Error) -> IncomingError {
        IncomingError::Io {
            path: self.part.clone(),
            source,
        }
    }
}

impl Drop for IncomingCopy {
    /// A copy that did not become the image goes: half a disk is no disk.
    fn drop(&mut self) {
        if !self.finished
            && let Err(e) = std::fs::remove_file(&self.part)
        {
            tracing::warn!(
                "cannot remove the unfinished disk copy {}: {e}",
                self.part.display()
            );
        }
    }
}
