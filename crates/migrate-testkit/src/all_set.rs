//! A fake VMM whose dirty log starts all set, as KVM's does with
//! `KVM_DIRTY_LOG_INITIALLY_SET`: tracking a page starts only when it is armed
//! ([`SourceVm::arm_dirty`]), a write before that is forgotten, and a fetch arms what is still
//! unarmed and reports its populated pages (the reference VMM's `kvm/dirty.rs` does the same
//! with KVM). An engine that read a page before arming it would lose the writes in between;
//! one that never armed would send all of memory twice. Both show in the engine tests.

use std::sync::atomic::Ordering;

use ferry_migrate::bitmap::DirtyBitmap;
use ferry_migrate::ram::{RamRegion, next_data_in_file};
use ferry_migrate::wire::PAGE_SIZE;
use ferry_migrate::{Section, SourceVm, VmError};

use crate::FakeVm;

/// [`FakeVm`] with a dirty log that starts all set.
#[derive(Debug)]
pub struct AllSetVm {
    pub vm: FakeVm,
    /// Pages (by index across regions) not armed since the log started.
    unarmed: Vec<u64>,
    /// Calls of [`SourceVm::arm_dirty`].
    pub arms: u64,
    /// Pages fetches reported because they were populated and never armed.
    pub reported_unarmed: u64,
}

impl AllSetVm {
    pub fn new(vm: FakeVm) -> AllSetVm {
        AllSetVm {
            vm,
            unarmed: Vec::new(),
            arms: 0,
            reported_unarmed: 0,
        }
    }

    /// Arms the pages of `mask` in word `w` of the unarmed map: the log forgets their writes
    /// so far and records those to come.
    fn arm_word(&mut self, w: usize, mask: u64) {
        let mask = mask & self.unarmed[w];
        self.unarmed[w] &= !mask;
        self.vm.shared.dirty[w].fetch_and(!mask, Ordering::AcqRel);
    }
}

// SAFETY: the regions are the inner fake's, which `vm` owns for as long as self lives.
unsafe impl SourceVm for AllSetVm {
    fn ram(&self) -> Vec<RamRegion> {
        self.vm.ram()
    }

    fn start_dirty_log(&mut self) -> Result<(), VmError> {
        self.vm.start_dirty_log()?;
        self.unarmed = vec![!0; self.vm.shared.dirty.len()];
        Ok(())
    }

    fn arm_dirty(&mut self, gpa: u64, len: u64) -> Result<(), VmError> {
        self.arms += 1;
        let first = self
            .vm
            .shared
            .ram
            .locate("arm_dirty", gpa, len / PAGE_SIZE)?;
        for index in first..first + len / PAGE_SIZE {
            self.arm_word((index / 64) as usize, 1 << (index % 64));
        }
        Ok(())
    }

    /// Arms what is still unarmed, then takes the writes logged and reports the populated
    /// pages among those it armed (a write before the arm populated its page).
    fn fetch_dirty(&mut self, into: &mut DirtyBitmap) -> Result<(), VmError> {
        let was = self.unarmed.clone();
        for (w, &mask) in was.iter().enumerate() {
            self.arm_word(w, mask);
        }
        self.vm.fetch_dirty(into)?;
        let mut index = 0;
        for r in self.vm.ram() {
            let mut at = r.file_offset;
            let end = r.file_offset + r.size;
            while let Some((data, hole)) =
                next_data_in_file(r.fd, at, end).map_err(|e| VmError::failed("fetch_dirty", e))?
            {
                for offset in (data..hole).step_by(PAGE_SIZE as usize) {
                    let i = index + (offset - r.file_offset) / PAGE_SIZE;
                    if was[(i / 64) as usize] & (1 << (i % 64)) != 0 {
                        into.set(r.gpa + offset - r.file_offset);
                        self.reported_unarmed += 1;
                    }
                }
                at = hole;
            }
            index += r.size / PAGE_SIZE;
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) {
        self.vm.stop_dirty_log();
    }

    fn pause(&mut self) -> Result<(), VmError> {
        self.vm.pause()
    }

    fn resume(&mut self) -> Result<(), VmError> {
        self.vm.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> Result<(), VmError> {
        self.vm.set_throttle(percent)
    }

    fn save_state(&mut self) -> Result<Vec<Section>, VmError> {
        self.vm.save_state()
    }
}
