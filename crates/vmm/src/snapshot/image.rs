//! A snapshot's record of its disk's image, and the check a restore makes with it.
//!
//! A snapshot holds RAM and device state, not the disk: a restore is given the image
//! (`--disk`), and a guest whose memory remembers one disk and whose image is another reads
//! blocks it never wrote (its file system's caches, journal and allocation maps disagree with
//! the blocks). So a snapshot records the image as its pause left it, after the source's flush
//! (`SourceAdapter::save_state`): the path it was given, its size, its mtime (ns) and a hash of
//! its allocated map (the extents `SEEK_DATA`/`SEEK_HOLE` report). A restore compares the image
//! it is given:
//! - another size: refused, always (the guest's driver sized the disk from the recorded one);
//! - another mtime or allocated map: refused with both values, unless the user says the image
//!   is right ([`ChangedImage::Accept`], `--disk-changed-ok`);
//! - another path alone: taken and said (an image is copied, `cp -a`, to keep it with its
//!   snapshot).
//!
//! The check is cheap, not a hash of the content: an image rewritten in place within the file
//! system's timestamp granularity, leaving its map as it was, passes. It catches what happens in
//! practice: the original image after its guest ran on, a copy made without its timestamps.
//!
//! The record is a section of the snapshot's device state ([`DISK_IMAGE`], `section_ids`), a
//! plain versioned value: written only by a snapshot (never by a migration), found before a
//! restore makes its VM ([`super::describe`]), and skipped by the state load. A snapshot from a
//! ferry older than the record has none, and restores without the check, saying so.

#![forbid(unsafe_code)]

use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use ferry_migrate::wire::SectionId;
use ferry_migrate::{Section, StatePart, VmError};

use crate::part_timer::PartTimer;
use crate::section_ids::DISK_IMAGE;
use crate::vm::disk::DISK_INSTANCE;
use crate::vm::shared::Shared;

/// The record's layout version this ferry writes; the only one it reads (a newer one is left
/// unread, and the restore says the check could not be made).
pub const VERSION: u32 = 1;
/// Fixed bytes of a record before its path: size, mtime, map hash, extents, path length.
const FIXED: usize = 8 + 8 + 8 + 8 + 4;
/// Longest path a record holds: Linux's `PATH_MAX`.
const MAX_PATH: usize = 4096;

/// What a snapshot recorded of its disk's image, or what a restore finds of the one it is
/// given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageCheck {
    /// The path the VM was given (`--disk`), as given.
    pub path: PathBuf,
    pub size: u64,
    /// The last modification, in nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// FNV-1a over the allocated extents, `(start, end)` little-endian, in file order.
    pub map_hash: u64,
    /// How many extents there are (shown beside the hash).
    pub extents: u64,
}

/// Why an image's check could not be taken, or a record read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("cannot read the disk image {path} to check it against the snapshot: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the snapshot's disk image record is damaged: {0}; restore another copy or take a new snapshot"
    )]
    Damaged(&'static str),
}

impl ImageCheck {
    /// Takes the check of `image`, open, whose VM was given it as `path`.
    pub fn of(path: &Path, image: &File) -> Result<ImageCheck, ImageError> {
        let io = |source| ImageError::Io {
            path: path.into(),
            source,
        };
        let meta = image.metadata().map_err(io)?;
        let size = meta.len();
        let (map_hash, extents) = allocated_map(image, size).map_err(io)?;
        Ok(ImageCheck {
            path: path.into(),
            size,
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            map_hash,
            extents,
        })
    }

    /// Opens the image at `path` (read-only) and takes its check.
    pub fn of_path(path: &Path) -> Result<ImageCheck, ImageError> {
        let image = File::open(path).map_err(|source| ImageError::Io {
            path: path.into(),
            source,
        })?;
        ImageCheck::of(path, &image)
    }

