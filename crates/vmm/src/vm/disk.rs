//! The VM's disk at a migration's two ends, and as the API shows it.
//!
//! Shared storage is the rule: both VMMs name the same image, and no block is copied. So that
//! one image never has two writers, the source flushes the disk once its vCPUs are paused and
//! before its state is saved, and a destination opens the image only when that state is
//! loaded (`build.rs` builds an arriving VM's disk deferred). A migration that fails before
//! the load leaves the source the only VMM that ever opened the image for writing; one that
//! fails after it leaves the destination stopped before its guest ran, so it wrote nothing.
//!
//! A local handover (one host) passes the source's open image instead, with guest RAM
//! (`SourceVm::device_fds`, named as the disk's virtio-mmio state section): the destination's
//! device keeps it and takes it over at the same state load, rather than opening its
//! `--disk` path, so the guest keeps the very file it was using, whatever became of the path
//! (renamed, unlinked, replaced: the descriptor wins, and a log line says when the path names
//! another file). Same rule: the source stops writing at its pause, the destination starts
//! after the load.
//!
//! A disk no host shares (`--disk-copy`, `disk_copy::`): the source's device marks what the
//! guest writes while its image goes out in chunks; the destination writes them beside its
//! image and makes that file the image at the same state load, so the rule above holds for
//! both ways.
//!
//! Requests in flight at the pause: none. The device completes each request within the
//! notification that submitted it (`devices/virtio/blk`), so a paused guest's requests are
//! either completed, in the used ring, or not yet taken, in the available ring; the queue's
//! indices travel in the device's state and the destination takes those on the driver's next
//! notification.

#![forbid(unsafe_code)]

use ferry_migrate::{DeviceFd, Section, VmError};
use serde::Serialize;

use super::config::DISK_MMIO;
use super::shared::Shared;
use crate::devices::virtio::blk::{BlockError, BlockStats, WriteLog};
use crate::disk_copy::{
    Chunk, DiskCopyStatus, IncomingCopy, SourceCopy, Writeback, Written, chunk,
};
use crate::section_ids::{DISK_BLOCKS, VIRTIO_MMIO};

/// The disk's instance among the virtio-mmio devices' sections (the balloon is 0), and of its
/// copied blocks' chunks.
pub(crate) const DISK_INSTANCE: u32 = 1;

impl Shared {
    /// Writes what the disk's image holds in the host's cache to stable storage: the
    /// source's last act on the image before its state goes.
    pub(crate) fn flush_disk(&self) -> Result<(), BlockError> {
        match &self.disk {
            Some(disk) => disk.lock().unwrap().device().flush(),
            None => Ok(()),
        }
    }

    /// Opens the disk's image, once the guest's state (with the disk's size) is loaded; a
    /// copy that arrived becomes the image first.
    pub(crate) fn attach_disk(&self) -> Result<(), VmError> {
        let Some(disk) = &self.disk else {
            return Ok(());
        };
        if let Some(copy) = self.disk_arriving.lock().unwrap().take() {
            copy.finish()
                .map_err(|e| VmError::failed("make the copied disk the image", e))?;
        }
        disk.lock()
            .unwrap()
            .attach()
            .map_err(|e| VmError::failed("open the disk's image", e))
    }

    /// The disk's open image as a local handover passes it (a `dup` of the device's file),
    /// named as the disk's device state is; none without a disk or before its image is open.
    pub(crate) fn disk_descriptors(&self) -> Result<Vec<DeviceFd>, VmError> {
        let Some(disk) = &self.disk else {
            return Ok(Vec::new());
        };
        let fd = disk
            .lock()
            .unwrap()
            .device()
            .image_descriptor()
            .map_err(|e| VmError::failed("pass the disk's image", e))?;
        Ok(fd
            .map(|fd| DeviceFd {
                id: VIRTIO_MMIO,
                instance: DISK_INSTANCE,
                fd,
            })
            .into_iter()
            .collect())
    }

