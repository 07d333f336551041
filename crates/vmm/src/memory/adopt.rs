//! A local handover's destination takes the source's guest RAM: the source's memfd, received
//! over the Unix socket, is mapped over this VM's own RAM at the same host addresses, so KVM's
//! memory slots, vm-memory's regions and every device keep the addresses they hold (KVM's
//! MMU notifier drops whatever it had mapped of the old pages), and this VM's descriptor
//! numbers are made to name the source's file (`dup3`), so the balloon's punches and a later
//! handover reach the adopted memory. This VM's own memfd is closed by it, and its pages go.
//!
//! Only a VM that never ran may adopt (a destination's, before the guest resumes): nothing
//! reads or writes its RAM meanwhile, and a VM whose adoption failed half-way is dropped.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;

use ferry_migrate::wire::LocalRegion;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::{GuestRam, HostPages, Size};

/// A hugetlbfs file's block size: its huge page (a memfd of 4 KiB pages reports 4 KiB).
const HUGE_PAGE: u64 = 2 << 20;

/// Why the source's guest RAM could not be adopted, each with the fix.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error(
        "the source's guest RAM is laid out as {theirs}, this VM's as {ours}; start the destination with the source's --memory"
    )]
    Layout { theirs: String, ours: String },
    #[error(
        "the source passed {0} files for guest RAM, and this VM keeps it in one memfd: the source is not a ferry VMM like this one; hand over between ferry releases"
    )]
    Files(usize),
    #[error(
        "the source's guest RAM file is not sealed against shrinking, so its size cannot be trusted (it could be cut under the guest); hand over from a ferry that seals it (this release and later), or migrate without --local"
    )]
    NotSealed,
    #[error("the source's guest RAM file holds {} and its layout needs {}", Size(*len), Size(*needs))]
    Short { len: u64, needs: u64 },
    #[error("the source's guest RAM is {theirs} and this VM's {ours}: start the destination {fix}")]
    Pages {
        theirs: &'static str,
        ours: &'static str,
        fix: &'static str,
    },
    #[error("cannot {what} the source's guest RAM: {source}; migrate without --local")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

fn describe(regions: impl Iterator<Item = (u64, u64, u64)>) -> String {
    let parts: Vec<String> = regions
        .map(|(gpa, size, at)| format!("{} at {gpa:#x} (file offset {at:#x})", Size(size)))
        .collect();
    parts.join(", ")
}

impl GuestRam {
    /// Maps the source's guest RAM (`regions` of the one file in `fds`) in place of this
    /// VM's, as the module says.
    pub fn adopt(&self, regions: &[LocalRegion], fds: Vec<OwnedFd>) -> Result<(), AdoptError> {
        let ours = self.regions.iter().map(|r| (r.gpa, r.size, r.file_offset));
        let theirs = regions.iter().map(|r| (r.gpa, r.size, r.file_offset));
        if !ours.clone().eq(theirs.clone()) || regions.iter().any(|r| r.fd != 0) {
            return Err(AdoptError::Layout {
                theirs: describe(theirs),
                ours: describe(ours),
            });
        }
        let [fd] = <[OwnedFd; 1]>::try_from(fds).map_err(|fds| AdoptError::Files(fds.len()))?;
        let file = File::from(fd);
        let io = |what| move |source| AdoptError::Io { what, source };
        if !super::size_sealed(&file) {
            return Err(AdoptError::NotSealed);
        }
        let meta = file.metadata().map_err(io("inspect"))?;
        let len = meta.len();
        let needs = regions
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0);
        if len < needs {
            return Err(AdoptError::Short { len, needs });
        }
        let huge = std::os::unix::fs::MetadataExt::blksize(&meta) == HUGE_PAGE;
        let flags = match (huge, self.pages) {
            (false, HostPages::Small) => libc::MAP_SHARED | libc::MAP_NORESERVE,
            (true, HostPages::Huge2M) => libc::MAP_SHARED,
            (true, HostPages::Small) => {
                return Err(AdoptError::Pages {
                    theirs: "on 2 MiB huge pages",
                    ours: "on 4 KiB pages",
                    fix: "with --hugepages",
                });
            }
            (false, HostPages::Huge2M) => {
                return Err(AdoptError::Pages {
                    theirs: "on 4 KiB pages",
                    ours: "on 2 MiB huge pages",
                    fix: "without --hugepages",
                });
            }
        };
        for r in &self.regions {
            // SAFETY: replaces exactly this VM's own mapping of the region (`host_addr`,
            // `size`, made by `GuestRam::with_pages` and unmapped only when this value drops)
            // with a shared mapping of the same length, of a file checked above to hold it and
            // sealed so that it cannot shrink, so every pointer into the region stays valid.
            // Nothing touches guest RAM meanwhile: only a destination that never ran adopts (the
            // module's rule). A failed MAP_FIXED may leave the range unmapped on older kernels;
            // the error then drops this VM before anything reads it (`adopt_ram`'s contract).
            let at = unsafe {
                libc::mmap(
                    r.host_addr as *mut libc::c_void,
                    r.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags | libc::MAP_FIXED,
                    file.as_raw_fd(),
                    r.file_offset as libc::off_t,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(io("map")(std::io::Error::last_os_error()));
            }
        }
        let mut ours: Vec<RawFd> = vec![self.memfd.as_raw_fd()];
        ours.extend(
            self.memory
                .iter()
                .filter_map(|region| region.file_offset())
                .map(|f| f.file().as_raw_fd()),
        );
        for target in ours {
            // SAFETY: `target` is a descriptor this value owns (its memfd, or the one each
            // vm-memory region keeps); dup3 makes that number name the adopted file in one
            // step and closes what it named, so no owner ever holds a closed number.
            if unsafe { libc::dup3(file.as_raw_fd(), target, libc::O_CLOEXEC) } < 0 {
                return Err(io("take over")(std::io::Error::last_os_error()));
            }
        }
        self.populated.store(false, Ordering::Release);
        Ok(())
    }
}
