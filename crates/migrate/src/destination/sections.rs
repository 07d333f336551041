//! The device state a destination collects on the main connection until Complete: every
//! section is kept whole (the VMM loads them all at once, in the order it needs), so what a
//! source can make the destination hold is bounded here: at most [`wire::MAX_SECTIONS`]
//! sections and [`wire::MAX_STATE_BYTES`] in all, and each (id, instance) at most once.

#![forbid(unsafe_code)]

use std::collections::HashSet;

use crate::error::{Bound, MigrateError, ProtocolError};
use crate::vm::Section;
use crate::wire::{self, SectionHeader, SectionId};

/// Sections received so far.
#[derive(Debug, Default)]
pub(crate) struct Sections {
    sections: Vec<Section>,
    seen: HashSet<(SectionId, u32)>,
    bytes: u64,
}

impl Sections {
    /// Adds the section a DeviceState payload carries, or says why the stream is invalid.
    pub(crate) fn add(&mut self, payload: &[u8]) -> Result<(), MigrateError> {
        let (h, data) = SectionHeader::decode(payload)?;
        if self.sections.len() == wire::MAX_SECTIONS {
            return Err(ProtocolError::OverBound {
                bound: Bound::Sections,
                max: wire::MAX_SECTIONS as u64,
            }
            .into());
        }
        if self.bytes + data.len() as u64 > wire::MAX_STATE_BYTES {
            return Err(ProtocolError::OverBound {
                bound: Bound::StateBytes,
                max: wire::MAX_STATE_BYTES,
            }
            .into());
        }
        if !self.seen.insert((h.id, h.instance)) {
            return Err(ProtocolError::SectionTwice {
                id: h.id,
                instance: h.instance,
            }
            .into());
        }
        self.bytes += data.len() as u64;
        self.sections.push(Section {
            id: h.id,
            instance: h.instance,
            version: h.version,
            data: data.to_vec(),
        });
        Ok(())
    }

    pub(crate) fn into_vec(self) -> Vec<Section> {
        self.sections
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(id: u32, instance: u32, data: &[u8]) -> Vec<u8> {
        let mut p = SectionHeader {
            id: SectionId(id),
            instance,
            version: 1,
        }
        .encode()
        .to_vec();
        p.extend_from_slice(data);
        p
    }

    #[test]
    fn instances_of_one_id_are_kept_apart_and_duplicates_refused() {
        let mut s = Sections::default();
        s.add(&payload(9, 0, b"first")).unwrap();
        s.add(&payload(9, 1, b"second")).unwrap();
        let err = s.add(&payload(9, 1, b"again")).unwrap_err().to_string();
        assert!(err.contains("section 9 instance 1 sent twice"), "{err}");
        let v = s.into_vec();
        assert_eq!(v.len(), 2);
        assert_eq!((v[1].instance, v[1].data.as_slice()), (1, &b"second"[..]));
    }

    #[test]
    fn the_total_is_bounded() {
        let mut s = Sections::default();
        let big = vec![0u8; wire::MAX_SECTION_BYTES as usize];
        let fits = (wire::MAX_STATE_BYTES / wire::MAX_SECTION_BYTES) as u32;
        for i in 0..fits {
            s.add(&payload(1, i, &big)).unwrap();
        }
        let err = s.add(&payload(1, fits, b"x")).unwrap_err().to_string();
        assert!(err.contains("exceeds"), "{err}");
    }

    #[test]
    fn the_count_is_bounded() {
        let mut s = Sections::default();
        for i in 0..wire::MAX_SECTIONS as u32 {
            s.add(&payload(2, i, b"")).unwrap();
        }
        let err = s.add(&payload(3, 0, b"")).unwrap_err().to_string();
        assert!(err.contains("more than 1024"), "{err}");
    }

    #[test]
    fn a_zero_id_is_refused() {
        let err = Sections::default()
            .add(&payload(0, 0, b""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("id 0 is invalid"), "{err}");
    }
}