    /// Keeps the descriptors a local handover's source passed for the devices they name
    /// (the disk and the NIC), for the state load to attach; refuses one no device takes.
    pub(crate) fn adopt_device_fds(&self, fds: Vec<DeviceFd>) -> Result<(), VmError> {
        for d in fds {
            let Some(d) = self.adopt_net_fd(d)? else {
                continue;
            };
            let disk = match &self.disk {
                Some(disk) if (d.id, d.instance) == (VIRTIO_MMIO, DISK_INSTANCE) => disk,
                _ => {
                    return Err(VmError::failed(
                        "take the source's device descriptors",
                        format!(
                            "the source passed a descriptor for {} instance {}, and no device \
                             of this VM takes one (start it with the source's devices)",
                            d.id, d.instance
                        ),
                    ));
                }
            };
            disk.lock()
                .unwrap()
                .device_mut()
                .pass_image(std::fs::File::from(d.fd))
                .map_err(|e| VmError::failed("take the source's disk image", e))?;
        }
        Ok(())
    }

    /// Starts copying the disk: the device marks writes from now on, and the copy reads its
    /// own descriptor of the image.
    pub(crate) fn start_disk_copy(&self) -> Result<SourceCopy, VmError> {
        let fail = |e: String| VmError::failed("start the disk copy", e);
        let disk = self
            .disk
            .as_ref()
            .ok_or_else(|| fail("the VM has no disk".into()))?;
        let (image, capacity) = {
            let mut t = disk.lock().unwrap();
            let block = t.device_mut();
            let found = block.image_for_copy().map_err(|e| fail(e.to_string()))?;
            block.start_tracking();
            found
        };
        SourceCopy::start(image, capacity).map_err(|e| fail(e.to_string()))
    }

    /// The next chunk of the disk's copy, as a section.
    pub(crate) fn next_disk_chunk(
        &self,
        copy: &mut SourceCopy,
        max_bytes: usize,
    ) -> Result<Option<Section>, VmError> {
        let chunk = copy
            .next(max_bytes, &mut self.marks())
            .map_err(|e| VmError::failed("read the disk to copy", e))?;
        self.note_disk_copy(copy);
        Ok(chunk.map(|data| Section {
            id: DISK_BLOCKS,
            instance: DISK_INSTANCE,
            version: chunk::VERSION,
            data,
        }))
    }

    pub(crate) fn pending_disk_bytes(&self, copy: &SourceCopy) -> u64 {
        self.note_disk_copy(copy)
    }

    /// Publishes where `copy` is (`VmHandle::disk_copy`); returns the bytes it has pending.
    fn note_disk_copy(&self, copy: &SourceCopy) -> u64 {
        let pending_bytes = copy.pending(&self.marks());
        *self.disk_copy.lock().unwrap() = Some(DiskCopyStatus {
            stats: copy.stats,
            pending_bytes,
            writers_held_ms: self.disk_writers_held().as_secs_f64() * 1e3,
        });
        pending_bytes
    }

    /// The copy ended, however it ended: the device stops marking writes, and no writer is
    /// held any more.
    pub(crate) fn end_disk_copy(&self) {
        if let Some(disk) = &self.disk {
            disk.lock().unwrap().device_mut().stop_tracking();
        }
    }

    /// Lets every writer the mirror holds go, and holds none until the copy asks again: the
    /// guest is about to be paused, and a held vCPU would keep the pause waiting on the copy,
    /// whose thread is the one pausing.
    pub(crate) fn release_disk_writers(&self) {
        if let Some(log) = &self.disk_writes {
            log.mirror(None);
        }
    }

    /// How long the mirror held the guest's writers since the copy started.
    pub(crate) fn disk_writers_held(&self) -> std::time::Duration {
        self.disk_writes
            .as_ref()
            .map_or(std::time::Duration::ZERO, |log| log.held())
    }

    /// Whether a guest's MMIO write at `addr` went to the disk's registers.
    pub(crate) fn is_disk_register(&self, addr: u64) -> bool {
        self.disk_writes.is_some()
            && (DISK_MMIO..DISK_MMIO + crate::devices::virtio::mmio::MMIO_SIZE).contains(&addr)
    }

