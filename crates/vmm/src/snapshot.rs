//! Snapshots of this VMM's VMs: a live save to a file through the engine's
//! [`ferry_migrate::snapshot::save()`] (`PUT /snapshot`, `ferry snapshot`), and a restore into a
//! VM made from what the file describes (`ferry run --restore`).
//!
//! A snapshot runs in the migration's slot: `GET /migration` follows it, `ferry cancel`
//! cancels it, and a migration cannot start while it runs (nor it while one does). It never
//! hands the guest over (`Progress::handed_over` stays false): the guest runs on here, or stays
//! paused with `stop`.
//!
//! A snapshot does not hold the disk: it records the image its pause left (`image`), and a
//! restore checks the `--disk` it is given against that record before it makes the VM.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_migrate::snapshot::{
    self, AfterSave, FileOptions, Loading, Reader, Replace, RestoreParams, Restored, SaveParams,
};
use ferry_migrate::{Control, MigrateError, Policy, TimeoutAction};
use serde::{Deserialize, Serialize};

pub use self::image::{ChangedImage, ImageCheck};

use crate::migration::StartError;
use crate::request::RequestError;
use crate::vm::Arrival;
use crate::vm::build::Vm;
use crate::vm::handle::VmHandle;
use crate::vmconfig::VmDescription;
use crate::{VmConfig, VmmError};

pub mod image;

/// The body of `PUT /snapshot`: every field but `to` optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnapshotRequest {
    /// The file to write (`FILE.XXXXXX.partial` until it is complete), a path on the VMM's host.
    pub to: PathBuf,
    /// Leave the guest paused once the snapshot is complete (a save before shutdown): the
    /// engine's [`AfterSave::Stop`], a bool in the API's JSON (`"stop": true`).
    pub stop: bool,
    /// Threads writing pages into the file at once.
    pub writers: u16,
    /// The longest pause the snapshot may cause at the rate the file takes pages.
    pub downtime_limit_ms: u64,
    /// Throttle the guest when it dirties memory faster than the file takes it.
    pub auto_converge: bool,
    /// Give up converging this long after the start, and pause anyway; `None`: never.
    pub timeout_ms: Option<u64>,
    /// Write the pages with direct I/O (`O_DIRECT`), past the page cache.
    pub direct_io: bool,
    /// The file's permission bits, in octal ("0600": only the VMM's user reads the guest's
    /// RAM in it).
    pub mode: String,
    /// What may stand at `to` already: `"snapshot"` (nothing, or an earlier ferry snapshot)
    /// or `"any"` (anything but a directory).
    pub replace: Replace,
    /// Most bytes of memory the final pass is staged in; the rest of it is written to the file
    /// during the pause.
    pub staging_limit: u64,
}

impl Default for SnapshotRequest {
    fn default() -> Self {
        SnapshotRequest {
            to: PathBuf::new(),
            stop: false,
            writers: 2,
            downtime_limit_ms: 20,
            auto_converge: true,
            timeout_ms: None,
            direct_io: false,
            mode: format!("{:04o}", snapshot::file::DEFAULT_MODE),
            replace: Replace::Snapshot,
            staging_limit: snapshot::DEFAULT_STAGING_LIMIT,
        }
    }
}

impl SnapshotRequest {
    fn params(&self, vcpus: u32) -> Result<SaveParams, RequestError> {
        if self.to.as_os_str().is_empty() {
            return Err(RequestError::NoSnapshotFile);
        }
        let mode = u32::from_str_radix(self.mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| m & !0o777 == 0)
            .ok_or_else(|| RequestError::SnapshotMode {
                mode: self.mode.clone(),
            })?;
        Ok(SaveParams {
            writers: self.writers,
            policy: Policy {
                downtime_limit: Duration::from_millis(self.downtime_limit_ms),
                timeout: self.timeout_ms.map(Duration::from_millis),
                // A snapshot that cannot converge pauses the guest and writes the rest: a save
                // has no peer to give up on.
                timeout_action: TimeoutAction::Switchover,
                auto_converge: self
                    .auto_converge
                    .then(ferry_migrate::AutoConverge::default),
                converge_by: Default::default(),
            },
            vcpus,
            uuid: crate::migration::migration_uuid(),
            after: match self.stop {
                true => AfterSave::Stop,
                false => AfterSave::Resume,
            },
            staging_limit: self.staging_limit,
            file: FileOptions {
                direct_io: self.direct_io,
                mode,
                replace: self.replace,
            },
        })
    }
}