    pub fn encode(&self) -> Vec<u8> {
        let path = self.path.as_os_str().as_encoded_bytes();
        let path = &path[..path.len().min(MAX_PATH)];
        let mut out = Vec::with_capacity(FIXED + path.len());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.mtime_ns.to_le_bytes());
        out.extend_from_slice(&self.map_hash.to_le_bytes());
        out.extend_from_slice(&self.extents.to_le_bytes());
        out.extend_from_slice(&(path.len() as u32).to_le_bytes());
        out.extend_from_slice(path);
        out
    }

    pub fn decode(data: &[u8]) -> Result<ImageCheck, ImageError> {
        let (fixed, path) = data
            .split_at_checked(FIXED)
            .ok_or(ImageError::Damaged("shorter than its fixed fields"))?;
        let u64_at = |i: usize| u64::from_le_bytes(fixed[i..i + 8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(fixed[32..36].try_into().expect("4 bytes")) as usize;
        if len > MAX_PATH || len != path.len() {
            return Err(ImageError::Damaged(
                "its path's length is not the bytes that follow",
            ));
        }
        let path = std::str::from_utf8(path)
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(String::from_utf8_lossy(path).into_owned()));
        Ok(ImageCheck {
            path,
            size: u64_at(0),
            mtime_ns: u64_at(8) as i64,
            map_hash: u64_at(16),
            extents: u64_at(24),
        })
    }

    /// What differs between the image a snapshot recorded (`self`) and `now`, the one given
    /// to its restore; the path is not compared (a copy is expected to move).
    pub fn changes(&self, now: &ImageCheck) -> Changes {
        Changes {
            size: (self.size != now.size).then_some((self.size, now.size)),
            mtime: (self.mtime_ns != now.mtime_ns).then_some((self.mtime_ns, now.mtime_ns)),
            map: (self.map_hash != now.map_hash || self.extents != now.extents)
                .then_some(((self.map_hash, self.extents), (now.map_hash, now.extents))),
        }
    }
}

/// What differs between a recorded image and a given one, each as (then, now).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub size: Option<(u64, u64)>,
    pub mtime: Option<(i64, i64)>,
    /// The map's hash and extent count.
    pub map: Option<((u64, u64), (u64, u64))>,
}

impl Changes {
    pub fn none(&self) -> bool {
        *self == Changes::default()
    }
}

/// `secs.nanos`, as `stat` shows an mtime.
struct Mtime(i64);

impl fmt::Display for Mtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, ns) = (
            self.0.div_euclid(1_000_000_000),
            self.0.rem_euclid(1_000_000_000),
        );
        write!(f, "{s}.{ns:09}")
    }
}

/// The mtime and map differences (a size's is its own error), as `mtime 1.5 then, 2.0 now;
/// allocated map ...`.
impl fmt::Display for Changes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some((then, now)) = self.mtime {
            parts.push(format!(
                "its mtime was {} when the snapshot was taken and is {} now",
                Mtime(then),
                Mtime(now)
            ));
        }
        if let Some(((h0, e0), (h1, e1))) = self.map {
            parts.push(format!(
                "its allocated map was {e0} extents (hash {h0:016x}) and is {e1} extents (hash {h1:016x})"
            ));
        }
        write!(f, "{}", parts.join("; "))
    }
}

/// Whether a restore takes an image whose mtime or allocated map changed since its snapshot
/// (`--disk-changed-ok`); another size is refused either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChangedImage {
    #[default]
    Refuse,
    Accept,
}

