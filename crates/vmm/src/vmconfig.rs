//! What a destination VM must share with its source to take its guest, checked before the
//! migration's hello is answered (the engine's `SourceVm::config` / `DestinationVm::
//! check_config`): the vCPU count, whether there is a balloon and a disk, the CPU features the vCPUs
//! were given, and the state sections the source writes with their layout versions. A
//! mismatch is refused before anything is sent, and before the source pauses, with the flag
//! or update that fixes it; the state load would refuse it too, but only after the pause. The
//! guest's TSC frequency is one of them: a destination that cannot give the source's refuses
//! it here (`kvm::tsc::frequency`).
//!
//! The bytes are JSON: small, readable in a packet capture, and extensible by adding fields
//! (a field an older ferry does not send takes its default, and is then not checked).

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::devices::{DeviceStateError, SectionKind, SectionNeed};

/// The parts of a VM's configuration a guest depends on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmDescription {
    pub vcpus: u8,
    pub balloon: bool,
    /// Whether the VM has a disk (virtio-blk); false from a ferry older than disks.
    #[serde(default)]
    pub disk: bool,
    /// Whether the VM has a NIC (virtio-net); false from a ferry older than NICs.
    #[serde(default)]
    pub net: bool,
    /// The NIC's MAC: a running VM's own, an arriving VM's `mac=` if given (else none), so
    /// that a destination given another MAC than its source's is refused before the pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_mac: Option<String>,
    /// A digest of the CPU identity and features the vCPUs get (`kvm::vcpu::cpuid_digest`), so that
    /// a guest never meets a CPU that lacks a feature it booted with.
    pub cpuid: String,
    /// Every kind of state section the VM writes, once each, with the layouts it writes and
    /// loads (`sections::versions`). Empty from a ferry older than the list: its sections are
    /// then checked only by the state load, after the pause.
    #[serde(default)]
    pub sections: Vec<SectionVersion>,
    /// The guest TSC frequency this VM gives and whether its host can give another; none from
    /// a ferry older than the field (or a KVM that does not say), then checked only by the
    /// state load, after the pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tsc: Option<TscDescription>,
}

/// A VM's guest TSC: its frequency (kHz), whether the host's CPU scales the TSC, and KVM's
/// tolerance there (`kvm::tsc::frequency` is the rule they feed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TscDescription {
    pub khz: u32,
    pub scales: bool,
    pub tolerance_ppm: u32,
}

/// A kind of state section a VM writes: its id, the name a refusal gives it, the layout
/// version it writes, the oldest it loads, and whether it loads a stream without it. A
/// destination takes a source's section when the source's `version` is within its own
/// `oldest..=version`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SectionVersion {
    pub id: u32,
    pub name: String,
    pub version: u32,
    pub oldest: u32,
    /// `"optional"`: this VM takes a source that writes no such section (an older ferry's).
    /// Left out when mandatory, as every section of a ferry older than the field is (an older
    /// ferry ignores the field; it refuses a section it does not know by its id).
    #[serde(default, skip_serializing_if = "SectionNeed::is_mandatory")]
    pub need: SectionNeed,
}

