//! Devices' descriptors in a local handover: the open files a source passes with guest RAM
//! (a disk's image) and a destination takes for the devices they name.

use ferry_migrate::wire::SectionId;
use ferry_migrate::{DestinationVm, DeviceFd, SourceVm, VmError};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{ok, refused};

/// `device_fds`, `takes_device_fds` and `adopt_device_fds`: what a source passes is open
/// files, each device named once by a valid section id; a destination configured as the
/// source's, if it takes descriptors at all, takes them, and a fresh one refuses a descriptor
/// for a device it does not have (which the engine cannot tell). A destination that says it
/// takes none refuses any. A source that passes none may say `Unsupported`.
pub fn device_descriptors_pass_or_are_refused<F: Fixture>(f: &mut F) {
    let src = f.source();
    let fds = match src.device_fds() {
        Err(VmError::Unsupported { .. }) => Vec::new(),
        r => ok("device_fds", r),
    };
    for (i, d) in fds.iter().enumerate() {
        assert_ne!(d.id.0, 0, "device_fds: descriptor {i} names section id 0");
        assert!(
            fds[..i]
                .iter()
                .all(|o| (o.id, o.instance) != (d.id, d.instance)),
            "device_fds: {} instance {} named twice",
            d.id,
            d.instance
        );
        let file = std::fs::File::from(d.fd.try_clone().expect("dup a passed descriptor"));
        file.metadata()
            .unwrap_or_else(|e| panic!("device_fds: descriptor {i} is not open: {e}"));
    }
    let stranger = || DeviceFd {
        id: SectionId(u32::MAX),
        instance: u32::MAX,
        fd: std::fs::File::open("/dev/null").unwrap().into(),
    };
    let mut dst = f.destination();
    if !dst.takes_device_fds() {
        assert!(
            dst.adopt_device_fds(vec![stranger()]).is_err(),
            "adopt_device_fds: accepted by a destination that says it takes no descriptor"
        );
        return;
    }
    if !fds.is_empty() {
        ok(
            "adopt_device_fds of the source's own",
            dst.adopt_device_fds(fds),
        );
    }
    let mut dst = f.destination();
    refused(
        "adopt_device_fds of a descriptor for a device the VM does not have",
        || dst.adopt_device_fds(vec![stranger()]),
    );
}