impl VmHandle {
    /// Starts a live snapshot into `req.to` in a thread of its own; returns its control at
    /// once (the migration's slot, see the module doc).
    pub fn start_snapshot(&self, req: SnapshotRequest) -> Result<Arc<Control>, StartError> {
        let mut slot = self.migration_slot()?;
        let params = req.params(self.0.vcpus().len() as u32)?;
        let control = Arc::new(Control::with_events(self.0.events.clone()));
        *slot = Some(control.clone());
        let mut adapter = self.snapshot_source();
        let thread_control = control.clone();
        std::thread::Builder::new()
            .name("snapshot".into())
            .spawn(
                move || match snapshot::save(&mut adapter, &req.to, &params, &thread_control) {
                    Ok(_) => tracing::info!("snapshot written to {}", req.to.display()),
                    Err(e) => tracing::warn!("snapshot failed: {e}"),
                },
            )
            .map_err(|e| MigrateError::io("starting the snapshot thread", e))?;
        Ok(control)
    }
}

/// What a snapshot file says about the VM it holds, for making a VM to restore it into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotVm {
    pub memory_bytes: u64,
    pub vcpus: u8,
    pub balloon: bool,
    pub disk: SnapshotDisk,
    /// Whether the VM had a NIC: its restore needs a tap (`--net`).
    pub net: bool,
}

/// What a snapshot says of its VM's disk, which it does not hold: a restore needs the image
/// (`--disk`), checked against the record when there is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SnapshotDisk {
    /// The VM had none.
    Absent,
    /// It had one, and the snapshot records no check of its image: written by a ferry older
    /// than the record (`None`), or in a record layout newer than this ferry reads.
    Unchecked { newer_record: Option<u32> },
    /// It had one, recorded as the snapshot's pause left it.
    Recorded(ImageCheck),
}

/// Why a snapshot cannot be restored with the disk it was given.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotDiskError {
    #[error(
        "{0} is a snapshot of a VM with a disk, which a snapshot does not hold: give --disk with the image as it was when the snapshot was taken (a copy of it, for a clone)"
    )]
    NoDisk(String),
    #[error("{0} is a snapshot of a VM without a disk: restore it without --disk")]
    Disk(String),
    #[error(
        "{file}: the disk image {given} is {now} bytes and was {then} bytes when the snapshot was taken, so its guest would find another disk: restore with the image the snapshot was taken with (or a copy of it made with `cp -a`)"
    )]
    Size {
        file: String,
        given: String,
        then: u64,
        now: u64,
    },
    #[error(
        "{file}: the disk image {given} changed since the snapshot was taken ({changes}), so its guest would read blocks it did not leave there: restore with the image the snapshot was taken with (a copy made while the guest was paused, with `cp -a`, which keeps the mtime), or pass --disk-changed-ok if this image is right"
    )]
    Changed {
        file: String,
        given: String,
        changes: Box<image::Changes>,
    },
    #[error(transparent)]
    Image(#[from] image::ImageError),
}

/// What a restore says about the disk it was given and took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskNote {
    /// Not the path the snapshot recorded (a copy), and the check matched.
    Moved { recorded: PathBuf, given: PathBuf },
    /// The snapshot records no check of its image.
    Unchecked { newer_record: Option<u32> },
    /// Changed since the snapshot, and taken on the user's word (`--disk-changed-ok`).
    ChangedTaken {
        given: PathBuf,
        changes: image::Changes,
    },
}

