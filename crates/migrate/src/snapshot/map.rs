//! A mapped restore's one step of its own: where each region of guest RAM lies in the file, as
//! the [`FileRegion`]s a VMM maps copy-on-write ([`crate::DestinationVm::map_file`]).
//!
//! Nothing of guest RAM is read, so nothing of it is checked: the page CRCs a mapped restore
//! cannot check before the guest runs are the trade it makes for running at once (the header,
//! the configuration, the device state, the hot set and the CRC table itself are checked as
//! for any restore, when the file opens). A page damaged on disk reaches the guest as it is.

use std::path::Path;

use super::error::SnapshotError;
use super::format::Header;
use crate::vm::FileRegion;
use crate::wire::PAGE_SIZE;

/// The file regions of `header`'s guest RAM, each checked to lie at a page-aligned offset
/// (ferry writes them so: the RAM area starts 2 MiB aligned and every region's size is whole
/// pages); a file that breaks it is refused, naming the region.
pub fn file_regions(header: &Header, path: &Path) -> Result<Vec<FileRegion>, SnapshotError> {
    header
        .regions
        .iter()
        .map(|r| {
            let file_offset = header.ram_offset.saturating_add(r.offset);
            if !file_offset.is_multiple_of(PAGE_SIZE) || !r.size.is_multiple_of(PAGE_SIZE) {
                return Err(SnapshotError::Unmappable {
                    path: path.to_owned(),
                    gpa: r.gpa,
                    offset: file_offset,
                    page: PAGE_SIZE,
                });
            }
            Ok(FileRegion {
                gpa: r.gpa,
                size: r.size,
                file_offset,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn header() -> Header {
        Header::layout(
            1,
            [1; 16],
            &[(0, 3072 * MIB), (4096 * MIB, 1024 * MIB)],
            100,
            1000,
            16,
        )
    }

    #[test]
    fn each_region_maps_at_its_place_in_the_ram_area() {
        let h = header();
        let got = file_regions(&h, Path::new("vm.snap")).unwrap();
        assert_eq!(
            got,
            vec![
                FileRegion {
                    gpa: 0,
                    size: 3072 * MIB,
                    file_offset: h.ram_offset,
                },
                FileRegion {
                    gpa: 4096 * MIB,
                    size: 1024 * MIB,
                    file_offset: h.ram_offset + 3072 * MIB,
                },
            ]
        );
    }

    #[test]
    fn a_region_off_a_page_boundary_is_refused_naming_it_and_the_fix() {
        let mut h = header();
        h.regions[1].offset += 512;
        let e = file_regions(&h, Path::new("vm.snap"))
            .unwrap_err()
            .to_string();
        for want in ["vm.snap", "0x100000000", "4096-byte page", "without --map"] {
            assert!(e.contains(want), "{want:?} in {e}");
        }
    }
}
