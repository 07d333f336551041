//! The device state as a snapshot holds it (docs/snapshot.md, "the state area"): the sections
//! one after another, each a 16-byte header (id, instance, version, length) and its data. The
//! decoder keeps a migration's bounds (`destination::sections`): at most
//! [`wire::MAX_SECTIONS`] sections, [`wire::MAX_STATE_BYTES`] in all, each (id, instance) once.

#![forbid(unsafe_code)]

use crate::destination::sections::Sections;
use crate::error::MigrateError;
use crate::vm::Section;
use crate::wire::{self, SECTION_HEADER_SIZE};

/// The state area's bytes for `sections`.
pub fn encode(sections: &[Section]) -> Vec<u8> {
    let len: usize = sections
        .iter()
        .map(|s| SECTION_HEADER_SIZE + s.data.len())
        .sum();
    let mut out = Vec::with_capacity(len);
    for s in sections {
        let mut h = s.header().encode();
        h[12..16].copy_from_slice(&(s.data.len() as u32).to_le_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(&s.data);
    }
    out
}

/// The sections in a state area, or why it is not one.
pub fn decode(mut area: &[u8]) -> Result<Vec<Section>, MigrateError> {
    let mut sections = Sections::default();
    let mut payload = Vec::new();
    while !area.is_empty() {
        let Some((h, rest)) = area.split_first_chunk::<SECTION_HEADER_SIZE>() else {
            return Err(wire::WireError::SectionHeader(area.len()).into());
        };
        let len = u32::from_le_bytes(h[12..16].try_into().unwrap()) as usize;
        if len > rest.len() {
            return Err(wire::WireError::SectionHeader(area.len()).into());
        }
        payload.clear();
        payload.extend_from_slice(&h[..12]);
        payload.extend_from_slice(&[0; 4]);
        payload.extend_from_slice(&rest[..len]);
        sections.add(&payload)?;
        area = &rest[len..];
    }
    Ok(sections.into_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::SectionId;

    fn section(id: u32, instance: u32, data: &[u8]) -> Section {
        Section {
            id: SectionId(id),
            instance,
            version: 3,
            data: data.to_vec(),
        }
    }

    #[test]
    fn sections_come_back_as_they_went_in() {
        let sections = vec![
            section(1, 0, b"vcpu"),
            section(1, 1, b""),
            section(7, 0, &[9; 100]),
        ];
        assert_eq!(decode(&encode(&sections)).unwrap(), sections);
        assert_eq!(decode(&[]).unwrap(), vec![]);
    }

    #[test]
    fn a_cut_or_repeated_section_is_refused() {
        let bytes = encode(&[section(1, 0, b"vcpu state")]);
        for cut in [1, SECTION_HEADER_SIZE - 1, SECTION_HEADER_SIZE + 3] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let twice = encode(&[section(1, 0, b"a"), section(1, 0, b"b")]);
        assert!(decode(&twice).is_err());
    }
}