impl std::fmt::Display for DiskNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiskNote::Moved { recorded, given } => write!(
                f,
                "the disk image is {}, the snapshot was taken with {}: its size, mtime and allocated map match",
                given.display(),
                recorded.display()
            ),
            DiskNote::Unchecked { newer_record: None } => write!(
                f,
                "the snapshot records no check of its disk image (an older ferry wrote it): the image given could not be checked; make sure it is the one the snapshot was taken with"
            ),
            DiskNote::Unchecked {
                newer_record: Some(v),
            } => write!(
                f,
                "the snapshot's disk image record is of layout {v}, newer than this ferry reads ({}): the image given could not be checked",
                image::VERSION
            ),
            DiskNote::ChangedTaken { given, changes } => write!(
                f,
                "the disk image {} changed since the snapshot was taken ({changes}); restoring with it anyway (--disk-changed-ok)",
                given.display()
            ),
        }
    }
}

impl SnapshotVm {
    /// Refuses a restore of `file` with a NIC (`given`) when the snapshot's VM had none, or
    /// without one when it had one, naming the fix.
    pub fn check_net(&self, file: &Path, given: bool) -> Result<(), String> {
        match (self.net, given) {
            (true, false) => Err(format!(
                "{}: the snapshot's VM has a NIC; restore it with --net tap=NAME (the tap it comes up on; a clone gets a new MAC unless mac= is given)",
                file.display()
            )),
            (false, true) => Err(format!(
                "{}: the snapshot's VM has no NIC; restore it without --net",
                file.display()
            )),
            _ => Ok(()),
        }
    }

    /// Refuses a restore of `file` whose `--disk` (`given`, or none) does not match the VM the
    /// snapshot was taken of, or whose image differs from the one recorded (a changed mtime or
    /// allocated map is taken with [`ChangedImage::Accept`], another size never); else what
    /// to tell the user.
    pub fn check_disk(
        &self,
        file: &Path,
        given: Option<&Path>,
        changed: ChangedImage,
    ) -> Result<Vec<DiskNote>, SnapshotDiskError> {
        let name = || file.display().to_string();
        let (recorded, given) = match (&self.disk, given) {
            (SnapshotDisk::Absent, None) => return Ok(Vec::new()),
            (SnapshotDisk::Absent, Some(_)) => return Err(SnapshotDiskError::Disk(name())),
            (_, None) => return Err(SnapshotDiskError::NoDisk(name())),
            (SnapshotDisk::Unchecked { newer_record }, Some(_)) => {
                return Ok(vec![DiskNote::Unchecked {
                    newer_record: *newer_record,
                }]);
            }
            (SnapshotDisk::Recorded(recorded), Some(given)) => (recorded, given),
        };
        check_image(recorded, &ImageCheck::of_path(given)?, changed).map_err(|e| match e {
            Refusal::Size { then, now } => SnapshotDiskError::Size {
                file: name(),
                given: given.display().to_string(),
                then,
                now,
            },
            Refusal::Changed(changes) => SnapshotDiskError::Changed {
                file: name(),
                given: given.display().to_string(),
                changes: Box::new(changes),
            },
        })
    }

    /// The VM to restore into: the snapshot's size, vCPUs and devices, the rest of `base`
    /// (serial, ...). Its guest is whatever kernel the snapshot holds, so it is
    /// [`GuestKind::Foreign`](crate::GuestKind::Foreign) whatever `base` booted: the built-in
    /// guest's memory cap and command-line checks are for a boot (a snapshot of a `--guest`
    /// VM larger than that cap could not be restored), and the guest arrives with its memory.
    pub fn config(&self, base: &VmConfig) -> VmConfig {
        VmConfig {
            memory_bytes: self.memory_bytes,
            vcpus: self.vcpus,
            balloon: self.balloon,
            host_pages: crate::memory::HostPages::Small,
            guest: crate::GuestKind::Foreign,
            ..base.clone()
        }
    }
}

