//! A running VM as the engine's [`SourceVm`]: the dirty log (KVM's and the VMM's own
//! writes), pause and resume, throttles, the device state, a disk's copy as iterative state,
//! and free page hints from the balloon.

use std::sync::{Arc, Mutex};

use ferry_migrate::bitmap::DirtyBitmap;
use ferry_migrate::ram::RamRegion;
use ferry_migrate::{Section, SourceVm, VmError};

use super::regions::ram_regions;
use crate::devices::virtio::MmioTransport;
use crate::devices::virtio::balloon::Balloon;
use crate::kvm::log_state::LogStart;
use crate::sections;
use crate::vm::handle::VmHandle;
use crate::vm::shared::Shared;

/// A running VM as the engine's [`SourceVm`]. A migration makes its own; the conformance
/// suite (`ferry_migrate_testkit::conformance`) gets one from [`VmHandle::migration_source`].
#[derive(Debug)]
pub struct SourceAdapter {
    shared: Arc<Shared>,
    handle: VmHandle,
    /// Holds a discard ban (`vm/holds.rs`) from its dirty log's start to its stop (or its
    /// drop, should the migration's thread end without the stop).
    holds_ban: bool,
    /// A disk no host shares, copied as iterative state (`--disk-copy`).
    disk_copy: DiskCopy,
    /// The disk's image synced in the background while the dirty log runs
    /// (`disk_copy/writeback.rs`).
    writeback: Option<crate::disk_copy::Writeback>,
    /// Whose state it saves: a snapshot's also records the disk image (`snapshot::image`).
    saving_for: SavingFor,
}

/// Whom a [`SourceAdapter`] saves the state for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SavingFor {
    Migration,
    Snapshot,
}

/// What the iterative-state calls answer without a disk copy under way.
const NOT_COPYING: VmError = VmError::Unsupported {
    operation: "iterative device state (no disk copy was asked for)",
};

/// Where a migration's copy of the disk is.
#[derive(Debug, Default)]
enum DiskCopy {
    /// Shared storage: no block is sent.
    #[default]
    Off,
    /// Asked for; starts when the destination agrees to take iterative state.
    Asked,
    Running(crate::disk_copy::SourceCopy),
}

impl Drop for SourceAdapter {
    fn drop(&mut self) {
        if std::mem::take(&mut self.holds_ban) {
            self.shared.holds.lift_discard();
        }
    }
}

impl VmHandle {
    /// This VM as a migration source, for driving the engine's trait directly (the
    /// conformance suite does). The dirty log has one reader: not while a migration runs.
    pub fn migration_source(&self) -> SourceAdapter {
        SourceAdapter {
            shared: self.0.clone(),
            handle: self.clone(),
            holds_ban: false,
            disk_copy: DiskCopy::Off,
            writeback: None,
            saving_for: SavingFor::Migration,
        }
    }

    /// [`VmHandle::migration_source`] for a snapshot: its state also records the disk's
    /// image as the flush left it, for a restore to check its `--disk` against.
    pub fn snapshot_source(&self) -> SourceAdapter {
        let mut adapter = self.migration_source();
        adapter.saving_for = SavingFor::Snapshot;
        adapter
    }

    /// [`VmHandle::migration_source`] that copies the VM's disk as iterative state, as a
    /// migration with `disk_copy` does.
    pub fn migration_source_copying_disk(&self) -> SourceAdapter {
        let mut adapter = self.migration_source();
        adapter.disk_copy = DiskCopy::Asked;
        adapter
    }
}

// SAFETY: the regions are the GuestRam mappings, which `shared` keeps alive (an Arc held by
// this adapter) for as long as the adapter lives; they are readable and backed by the memfd.
unsafe impl SourceVm for SourceAdapter {
    /// The disk's open image and the NIC's tap, for a local handover: the new process takes
    /// over the very file and the very tap (`vm/disk.rs`, `vm/net.rs`).
    fn device_fds(&self) -> Result<Vec<ferry_migrate::DeviceFd>, VmError> {
        let mut fds = self.shared.disk_descriptors()?;
        fds.extend(self.shared.net_descriptors()?);
        Ok(fds)
    }