impl SectionVersion {
    pub fn new(name: &str, kind: SectionKind, need: SectionNeed) -> SectionVersion {
        SectionVersion {
            id: kind.id.0,
            name: name.into(),
            version: kind.version,
            oldest: kind.oldest,
            need,
        }
    }
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
        if source.disk != self.disk {
            return Err(match source.disk {
                true => "the source VM has a disk and this one has none; start the destination with --disk and the image's path (the same image on shared storage)",
                false => "the source VM has no disk and this one has; start the destination without --disk",
            }
            .into());
        }
        if source.net != self.net {
            return Err(match source.net {
                true => "the source VM has a NIC and this one has none; start the destination with --net tap=NAME (its own tap)",
                false => "the source VM has no NIC and this one has; start the destination without --net",
            }
            .into());
        }
        if let (Some(theirs), Some(ours)) = (&source.net_mac, &self.net_mac)
            && theirs != ours
        {
            return Err(format!(
                "the source's NIC has MAC {theirs}, this one was given mac={ours}; give the source's MAC or none (a migrated guest keeps its MAC)"
            ));
        }
        if source.cpuid != self.cpuid {
            return Err(format!(
                "the vCPUs' CPU features differ (CPUID digest {} on the source, {} here): migrate between hosts with the same CPU model and KVM",
                source.cpuid, self.cpuid
            ));
        }
        if let (Some(theirs), Some(ours)) = (source.tsc, self.tsc) {
            crate::kvm::tsc::frequency(theirs.khz, ours.khz, ours.scales, ours.tolerance_ppm)
                .map_err(|e| e.to_string())?;
        }
        self.loads(&source.sections)
    }

    /// Whether this VM loads every section `source` lists, at the version it is written in,
    /// and finds there every section it needs (all but the optional ones). An empty list (an
    /// older ferry's) is not checked here.
    fn loads(&self, source: &[SectionVersion]) -> Result<(), String> {
        if source.is_empty() {
            return Ok(());
        }
        for s in source {
            let Some(own) = self.sections.iter().find(|o| o.id == s.id) else {
                return Err(format!(
                    "the source writes a {} section (id {}) this ferry does not know; a newer ferry takes an older one's guest, not the reverse: update the destination's ferry",
                    s.name, s.id
                ));
            };
            DeviceStateError::check_version(own.name.clone(), s.version, own.oldest..=own.version)
                .map_err(|e| e.to_string())?;
        }
        match self
            .sections
            .iter()
            .find(|o| o.need.is_mandatory() && !source.iter().any(|s| s.id == o.id))
        {
            Some(own) => Err(format!(
                "the source writes no {} section (id {}) and this VM needs one; start the destination with the source's devices and ferry version",
                own.name, own.id
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(vcpus: u8, balloon: bool, cpuid: &str) -> VmDescription {
        VmDescription {
            vcpus,
            balloon,
            disk: false,
            net: false,
            net_mac: None,
            cpuid: cpuid.into(),
            sections: vec![section(1, "vCPU", 1, 1), section(4, "telemetry port", 2, 2)],
            tsc: Some(TscDescription {
                khz: 2_445_406,
                scales: false,
                tolerance_ppm: 250,
            }),
        }
    }

    /// Issue 53: a source whose guest TSC runs 1% faster or slower than a destination that
    /// cannot scale the TSC is refused before the pause, naming both frequencies and the fix;
    /// within KVM's tolerance, or on a host that scales, it is taken.
    #[test]
    fn a_guest_tsc_frequency_the_destination_cannot_give_is_refused() {
        let here = vm(4, true, "ab");
        let at = |khz: u32| VmDescription {
            tsc: Some(TscDescription {
                khz,
                ..here.tsc.unwrap()
            }),
            ..vm(4, true, "ab")
        };
        for khz in [2_445_406 + 24_454, 2_445_406 - 24_454] {
            let e = here.accepts(&at(khz).encode()).unwrap_err();
            assert!(e.contains(&format!("{khz} kHz on the source")), "{e}");
            assert!(e.contains("2445406 kHz here"), "{e}");
            assert!(e.contains("to one whose CPU scales the TSC"), "{e}");
        }
        assert_eq!(here.accepts(&at(2_445_406 + 500).encode()), Ok(()));
        let scaling = VmDescription {
            tsc: Some(TscDescription {
                scales: true,
                ..here.tsc.unwrap()
            }),
            ..vm(4, true, "ab")
        };
        assert_eq!(scaling.accepts(&at(2_469_860).encode()), Ok(()));
        let older = VmDescription {
            tsc: None,
            ..at(2_469_860)
        };
        assert_eq!(
            here.accepts(&older.encode()),
            Ok(()),
            "left to the state load"
        );
    }

    fn section(id: u32, name: &str, oldest: u32, version: u32) -> SectionVersion {
        SectionVersion {
            id,
            name: name.into(),
            version,
            oldest,
            need: SectionNeed::Mandatory,
        }
    }

    #[test]
    fn a_destination_given_another_mac_is_refused_and_one_given_none_takes_the_sources() {
        let nic = |mac: Option<&str>| VmDescription {
            net: true,
            net_mac: mac.map(String::from),
            ..vm(4, true, "ab")
        };
        let source = nic(Some("52:54:00:12:34:56")).encode();
        assert_eq!(nic(None).accepts(&source), Ok(()));
        assert_eq!(nic(Some("52:54:00:12:34:56")).accepts(&source), Ok(()));
        let err = nic(Some("52:54:00:00:00:01")).accepts(&source).unwrap_err();
        assert!(err.contains("give the source's MAC or none"), "{err}");
    }

    /// `vm(4, true, "ab")` whose telemetry port section is `telemetry`.
    fn with_telemetry(telemetry: SectionVersion) -> VmDescription {
        VmDescription {
            sections: vec![section(1, "vCPU", 1, 1), telemetry],
            ..vm(4, true, "ab")
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
            (
                VmDescription {
                    disk: true,
                    ..vm(4, true, "ab")
                },
                "has a disk and this one has none; start the destination with --disk",
            ),
            (
                VmDescription {
                    net: true,
                    ..vm(4, true, "ab")
                },
                "has a NIC and this one has none; start the destination with --net tap=NAME",
            ),
            (vm(4, true, "cd"), "CPUID digest cd on the source, ab here"),
            (
                with_telemetry(section(4, "telemetry port", 2, 3)),
                "telemetry port state version 3 is outside the versions 2 to 2 this ferry loads; a newer ferry takes an older one's guest, not the reverse: update the destination's ferry",
            ),
            (
                with_telemetry(section(4, "telemetry port", 1, 1)),
                "telemetry port state version 1 is outside the versions 2 to 2 this ferry loads; the source's ferry is older",
            ),
            (
                VmDescription {
                    sections: vec![
                        section(1, "vCPU", 1, 1),
                        section(4, "telemetry port", 2, 2),
                        section(9, "sound card", 1, 1),
                    ],
                    ..vm(4, true, "ab")
                },
                "writes a sound card section (id 9) this ferry does not know; a newer ferry takes an older one's guest, not the reverse: update the destination's ferry",
            ),
            (
                VmDescription {
                    sections: vec![section(1, "vCPU", 1, 1)],
                    ..vm(4, true, "ab")
                },
                "writes no telemetry port section (id 4) and this VM needs one",
            ),
        ];
        for (source, want) in table {
            let e = here.accepts(&source.encode()).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let e = here.accepts(b"{not json").unwrap_err();
        assert!(e.contains("unreadable"), "{e}");
    }

    #[test]
    fn a_destination_takes_the_layouts_it_loads_and_an_older_ferrys_description() {
        // A newer ferry: writes 3, loads 2 to 3, so it takes today's 2 (and its own 3).
        let newer = with_telemetry(section(4, "telemetry port", 2, 3));
        assert_eq!(newer.accepts(&vm(4, true, "ab").encode()), Ok(()));
        assert_eq!(newer.accepts(&newer.encode()), Ok(()));
        // A description from before the list decodes, and its sections are left to the load.
        let older = br#"{"vcpus":4,"balloon":true,"cpuid":"ab"}"#;
        assert_eq!(newer.accepts(older), Ok(()));
    }

    /// Issue 48: the VM generation ID's section (8) is new; a destination that has it takes a
    /// source that writes none (an older ferry), and one that lacks it refuses a source that
    /// writes it, as any section it does not know.
    #[test]
    fn an_optional_section_is_not_asked_of_an_older_source_and_stays_one_way() {
        let optional = SectionVersion {
            need: SectionNeed::Optional,
            ..section(8, "VM generation ID", 1, 1)
        };
        let newer = VmDescription {
            sections: vec![section(1, "vCPU", 1, 1), optional.clone()],
            ..vm(4, true, "ab")
        };
        let older = VmDescription {
            sections: vec![section(1, "vCPU", 1, 1)],
            ..vm(4, true, "ab")
        };
        assert_eq!(newer.accepts(&older.encode()), Ok(()));
        assert_eq!(newer.accepts(&newer.encode()), Ok(()));
        let e = older.accepts(&newer.encode()).unwrap_err();
        assert!(
            e.contains("VM generation ID section (id 8) this ferry does not know"),
            "{e}"
        );
        // Still checked for its layout when the source writes it.
        let later = VmDescription {
            sections: vec![
                section(1, "vCPU", 1, 1),
                section(8, "VM generation ID", 2, 2),
            ],
            ..vm(4, true, "ab")
        };
        assert!(newer.accepts(&later.encode()).is_err());
        // The need travels only when optional: a mandatory section's JSON is as it was.
        let json = String::from_utf8(newer.encode()).unwrap();
        assert_eq!(json.matches("\"need\":\"optional\"").count(), 1, "{json}");
        let back: VmDescription = serde_json::from_str(&json).unwrap();
        assert_eq!(back, newer);
    }
}