/// Why an image given to a restore is refused: the figures, the sentence is the caller's.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    Size { then: u64, now: u64 },
    Changed(image::Changes),
}

/// The image check's rule: another size is refused; another mtime or allocated map is refused
/// unless `changed` accepts it; another path is said. Pure, for the table test.
fn check_image(
    recorded: &ImageCheck,
    now: &ImageCheck,
    changed: ChangedImage,
) -> Result<Vec<DiskNote>, Refusal> {
    let changes = recorded.changes(now);
    if let Some((then, now)) = changes.size {
        return Err(Refusal::Size { then, now });
    }
    let mut notes = Vec::new();
    if !changes.none() {
        match changed {
            ChangedImage::Refuse => return Err(Refusal::Changed(changes)),
            ChangedImage::Accept => notes.push(DiskNote::ChangedTaken {
                given: now.path.clone(),
                changes,
            }),
        }
    }
    if recorded.path != now.path && changes.none() {
        notes.push(DiskNote::Moved {
            recorded: recorded.path.clone(),
            given: now.path.clone(),
        });
    }
    Ok(notes)
}

/// Opens `path` (checking its header and metadata) and says what VM it needs. A file of more
/// RAM than a VM may have on this host (`limit.rs`, the restored VM's kind) is refused from
/// its header, before its metadata is read (its page checksum table is 4 bytes a page), and
/// the restore reads the file again bounded by the VM it made.
pub fn describe(path: &Path) -> Result<SnapshotVm, MigrateError> {
    let kvm = crate::kvm::open()
        .map_err(|e| ferry_migrate::VmError::failed("open /dev/kvm to restore", e))?;
    let host = crate::limit::MemoryLimit::of_host(&kvm, crate::GuestKind::Foreign);
    let limits = ferry_migrate::snapshot::format::Limits {
        max_memory: host.bytes.min(crate::memory::MAX_MEMORY),
    };
    let reader = Reader::open_with(path, &limits)?;
    let h = reader.header();
    let description: VmDescription = serde_json::from_slice(reader.config()).map_err(|e| {
        ferry_migrate::VmError::failed(
            "read the snapshot's VM configuration",
            format!("{e}; restore it with the ferry that wrote it"),
        )
    })?;
    let disk = match description.disk {
        false => SnapshotDisk::Absent,
        true => {
            let sections = snapshot::state::decode(reader.state())?;
            match image::recorded(&sections).map_err(|e| {
                ferry_migrate::VmError::failed("read the snapshot's disk image record", e)
            })? {
                image::Recorded::Check(c) => SnapshotDisk::Recorded(c),
                image::Recorded::Nothing => SnapshotDisk::Unchecked { newer_record: None },
                image::Recorded::Unreadable { version } => SnapshotDisk::Unchecked {
                    newer_record: Some(version),
                },
            }
        }
    };
    Ok(SnapshotVm {
        memory_bytes: h.memory_size(),
        vcpus: u8::try_from(h.vcpus).unwrap_or(u8::MAX),
        balloon: description.balloon,
        disk,
        net: description.net,
    })
}

/// Why a restore failed; nothing runs.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Vm(#[from] VmmError),
    #[error(transparent)]
    Restore(#[from] MigrateError),
}

