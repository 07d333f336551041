//! What a destination VM must share with its source to take its guest, checked before the
//! migration's hello is answered (the engine's `SourceVm::config` / `DestinationVm::
//! check_config`): the vCPU count, whether there is a balloon, and the CPU features the vCPUs
//! were given. A mismatch is refused before anything is sent, and before the source pauses,
//! with the flag that fixes it; the state load would refuse it too, but only after the pause.
//!
//! The bytes are JSON: small, readable in a packet capture, and extensible by adding fields.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// The parts of a VM's configuration a guest depends on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmDescription {
    pub vcpus: u8,
    pub balloon: bool,
    /// A digest of the CPU identity and features the vCPUs get (`kvm::vcpu::cpuid_digest`), so that
    /// a guest never meets a CPU that lacks a feature it booted with.
    pub cpuid: String,
}

impl VmDescription {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Whether this VM (`self`) can take a guest from a VM described by `source`; else what
    /// differs and how to start this one instead.
    pub fn accepts(&self, source: &[u8]) -> Result<(), String> {
        let source: VmDescription = serde_json::from_slice(source).map_err(|e| {
            format!(
                "the source's VM configuration is unreadable ({e}); use matching ferry versions"
            )
        })?;
        if source.vcpus != self.vcpus {
            return Err(format!(
                "the source VM has {} vCPUs and this one {}; start the destination with --vcpus {}",
                source.vcpus, self.vcpus, source.vcpus
            ));
        }
        if source.balloon != self.balloon {
            return Err(match source.balloon {
                true => "the source VM has a balloon and this one has none; start the destination with --balloon on",
                false => "the source VM has no balloon and this one has; start the destination with --balloon off",
            }
            .into());
        }
        if source.cpuid != self.cpuid {
            return Err(format!(
                "the vCPUs' CPU features differ (CPUID digest {} on the source, {} here): migrate between hosts with the same CPU model and KVM",
                source.cpuid, self.cpuid
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(vcpus: u8, balloon: bool, cpuid: &str) -> VmDescription {
        VmDescription {
            vcpus,
            balloon,
            cpuid: cpuid.into(),
        }
    }

    #[test]
    fn a_destination_refuses_what_differs_and_names_the_fix() {
        let here = vm(4, true, "ab");
        assert_eq!(here.accepts(&vm(4, true, "ab").encode()), Ok(()));
        let table = [
            (
                vm(16, true, "ab"),
                "has 16 vCPUs and this one 4; start the destination with --vcpus 16",
            ),
            (
                vm(4, false, "ab"),
                "has no balloon and this one has; start the destination with --balloon off",
            ),
            (vm(4, true, "cd"), "CPUID digest cd on the source, ab here"),
        ];
        for (source, want) in table {
            let e = here.accepts(&source.encode()).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let e = here.accepts(b"{not json").unwrap_err();
        assert!(e.contains("unreadable"), "{e}");
    }
}