    fn ram(&self) -> Vec<RamRegion> {
        ram_regions(&self.shared.ram)
    }

    /// Also stops the balloon from giving pages back to the host while the migration runs: a
    /// page punched out of the memfd changes without a write the dirty log could see.
    fn start_dirty_log(&mut self) -> Result<(), VmError> {
        if !std::mem::replace(&mut self.holds_ban, true) {
            self.shared.holds.ban_discard();
        }
        self.shared.ram.track_writes(true);
        self.shared.dirty_limit.reset_slept();
        self.writeback = self.shared.start_writeback();
        let logged = self
            .shared
            .kvm
            .start_dirty_log(self.shared.ram.memfd())
            .map_err(|e| VmError::failed("start_dirty_log", e))?;
        tracing::debug!(
            "dirty logging on for {logged} of {} memory slots",
            self.shared.kvm.slots().slots().len()
        );
        Ok(())
    }

    /// Write-protects what KVM's all-set log start left unprotected in the range (`kvm/dirty.rs`);
    /// the VMM's own writes are recorded from the start and need nothing. A log started
    /// write-protected (the old way, or the dirty ring) has nothing to arm: the engine is told
    /// so once and stops asking.
    fn arm_dirty(&mut self, gpa: u64, len: u64) -> Result<(), VmError> {
        if self.shared.kvm.dirty_log_start() == LogStart::WriteProtect {
            return Err(VmError::Unsupported {
                operation: "arming a dirty log that started write-protected",
            });
        }
        self.shared
            .kvm
            .arm_dirty_log(gpa, len)
            .map_err(|e| VmError::failed("arm_dirty", e))
    }