/// Makes a VM of `config` (its size and devices from [`describe`]) and restores the snapshot at
/// `path` into it; returns the running VM and what the restore took. A lazy restore's RAM is
/// arriving until [`loaded`]: no outgoing copy starts and the balloon gives no page back to the
/// host (a page punched out of a registered range would fault as missing again).
pub fn restore(
    config: VmConfig,
    path: &Path,
    loading: Loading,
    hot_first: bool,
) -> Result<(Vm, Restored), RestoreError> {
    let vcpus = u32::from(config.vcpus);
    let mut incoming = Vm::incoming(config)?;
    let shared = incoming.shared.clone();
    if loading == Loading::Lazy {
        shared.holds.arriving(Arrival::LazyRestore);
    }
    let params = RestoreParams {
        loading,
        readers: std::thread::available_parallelism().map_or(2, |n| n.get().min(8) as u16),
        vcpus,
        hot_first,
        read_deadline: snapshot::DEFAULT_READ_DEADLINE,
        read_delay: None,
    };
    // A restore makes a clone: a new VM generation ID, drawn with the state, before the guest
    // runs (`devices::vmgenid`).
    incoming.identity = crate::vm::build::Identity::Renewed;
    let restored = snapshot::restore(&mut incoming, path, &params).inspect_err(|_| {
        if loading == Loading::Lazy {
            shared.holds.arrived(Arrival::LazyRestore);
        }
        incoming
            .handle()
            .stop(crate::StopReason::Failed("the restore failed".into()));
    })?;
    let vm = incoming.into_running().ok_or_else(|| {
        MigrateError::Channel("the restore ended without resuming the guest".into())
    })?;
    Ok((vm, restored))
}

