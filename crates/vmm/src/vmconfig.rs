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
    /// A digest of the CPU identity and features the vCPUs get ([`cpuid_digest`]), so that
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

/// FNV-1a, as hex, over what CPUID says of the CPU's identity and features: the vendor (leaf
/// 0) and the feature flags of leaves 1, 7 and 0x80000001. Not over every entry: KVM fills
/// some (XSAVE sizes, topology) from state that differs between two VMs of one host, and the
/// OS-controlled bits (OSXSAVE, OSPKE) follow the guest's CR4.
pub fn cpuid_digest(entries: &[kvm_bindings::kvm_cpuid_entry2]) -> String {
    const OSXSAVE: u32 = 1 << 27;
    const OSPKE: u32 = 1 << 4;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |w: u32| {
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for e in entries {
        let words = match (e.function, e.index) {
            (0, _) => [e.ebx, e.ecx, e.edx],
            (1, _) => [0, e.ecx & !OSXSAVE, e.edx],
            (7, 0) => [e.ebx, e.ecx & !OSPKE, e.edx],
            (0x8000_0001, _) => [0, e.ecx, e.edx],
            _ => continue,
        };
        eat(e.function);
        words.into_iter().for_each(&mut eat);
    }
    format!("{h:016x}")
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