    /// KVM's log (the guest's writes) ∪ the VMM's own writes, both placed by guest address.
    fn fetch_dirty(&mut self, into: &mut DirtyBitmap) -> Result<(), VmError> {
        let per_vcpu = self
            .shared
            .kvm
            .fetch_dirty_log(self.shared.ram.memfd(), into)
            .map_err(|e| VmError::failed("fetch_dirty", e))?;
        self.shared.charge_dirty(&per_vcpu);
        for log in self.shared.ram.take_writes() {
            for (gpa, pages, bits) in log.runs() {
                into.merge_at(gpa, pages, &[bits]).map_err(|e| {
                    VmError::failed("fetch_dirty", format!("the VMM's own writes: {e}"))
                })?;
            }
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) {
        self.writeback = None;
        if std::mem::take(&mut self.holds_ban) {
            self.shared.holds.lift_discard();
        }
        self.shared.ram.track_writes(false);
        if let Err(e) = self.shared.kvm.stop_dirty_log() {
            tracing::warn!("could not turn dirty logging off: {e}");
        }
    }

    fn config(&self) -> Result<Vec<u8>, VmError> {
        Ok(self.shared.description.encode())
    }

    /// Lets the disk's held writers go first: the pause waits for every vCPU.
    fn pause(&mut self) -> Result<(), VmError> {
        self.shared.release_disk_writers();
        self.handle.pause().map_err(|e| VmError::failed("pause", e))
    }

    fn resume(&mut self) -> Result<(), VmError> {
        self.handle
            .resume()
            .map_err(|e| VmError::failed("resume", e))
    }

    fn set_throttle(&mut self, percent: u8) -> Result<(), VmError> {
        self.handle
            .set_throttle(percent)
            .map_err(|e| VmError::failed("throttle", e))
    }

    fn set_dirty_limit(&mut self, bytes_per_s: Option<u64>) -> Result<(), VmError> {
        self.shared.set_dirty_limit(bytes_per_s)
    }

    fn vcpu_dirty(&self) -> Vec<ferry_migrate::VcpuDirty> {
        self.shared.vcpu_dirty()
    }

    /// Flushes the disk first on shared storage: the image is whole before the destination
    /// may open it; a migration's NIC takes the frames waiting in its tap into its state. A copied disk needs no flush: the destination has its blocks from the
    /// copy, and the source's image stays this host's, as it was before the migration.
    fn save_state(&mut self) -> Result<Vec<Section>, VmError> {
        if !matches!(self.disk_copy, DiskCopy::Running(_)) {
            self.shared
                .flush_disk()
                .map_err(|e| VmError::failed("save_state", e))?;
        }
        if self.saving_for == SavingFor::Migration {
            self.shared.take_waiting_frames();
        }
        let (mut sections, mut parts) =
            sections::save(&self.shared).map_err(|e| VmError::failed("save_state", e))?;
        if self.saving_for == SavingFor::Snapshot
            && let Some((record, part)) = crate::snapshot::image::record(&self.shared)?
        {
            sections.push(record);
            parts.push(part);
        }
        *self.shared.state_parts.lock().unwrap() = parts;
        Ok(sections)
    }

    fn state_parts(&self) -> Vec<ferry_migrate::StatePart> {
        self.shared.state_parts.lock().unwrap().clone()
    }

    /// The disk's copy, when asked for (`vm/disk.rs`).
    fn start_state_iteration(&mut self) -> Result<u64, VmError> {
        if matches!(self.disk_copy, DiskCopy::Off) {
            return Err(NOT_COPYING);
        }
        let copy = self.shared.start_disk_copy()?;
        let pending = self.shared.pending_disk_bytes(&copy);
        self.disk_copy = DiskCopy::Running(copy);
        Ok(pending)
    }

    fn next_state_chunk(&mut self, max_bytes: usize) -> Result<Option<Section>, VmError> {
        match &mut self.disk_copy {
            DiskCopy::Running(copy) => self.shared.next_disk_chunk(copy, max_bytes),
            _ => Err(NOT_COPYING),
        }
    }

    fn pending_state_bytes(&self) -> Result<u64, VmError> {
        match &self.disk_copy {
            DiskCopy::Running(copy) => Ok(self.shared.pending_disk_bytes(copy)),
            _ => Err(NOT_COPYING),
        }
    }

    /// The disk's mirror keeps what the copy has pending within it (`disk_copy::source`).
    fn state_allowance(&mut self, bytes: u64) {
        if let DiskCopy::Running(copy) = &mut self.disk_copy {
            copy.set_allowance(bytes);
        }
    }

    fn end_state_iteration(&mut self) {
        if let DiskCopy::Running(copy) = std::mem::take(&mut self.disk_copy) {
            tracing::info!(
                "disk copy: {:?}, writers held {:?}",
                copy.stats,
                self.shared.disk_writers_held()
            );
            self.shared.end_disk_copy();
        }
    }

    /// Free page hints come from the balloon's free page queue; a VM without a balloon, or a
    /// guest whose driver is not running or did not take the feature, has none.
    fn start_hints(&mut self) -> Result<(), VmError> {
        let Some(b) = &self.shared.balloon else {
            return Err(VmError::Unsupported {
                operation: "free page hinting (the VM has no balloon)",
            });
        };
        match b.lock().unwrap().start_hinting() {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::info!("no free page hints for this migration: {e}");
                Err(VmError::Unsupported {
                    operation: "free page hinting (the guest's balloon driver does not hint)",
                })
            }
        }
    }

    fn stop_hints(&mut self) -> Result<(), VmError> {
        self.balloon("stop_hints")?.lock().unwrap().stop_hinting();
        Ok(())
    }

    fn take_hints(&mut self, into: &mut Vec<(u64, u64)>) -> Result<(), VmError> {
        self.balloon("take_hints")?.lock().unwrap().take_hints(into);
        Ok(())
    }

    fn finish_hints(&mut self) -> Result<(), VmError> {
        self.balloon("finish_hints")?
            .lock()
            .unwrap()
            .finish_hinting();
        Ok(())
    }
}

impl SourceAdapter {
    /// The balloon, for a hinting call the engine makes only after `start_hints` worked.
    fn balloon(
        &self,
        operation: &'static str,
    ) -> Result<&Arc<Mutex<MmioTransport<Balloon>>>, VmError> {
        self.shared
            .balloon
            .as_ref()
            .ok_or_else(|| VmError::failed(operation, "the VM has no balloon"))
    }
}