/// After a lazy restore, once all of RAM is in place: outgoing copies may start, and the
/// balloon may give pages back again (`vm/holds.rs`). Call it once per lazy restore.
pub fn loaded(handle: &VmHandle) {
    handle.0.holds.arrived(Arrival::LazyRestore);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(disk: SnapshotDisk) -> SnapshotVm {
        SnapshotVm {
            memory_bytes: 1 << 30,
            vcpus: 1,
            balloon: true,
            disk,
            net: false,
        }
    }

    #[test]
    fn a_nic_is_needed_exactly_when_the_snapshot_had_one() {
        let file = Path::new("vm.snap");
        let with = SnapshotVm {
            net: true,
            ..vm(SnapshotDisk::Absent)
        };
        assert!(with.check_net(file, true).is_ok());
        let err = with.check_net(file, false).unwrap_err();
        assert!(err.contains("--net tap=NAME"), "{err}");
        assert!(vm(SnapshotDisk::Absent).check_net(file, false).is_ok());
        let err = vm(SnapshotDisk::Absent).check_net(file, true).unwrap_err();
        assert!(err.contains("without --net"), "{err}");
    }

    fn recorded() -> ImageCheck {
        ImageCheck {
            path: "vm.img".into(),
            size: 64 << 20,
            mtime_ns: 1_700_000_000_123_456_789,
            map_hash: 0xfeed,
            extents: 3,
        }
    }

    #[test]
    fn a_restore_needs_a_disk_exactly_when_the_snapshots_vm_had_one() {
        let file = Path::new("vm.snap");
        let old = vm(SnapshotDisk::Unchecked { newer_record: None });
        let disk = Some(Path::new("any.img"));
        let refuse = ChangedImage::Refuse;
        assert_eq!(
            old.check_disk(file, disk, refuse).unwrap(),
            vec![DiskNote::Unchecked { newer_record: None }],
            "an older ferry's snapshot restores, unchecked"
        );
        let none = vm(SnapshotDisk::Absent);
        assert_eq!(none.check_disk(file, None, refuse).unwrap(), vec![]);
        let e = old.check_disk(file, None, refuse).unwrap_err().to_string();
        assert!(e.contains("vm.snap") && e.contains("--disk"), "{e}");
        assert!(matches!(
            none.check_disk(file, disk, refuse),
            Err(SnapshotDiskError::Disk(_))
        ));
        let e = vm(SnapshotDisk::Recorded(recorded()))
            .check_disk(file, Some(Path::new("/nonexistent/vm.img")), refuse)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/vm.img"), "{e}");
    }

    /// Issue 50: the rule of a restore's image check, as a table over what differs and the
    /// override.
    #[test]
    fn an_image_of_another_size_is_refused_a_changed_one_unless_told_a_moved_one_said() {
        use ChangedImage::{Accept, Refuse};
        let then = recorded();
        let copy = ImageCheck {
            path: "/backup/vm-at-snap.img".into(),
            ..recorded()
        };
        let touched = ImageCheck {
            mtime_ns: then.mtime_ns + 1,
            ..recorded()
        };
        let written = ImageCheck {
            map_hash: 0xbeef,
            extents: 4,
            ..recorded()
        };
        let grown = ImageCheck {
            size: 128 << 20,
            ..touched.clone()
        };
        let moved = DiskNote::Moved {
            recorded: then.path.clone(),
            given: copy.path.clone(),
        };
        let taken = |now: &ImageCheck| DiskNote::ChangedTaken {
            given: now.path.clone(),
            changes: then.changes(now),
        };
        let table = [
            (&then, Refuse, Ok(vec![])),
            (&copy, Refuse, Ok(vec![moved])),
            (
                &touched,
                Refuse,
                Err(Refusal::Changed(then.changes(&touched))),
            ),
            (&touched, Accept, Ok(vec![taken(&touched)])),
            (
                &written,
                Refuse,
                Err(Refusal::Changed(then.changes(&written))),
            ),
            (&written, Accept, Ok(vec![taken(&written)])),
            (
                &grown,
                Refuse,
                Err(Refusal::Size {
                    then: 64 << 20,
                    now: 128 << 20,
                }),
            ),
            (
                &grown,
                Accept,
                Err(Refusal::Size {
                    then: 64 << 20,
                    now: 128 << 20,
                }),
            ),
        ];
        for (now, changed, want) in table {
            assert_eq!(
                check_image(&then, now, changed),
                want,
                "{now:?} {changed:?}"
            );
        }
    }

    #[test]
    fn a_changed_image_is_refused_naming_both_values_and_the_fix() {
        let e = SnapshotDiskError::Changed {
            file: "vm.snap".into(),
            given: "vm.img".into(),
            changes: Box::new(recorded().changes(&ImageCheck {
                mtime_ns: 1_700_000_009_000_000_000,
                ..recorded()
            })),
        }
        .to_string();
        for want in [
            "vm.snap: the disk image vm.img changed since the snapshot was taken",
            "its mtime was 1700000000.123456789 when the snapshot was taken and is 1700000009.000000000 now",
            "cp -a",
            "--disk-changed-ok",
        ] {
            assert!(e.contains(want), "{want:?} in {e}");
        }
    }

    /// Issue 48: a restore made its VM with the guest kind of the command line (the built-in
    /// guest by default), whose memory cap refused a snapshot of a larger `--guest` VM.
    #[test]
    fn regression_a_restore_takes_the_snapshots_vm_not_the_built_in_guests_cap() {
        let base = VmConfig {
            memory_bytes: 1 << 30,
            vcpus: 1,
            kernel: Arc::from(&b""[..]),
            cmdline: String::new(),
            guest: crate::GuestKind::FerryGuest,
            serial: crate::SerialOutput::Discard,
            balloon: false,
            disk: None,
            net: None,
            dirty_ring: None,
            host_pages: Default::default(),
            next_layout: false,
        };
        let what = SnapshotVm {
            memory_bytes: 600 << 30,
            vcpus: 4,
            balloon: true,
            disk: SnapshotDisk::Absent,
            net: false,
        };
        let c = what.config(&base);
        assert_eq!(c.guest, crate::GuestKind::Foreign);
        assert_eq!((c.memory_bytes, c.vcpus, c.balloon), (600 << 30, 4, true));
        assert!(c.memory_bytes > crate::limit::BUILTIN_GUEST_MAX_MEMORY);
    }
}