/// FNV-1a 64's offset basis and prime (Fowler, Noll, Vo): a change detector over a few
/// thousand extents, not a defence against someone forging a map.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The hash of `image`'s allocated extents below `size`, and their count. Two `lseek`s per
/// extent, in the snapshot's pause: the built-in guest's 16 MiB of scattered 4 KiB blocks
/// made 866 extents, walked in 3.1 ms on a debug build here (ext4), so an image written in
/// 100,000 places would cost a third of a second. FIEMAP, or a walk after the resume checked
/// against the mtime, would take it out of the pause; not done yet.
fn allocated_map(image: &File, size: u64) -> std::io::Result<(u64, u64)> {
    let mut hash = FNV_OFFSET;
    let mut extents = 0;
    let mut at = 0;
    while let Some((start, end)) =
        ferry_migrate::ram::next_data_in_file(image.as_raw_fd(), at, size)?
    {
        for b in start.to_le_bytes().into_iter().chain(end.to_le_bytes()) {
            hash = (hash ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        extents += 1;
        at = end;
    }
    Ok((hash, extents))
}

/// The record of `shared`'s disk image as it is now, as a section, and the time it took; `None`
/// for a VM without a disk. Called in a snapshot's pause, after the disk's flush.
pub(crate) fn record(shared: &Shared) -> Result<Option<(Section, StatePart)>, VmError> {
    let (Some(disk), Some(path)) = (&shared.disk, &shared.disk_path) else {
        return Ok(None);
    };
    let fail = |e: String| VmError::failed("record the disk image in the snapshot", e);
    let mut timer = PartTimer::start();
    let (image, _) = disk
        .lock()
        .unwrap()
        .device()
        .image_for_copy()
        .map_err(|e| fail(e.to_string()))?;
    let data = ImageCheck::of(path, &image)
        .map_err(|e| fail(e.to_string()))?
        .encode();
    timer.mark(|| "disk image check".into(), data.len());
    let part = timer.finish().pop().expect("one part marked");
    Ok(Some((
        Section {
            id: DISK_IMAGE,
            instance: DISK_INSTANCE,
            version: VERSION,
            data,
        },
        part,
    )))
}

/// What a snapshot's device state says of its disk image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// No record: a snapshot of a VM without a disk, or from a ferry older than the record.
    Nothing,
    /// A record of a layout this ferry does not read (a newer ferry's).
    Unreadable {
        version: u32,
    },
    Check(ImageCheck),
}

/// The record among a snapshot's `sections`, if any.
pub fn recorded(sections: &[Section]) -> Result<Recorded, ImageError> {
    let Some(s) = sections.iter().find(|s| s.id == DISK_IMAGE) else {
        return Ok(Recorded::Nothing);
    };
    if s.version != VERSION {
        return Ok(Recorded::Unreadable { version: s.version });
    }
    ImageCheck::decode(&s.data).map(Recorded::Check)
}

/// Whether `id` is the record's: the state load skips it.
pub(crate) fn is_record(id: SectionId) -> bool {
    id == DISK_IMAGE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check() -> ImageCheck {
        ImageCheck {
            path: "vm.img".into(),
            size: 64 << 20,
            mtime_ns: 1_795_879_149_982_378_380,
            map_hash: 0x0123_4567_89ab_cdef,
            extents: 12,
        }
    }

    #[test]
    fn a_record_round_trips_and_a_damaged_one_is_refused() {
        let c = check();
        assert_eq!(ImageCheck::decode(&c.encode()).unwrap(), c);
        let bytes = c.encode();
        for cut in [0, FIXED - 1, bytes.len() - 1] {
            assert!(ImageCheck::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(b'x');
        assert!(ImageCheck::decode(&long).is_err());
    }

    #[test]
    fn changes_name_what_differs_and_ignore_the_path() {
        let then = check();
        let moved = ImageCheck {
            path: "/elsewhere/copy.img".into(),
            ..check()
        };
        assert!(then.changes(&moved).none());
        let touched = ImageCheck {
            mtime_ns: then.mtime_ns + 1_500_000_000,
            ..check()
        };
        let c = then.changes(&touched);
        assert_eq!(c.size, None);
        assert_eq!(
            c.to_string(),
            "its mtime was 1795879149.982378380 when the snapshot was taken and is 1795879151.482378380 now"
        );
        let written = ImageCheck {
            map_hash: 7,
            extents: 13,
            ..check()
        };
        let c = then.changes(&written);
        assert_eq!(c.mtime, None);
        assert!(
            c.to_string().contains(
                "was 12 extents (hash 0123456789abcdef) and is 13 extents (hash 0000000000000007)"
            ),
            "{c}"
        );
        let grown = ImageCheck {
            size: 128 << 20,
            ..check()
        };
        assert_eq!(then.changes(&grown).size, Some((64 << 20, 128 << 20)));
    }

    #[test]
    fn the_map_hash_follows_the_images_allocated_extents() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.img");
        let image = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        image.set_len(16 << 20).unwrap();
        let empty = ImageCheck::of(&path, &image).unwrap();
        assert_eq!(empty.extents, 0);
        image.write_all_at(&[1; 4096], 1 << 20).unwrap();
        let one = ImageCheck::of(&path, &image).unwrap();
        assert_eq!((one.extents, one.size), (1, 16 << 20));
        assert_ne!(one.map_hash, empty.map_hash);
        // The same block written again: the map stays, the mtime need not.
        image.write_all_at(&[2; 4096], 1 << 20).unwrap();
        assert_eq!(
            ImageCheck::of(&path, &image).unwrap().map_hash,
            one.map_hash
        );
        image.write_all_at(&[3; 4096], 8 << 20).unwrap();
        let two = ImageCheck::of_path(&path).unwrap();
        assert_eq!(two.extents, 2);
        assert_ne!(two.map_hash, one.map_hash);
    }

    #[test]
    fn a_snapshot_without_a_record_or_with_a_newer_one_is_not_checked() {
        let other = Section {
            id: crate::section_ids::SERIAL,
            instance: 0,
            version: 1,
            data: vec![],
        };
        assert_eq!(
            recorded(std::slice::from_ref(&other)).unwrap(),
            Recorded::Nothing
        );
        let newer = Section {
            id: DISK_IMAGE,
            instance: DISK_INSTANCE,
            version: VERSION + 1,
            data: vec![],
        };
        assert_eq!(
            recorded(&[other, newer]).unwrap(),
            Recorded::Unreadable {
                version: VERSION + 1
            }
        );
    }
}
