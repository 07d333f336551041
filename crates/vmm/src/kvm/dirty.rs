//! KVM's dirty log: `KVM_MEM_LOG_DIRTY_PAGES` on every RAM slot, with
//! `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` (initially all set) so that fetching the log does not
//! re-protect memory, and `KVM_CLEAR_DIRTY_LOG` (declared here; kvm-ioctls lacks it) to
//! re-protect exactly the pages about to be sent, in bounded chunks.
//!
//! Slots are found by guest address in the VM's [`super::SlotTable`], and a slot's log is
//! merged into the engine's bitmap at the slot's guest address: nothing here assumes that slot
//! `i` is the `i`-th RAM region of anyone's list.

use ferry_migrate::bitmap::DirtyBitmap;
use ferry_migrate::ram::RamError;
use kvm_bindings::{
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVMIO, kvm_clear_dirty_log,
    kvm_clear_dirty_log__bindgen_ty_1, kvm_enable_cap,
};
#[allow(unused_imports)] // used inside ioctl_iowr_nr!'s expansion
use vmm_sys_util::ioctl_ioc_nr;
use vmm_sys_util::ioctl_iowr_nr;

use super::{KvmError, KvmVm, SlotError};

ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);

/// Pages re-protected per `KVM_CLEAR_DIRTY_LOG`: 16 Ki pages (64 MiB), a bitmap of 256 words;
/// write-protecting that many entries takes about a millisecond, so no call is long.
const CLEAR_CHUNK_PAGES: u64 = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error(
        "this KVM lacks KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 (Linux 5.8+), which ferry's dirty tracking needs"
    )]
    Unsupported,
    #[error("dirty log {what} failed on slot {slot}: {source}")]
    Kvm {
        what: &'static str,
        slot: u32,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("dirty log of {pages} pages at {gpa:#x}: {source}")]
    Range {
        gpa: u64,
        pages: u64,
        #[source]
        source: SlotError,
    },
    #[error("the dirty log of slot {slot} does not fit the migration's RAM: {source}")]
    Merge {
        slot: u32,
        #[source]
        source: RamError,
    },
}

impl KvmVm {
    /// Turns on manual protection with initially-set bitmaps; done once, at VM creation.
    pub fn enable_manual_dirty_protect(&self) -> Result<(), DirtyLogError> {
        let supported = self
            .vm
            .check_extension_raw(u64::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2))
            as u32;
        let wanted = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET;
        if supported & wanted != wanted {
            return Err(DirtyLogError::Unsupported);
        }
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            ..Default::default()
        };
        cap.args[0] = u64::from(wanted);
        self.vm
            .enable_cap(&cap)
            .map_err(|source| DirtyLogError::Kvm {
                what: "enable",
                slot: 0,
                source,
            })
    }

    /// Re-registers every RAM slot with dirty logging on or off. Turning it on marks every
    /// page dirty (initially set) without write-protecting anything.
    pub fn set_dirty_logging(&self, on: bool) -> Result<(), KvmError> {
        for s in self.slots.slots() {
            let flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
            // SAFETY: the same live mapping the slot was created with; only the flags change.
            unsafe { self.vm.set_user_memory_region(s.region(flags)) }.map_err(|source| {
                KvmError::MemorySlot {
                    gpa: s.gpa,
                    size: s.size,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// Re-protects the `pages` pages from `gpa`, which must lie in one slot, dropping their
    /// dirty bits.
    pub fn clear_dirty(&self, gpa: u64, pages: u64) -> Result<(), DirtyLogError> {
        let (slot, first) = self
            .slots
            .lookup(gpa, pages)
            .map_err(|source| DirtyLogError::Range { gpa, pages, source })?;
        self.clear_dirty_log(slot.slot, first, pages, None)
    }

    /// Re-protects `pages` pages of slot `slot` from page `first` (a multiple of 64), dropping
    /// their dirty bits: all of them when `bits` is `None`, else those set in `bits`.
    fn clear_dirty_log(
        &self,
        slot: u32,
        first: u64,
        pages: u64,
        bits: Option<&[u64]>,
    ) -> Result<(), DirtyLogError> {
        let ones;
        let bitmap = match bits {
            Some(b) => b,
            None => {
                ones = vec![u64::MAX; pages.div_ceil(64) as usize];
                &ones
            }
        };
        let mut at = 0;
        while at < pages {
            let n = (pages - at).min(CLEAR_CHUNK_PAGES);
            let words = &bitmap[(at / 64) as usize..(at + n).div_ceil(64) as usize];
            if words.iter().any(|&w| w != 0) {
                let arg = kvm_clear_dirty_log {
                    slot,
                    num_pages: n as u32,
                    first_page: first + at,
                    __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
                        dirty_bitmap: words.as_ptr() as *mut libc::c_void,
                    },
                };
                // SAFETY: KVM reads `num_pages` bits from `dirty_bitmap`, which points at
                // `words`, a live slice of at least that many bits; the call writes nothing.
                let ret = unsafe {
                    vmm_sys_util::ioctl::ioctl_with_ref(&self.vm, KVM_CLEAR_DIRTY_LOG(), &arg)
                };
                if ret < 0 {
                    return Err(DirtyLogError::Kvm {
                        what: "clear",
                        slot,
                        source: vmm_sys_util::errno::Error::last(),
                    });
                }
            }
            at += n;
        }
        Ok(())
    }

    /// Fetch-and-clear of KVM's log: ORs every slot's dirty bits into `into` at the slot's
    /// guest address and re-protects the pages it reported.
    pub fn fetch_dirty_log(&self, into: &mut DirtyBitmap) -> Result<(), DirtyLogError> {
        for s in self.slots.slots() {
            let words = self
                .vm
                .get_dirty_log(s.slot, s.size as usize)
                .map_err(|source| DirtyLogError::Kvm {
                    what: "fetch",
                    slot: s.slot,
                    source,
                })?;
            into.merge_at(s.gpa, s.pages(), &words)
                .map_err(|source| DirtyLogError::Merge {
                    slot: s.slot,
                    source,
                })?;
            self.clear_dirty_log(s.slot, 0, s.pages(), Some(&words))?;
        }
        Ok(())
    }
}