    /// Holds a vCPU that wrote the disk's registers while the mirror is on and the copy is
    /// behind (`blk::WriteLog::hold_writer`); called with no lock of the vCPU or device held.
    pub(crate) fn hold_disk_writer(&self) {
        if let Some(log) = &self.disk_writes {
            log.hold_writer();
        }
    }

    /// Whether the disk is ready for the switchover: no copy arriving, or one nearly all on
    /// storage (`IncomingCopy::ready`).
    pub(crate) fn disk_ready(&self) -> bool {
        self.disk_arriving
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(IncomingCopy::ready)
    }

    /// Writes a chunk of the source's disk into the file that becomes this VM's image.
    pub(crate) fn take_disk_chunk(&self, section: &Section) -> Result<(), VmError> {
        let fail = |e: String| VmError::failed("take a chunk of the source's disk", e);
        let path = match (&self.disk, &self.disk_path) {
            (Some(_), Some(path)) => path,
            _ => return Err(fail("this VM has no disk; start it with --disk".into())),
        };
        if (section.id, section.instance, section.version)
            != (DISK_BLOCKS, DISK_INSTANCE, chunk::VERSION)
        {
            return Err(fail(format!(
                "no part of this VM takes {} instance {} version {}",
                section.id, section.instance, section.version
            )));
        }
        let chunk = Chunk::decode(&section.data).map_err(|e| fail(e.to_string()))?;
        let mut arriving = self.disk_arriving.lock().unwrap();
        let copy = match &mut *arriving {
            Some(copy) => copy,
            None => arriving.insert(
                IncomingCopy::begin(path, chunk.capacity).map_err(|e| fail(e.to_string()))?,
            ),
        };
        copy.apply(&chunk).map_err(|e| fail(e.to_string()))
    }

    fn marks(&self) -> DeviceMarks<'_> {
        DeviceMarks(self.disk_writes.as_ref().expect("a disk copy has a disk"))
    }
}

impl Shared {
    /// Starts syncing the disk's image in the background (`disk_copy::Writeback`): the
    /// flush in the pause then finds only the last moments' writes. `None` without an open
    /// disk.
    pub(crate) fn start_writeback(&self) -> Option<Writeback> {
        let disk = self.disk.as_ref()?;
        let (image, _) = disk.lock().unwrap().device().image_for_copy().ok()?;
        Writeback::start(image)
    }
}

/// The device's marks of granules written, for the copy: its record of writes, which the copy
/// reads without the device's lock.
struct DeviceMarks<'a>(&'a WriteLog);

impl Written for DeviceMarks<'_> {
    fn take(&mut self) -> Vec<u64> {
        self.0.take()
    }

    fn count(&self) -> u64 {
        self.0.count()
    }

    fn mirror(&mut self, lag: u64) {
        self.0.mirror(Some(lag));
    }
}

/// The disk, as `GET /vm` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct DiskStatus {
    /// Whether the guest's driver is running (status DRIVER_OK).
    pub driver_ok: bool,
    pub stats: BlockStats,
    /// How long the mirror of the last disk copy held the guest's writers, ms (`--disk-copy`
    /// with a guest writing faster than the copy sends).
    pub mirror_held_ms: f64,
}

impl Shared {
    /// The last disk copy's status, if one was started (`VmHandle::disk_copy`).
    pub(crate) fn disk_copy_status(&self) -> Option<DiskCopyStatus> {
        self.disk_copy.lock().unwrap().clone()
    }

    /// The disk's status, if the VM has one (`VmHandle::disk`).
    pub(crate) fn disk_status(&self) -> Option<DiskStatus> {
        let disk = self.disk.as_ref()?.lock().unwrap();
        Some(DiskStatus {
            driver_ok: disk.driver_ok(),
            stats: disk.device().stats(),
            mirror_held_ms: self.disk_writers_held().as_secs_f64() * 1e3,
        })
    }
}
