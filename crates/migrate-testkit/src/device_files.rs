//! Files the fake VM's devices hold, for the local handover's device descriptors: a source
//! passes a `dup` of each (`SourceVm::device_fds`), a destination that takes them keeps what
//! it was passed, and records whether they came before its state was loaded (the trait's
//! contract: they come before, and are used from the load on).

use std::fs::File;

use ferry_migrate::wire::SectionId;
use ferry_migrate::{DeviceFd, VmError};

/// One device's open file, named as its state section is.
#[derive(Debug)]
pub struct DeviceFile {
    pub id: SectionId,
    pub instance: u32,
    pub file: File,
}

/// The fake's device files, and how it treats passed ones.
#[derive(Debug, Default)]
pub struct DeviceFiles {
    /// The devices (section id, instance) whose descriptor a destination takes; none: it
    /// opens its devices' files itself, as a VMM without the hook does.
    pub takes: Vec<(SectionId, u32)>,
    pub files: Vec<DeviceFile>,
    /// Set by a destination's state load: a descriptor passed after it broke the order.
    pub loaded: bool,
}

impl DeviceFiles {
    /// A `dup` of every file, as a source passes them; an error where there are none, as a
    /// VMM without the hook answers.
    pub(crate) fn passed(&self) -> Result<Vec<DeviceFd>, VmError> {
        if self.files.is_empty() {
            return Err(VmError::Unsupported {
                operation: "passing devices' descriptors (the fake has no device file)",
            });
        }
        self.files
            .iter()
            .map(|d| {
                let fd = d.file.try_clone().map_err(|e| VmError::failed("dup", e))?;
                Ok(DeviceFd {
                    id: d.id,
                    instance: d.instance,
                    fd: fd.into(),
                })
            })
            .collect()
    }

    /// Keeps `fds` as a destination does, refusing them after the state load, and one for a
    /// device it does not take.
    pub(crate) fn adopt(&mut self, fds: Vec<DeviceFd>) -> Result<(), VmError> {
        if self.loaded {
            return Err(VmError::failed(
                "adopt_device_fds",
                "devices' descriptors after the state was loaded",
            ));
        }
        if let Some(d) = fds
            .iter()
            .find(|d| !self.takes.contains(&(d.id, d.instance)))
        {
            return Err(VmError::failed(
                "adopt_device_fds",
                format!(
                    "no device of the fake takes {} instance {}",
                    d.id, d.instance
                ),
            ));
        }
        self.files.extend(fds.into_iter().map(|d| DeviceFile {
            id: d.id,
            instance: d.instance,
            file: File::from(d.fd),
        }));
        Ok(())
    }
}
