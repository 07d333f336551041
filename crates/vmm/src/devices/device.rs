//! What a device is to the VMM: bus accesses at an offset into its range, and its state as a
//! section of a kind and layout version it names ([`Device`]); which bus it sits on.
//!
//! A section's layout versions are a range: a VMM writes the newest it knows and loads every
//! layout from the oldest it still can up to that one, so a newer ferry takes a guest from an
//! older one (a live update of the VMM under a running guest), never the reverse. A device
//! added after ferries whose guests a newer one must still take may make its section optional
//! on load ([`SectionNeed::Optional`], argued in its module doc): an older source writes none.

#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::ops::RangeInclusive;

use ferry_migrate::wire::SectionId;
use serde::{Deserialize, Serialize};

/// What a device's state section is: its id, the layout version this VMM writes, and the
/// oldest layout it still loads (`oldest..=version`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionKind {
    pub id: SectionId,
    /// The layout this VMM writes, the newest it knows.
    pub version: u32,
    /// The oldest layout this VMM loads: equal to `version` until a layout changes; then the
    /// loader of the old layout stays and `oldest` stays behind, for guests of older ferries.
    pub oldest: u32,
}

impl SectionKind {
    /// A kind whose one layout is the only one this VMM writes and loads.
    pub const fn single(id: SectionId, version: u32) -> SectionKind {
        SectionKind {
            id,
            version,
            oldest: version,
        }
    }

    /// The layout versions this VMM loads.
    pub fn loads(&self) -> RangeInclusive<u32> {
        self.oldest..=self.version
    }
}

/// Whether a destination needs a device's section in the stream it loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SectionNeed {
    /// A stream without it is refused: the state would be lost (every device but one).
    #[default]
    Mandatory,
    /// A stream without it loads, the device keeping the state it was built with: for a
    /// device newer than ferries a newer one takes guests from, which write no such section,
    /// and whose own state a guest does not miss (`devices::vmgenid`).
    Optional,
}

impl SectionNeed {
    pub fn is_mandatory(&self) -> bool {
        *self == SectionNeed::Mandatory
    }
}

/// Why a device's saved state could not be restored.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceStateError {
    #[error(
        "{device} state version {got} is outside the versions {oldest} to {newest} this ferry loads; {}",
        version_fix(.got, .newest)
    )]
    Version {
        device: Cow<'static, str>,
        got: u32,
        oldest: u32,
        newest: u32,
    },
    #[error("{device} state is malformed: {reason}")]
    Malformed {
        device: &'static str,
        reason: String,
    },
}

/// What to do about a layout version outside the range loaded: a layout newer than the newest
/// comes from a newer ferry, one older than the oldest from a ferry too old for this one.
fn version_fix(got: &u32, newest: &u32) -> &'static str {
    match got > newest {
        true => {
            "a newer ferry takes an older one's guest, not the reverse: update the destination's ferry"
        }
        false => {
            "the source's ferry is older than any this one takes a guest from: move the guest through a ferry release between the two first"
        }
    }
}

impl DeviceStateError {
    /// Refuses `got` unless `loads` holds it (a kind's [`SectionKind::loads`]).
    pub fn check_version(
        device: impl Into<Cow<'static, str>>,
        got: u32,
        loads: RangeInclusive<u32>,
    ) -> Result<(), Self> {
        match loads.contains(&got) {
            true => Ok(()),
            false => Err(DeviceStateError::Version {
                device: device.into(),
                got,
                oldest: *loads.start(),
                newest: *loads.end(),
            }),
        }
    }
}

/// A device on a bus, with state that migrates.
pub trait Device: Send {
    /// Reads `data.len()` bytes at `offset` into the device's range.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
    /// The section its state travels in, and the layouts it loads.
    fn kind(&self) -> SectionKind;
    /// Whether a destination loads a stream without its section; mandatory unless the device
    /// argues otherwise.
    fn need(&self) -> SectionNeed {
        SectionNeed::Mandatory
    }
    /// Its state, in the layout of `kind().version`; taken while the vCPUs are paused.
    fn save(&self) -> Vec<u8>;
    /// Replaces its state with a saved one of layout `version` (any of `kind().loads()`),
    /// validating every byte.
    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError>;
}

/// Which bus a device sits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BusKind {
    Pio,
    Mmio,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::section_ids::{SERIAL, TELEMETRY_PORT};

    #[test]
    fn a_version_outside_the_range_is_refused_with_the_way_round() {
        let kind = SectionKind {
            id: TELEMETRY_PORT,
            version: 2,
            oldest: 1,
        };
        for got in [1, 2] {
            assert_eq!(
                DeviceStateError::check_version("telemetry port", got, kind.loads()),
                Ok(())
            );
        }
        let newer = DeviceStateError::check_version("telemetry port", 3, kind.loads())
            .unwrap_err()
            .to_string();
        assert_eq!(
            newer,
            "telemetry port state version 3 is outside the versions 1 to 2 this ferry loads; \
             a newer ferry takes an older one's guest, not the reverse: update the \
             destination's ferry"
        );
        let older = DeviceStateError::check_version("telemetry port", 0, kind.loads())
            .unwrap_err()
            .to_string();
        assert!(
            older.contains("version 0 is outside the versions 1 to 2"),
            "{older}"
        );
        assert!(older.contains("a ferry release between the two"), "{older}");
        assert_eq!(
            SectionKind::single(SERIAL, 1).loads(),
            1..=1,
            "one layout, written and loaded"
        );
    }
}
