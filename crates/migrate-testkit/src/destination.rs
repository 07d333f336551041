//! The fake VM as a migration's destination: RAM described as the source's is, state loaded
//! as a real VMM validates it, a resume that lets its writers run, and a local handover that
//! maps the source's memfd over its own.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry_migrate::ram::RamRegion;
use ferry_migrate::wire::LocalRegion;
use ferry_migrate::{DestinationVm, PageLanding, Section, VmError};

use crate::{FAKE_STATE_VERSION, FAKE_VCPU, FakeVm};

// SAFETY: as for SourceVm (`fd` is the read-write memfd behind the mapping); the fake
// destination runs no writers before `resume`.
unsafe impl DestinationVm for FakeVm {
    fn ram(&self) -> Vec<RamRegion> {
        self.shared.ram.regions.clone()
    }

    fn page_landing(&self, _channels: u16) -> PageLanding {
        self.landing
    }

    /// Accepts vCPU sections of [`FAKE_STATE_VERSION`] with some data, as a real VMM validates
    /// what it loads.
    fn load_state(&mut self, sections: &[Section]) -> Result<(), VmError> {
        let fail = |message: String| VmError::failed("load_state", message);
        let (disk, sections): (Vec<Section>, Vec<Section>) = sections
            .iter()
            .cloned()
            .partition(|s| s.id == crate::disk::FAKE_DISK);
        for s in &disk {
            match &self.disk {
                Some(d) => d.load_section(s)?,
                None => return Err(fail("a disk's section, and the fake VM has no disk".into())),
            }
        }
        for s in &sections {
            if s.id != FAKE_VCPU {
                return Err(fail("the fake VM has only a vCPU section".into()));
            }
            if s.version != FAKE_STATE_VERSION || s.data.is_empty() {
                return Err(fail(format!(
                    "vCPU section version {} with {} bytes; the fake loads version {FAKE_STATE_VERSION} with data",
                    s.version,
                    s.data.len()
                )));
            }
        }
        self.state = sections;
        self.devices.loaded = true;
        Ok(())
    }

    fn takes_device_fds(&self) -> bool {
        !self.devices.takes.is_empty()
    }

    fn adopt_device_fds(&mut self, fds: Vec<ferry_migrate::DeviceFd>) -> Result<(), VmError> {
        self.devices.adopt(fds)
    }

    fn load_state_chunk(&mut self, chunk: &Section) -> Result<(), VmError> {
        self.disk_or_unsupported()?.load(chunk)
    }

    fn state_ready(&self) -> Result<bool, VmError> {
        Ok(self.disk_or_unsupported()?.ready())
    }

    fn resume(&mut self) -> Result<Duration, VmError> {
        self.resumed = true;
        self.shared.paused.store(false, Ordering::Release);
        Ok(Duration::ZERO)
    }

    /// Records why, and stops the writers (the fake's vCPUs) for good, as the trait asks: a
    /// writer blocked on a page that never comes stays blocked, the others see the pause before
    /// their next write. It does not wait for writes in flight as a source's pause does: a
    /// blocked writer would never let the wait end.
    fn abandon(&mut self, why: &str) {
        self.abandoned = Some(why.to_string());
        self.shared.paused.store(true, Ordering::Release);
    }

    /// Maps the source's memfd over this VM's own mapping (same addresses, so nothing that
    /// holds them changes) and makes this VM's descriptor name the source's file: a fake of the
    /// same layout only.
    fn adopt_ram(&mut self, regions: &[LocalRegion], fds: Vec<OwnedFd>) -> Result<(), VmError> {
        let fail = |message: String| VmError::failed("adopting guest RAM", message);
        let ram = &self.shared.ram;
        let same = regions.len() == ram.regions.len()
            && regions.iter().zip(&ram.regions).all(|(a, b)| {
                (a.gpa, a.size, a.file_offset) == (b.gpa, b.size, b.file_offset) && a.fd == 0
            });
        if !same || fds.len() != 1 {
            return Err(fail(format!(
                "the source's RAM layout {regions:?} in {} file(s) is not this fake's",
                fds.len()
            )));
        }
        let file = std::fs::File::from(fds.into_iter().next().unwrap());
        let len = file.metadata().map_err(|e| fail(e.to_string()))?.len();
        if len < ram.size {
            return Err(fail(format!("the file holds {len} bytes of {}", ram.size)));
        }
        // SAFETY: replaces exactly this fake's own mapping (base, size), which nothing reads
        // before the guest resumes (the destination's contract), with a shared mapping of the
        // same size of a file at least that long.
        let at = unsafe {
            libc::mmap(
                ram.base as *mut libc::c_void,
                ram.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            )
        };
        if at != ram.base as *mut libc::c_void {
            return Err(fail(std::io::Error::last_os_error().to_string()));
        }
        // SAFETY: dup3 onto a descriptor this fake owns: its number now names the adopted
        // file, and the fake's own file is closed.
        let duped = unsafe { libc::dup3(file.as_raw_fd(), ram.fd.as_raw_fd(), libc::O_CLOEXEC) };
        if duped < 0 {
            return Err(fail(std::io::Error::last_os_error().to_string()));
        }
        Ok(())
    }
}
