//! Checks of guest RAM as the VMM describes it: the regions, their mappings and files, the way
//! a destination lands pages, and a destination adopting a source's RAM in a local handover.

use ferry_migrate::ram::Ram;
use ferry_migrate::wire::{LocalRegion, PAGE_SIZE};
use ferry_migrate::{DestinationVm, SourceVm, VmError};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{
    file_byte, handover, host_byte, land_byte, layout, ok, refused, set_file_byte, short_file,
    sorted,
};

/// The engine checks `ram()` as it will use it, and each region's mapping and file agree.
pub fn ram_is_well_formed<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    let regions = sorted(src.ram());
    assert!(!regions.is_empty(), "ram() has no regions");
    for r in &regions {
        assert!(
            r.gpa.is_multiple_of(PAGE_SIZE) && r.size.is_multiple_of(PAGE_SIZE) && r.size > 0,
            "region {r:?} is empty or not page aligned"
        );
    }
    for w in regions.windows(2) {
        assert!(
            w[0].gpa + w[0].size <= w[1].gpa,
            "regions overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
    // SAFETY: the regions are `src.ram()`, which `SourceVm`'s contract keeps mapped and
    // readable while `src` lives; the `Ram` is dropped at the end of this statement, before
    // `src`, and nothing reads through it.
    let accepted = unsafe { Ram::from_regions(regions.clone()) };
    assert!(accepted.is_ok(), "the engine refuses ram(): {accepted:?}");

    ok("pause", src.pause());
    for r in &regions {
        for gpa in [r.gpa, r.gpa + r.size - 1] {
            host_byte(r, gpa);
        }
        // A byte that differs from what is there, written by the VMM and read back through
        // the file, then put back.
        let gpa = r.gpa + r.size - PAGE_SIZE + 7;
        let was = host_byte(r, gpa);
        f.vmm_write(&mut src, gpa, !was);
        assert_eq!(
            (host_byte(r, gpa), file_byte(r, gpa)),
            (!was, !was),
            "a VMM write at {gpa:#x} does not show in the mapping and in fd at file_offset"
        );
        f.vmm_write(&mut src, gpa, was);
    }
    ok("resume", src.resume());

    let dst = f.destination();
    assert_eq!(
        layout(dst.ram()),
        layout(regions),
        "a destination of the same size has another RAM layout"
    );
}

/// A destination's memory can be written through its file: a byte written at each region's
/// first and last page through `fd` reads back through the mapping, whatever
/// [`DestinationVm::page_landing`] says today (a VMM may change its answer per migration).
/// The bytes are put back, so a fresh destination stays as it was.
pub fn destination_file_is_its_memory<F: Fixture>(f: &mut F) {
    let dst = f.destination();
    for r in sorted(dst.ram()) {
        for gpa in [r.gpa + 5, r.gpa + r.size - PAGE_SIZE + 9] {
            let was = file_byte(&r, gpa);
            set_file_byte(&r, gpa, !was);
            assert_eq!(
                host_byte(&r, gpa),
                !was,
                "a byte written to the file at guest address {gpa:#x} does not show in the mapping"
            );
            set_file_byte(&r, gpa, was);
        }
    }
}

/// Whatever [`DestinationVm::page_landing`] answers, for one data channel or many, that way in
/// works: a byte landed by it (written to the file for `File`, to the mapping for `Mapping`)
/// shows both in the mapping, which the guest runs on, and in the file, which a later snapshot
/// or migration of this VM reads. Put back after.
pub fn destination_lands_pages_as_it_says<F: Fixture>(f: &mut F) {
    let dst = f.destination();
    // One channel, the engine's default, the most it opens, and more than any asks for.
    for channels in [1, 2, 8, u16::MAX] {
        let landing = dst.page_landing(channels);
        for r in sorted(dst.ram()) {
            for gpa in [r.gpa + 3, r.gpa + r.size - PAGE_SIZE + 11] {
                let was = host_byte(&r, gpa);
                land_byte(landing, &r, gpa, !was);
                assert_eq!(
                    (host_byte(&r, gpa), file_byte(&r, gpa)),
                    (!was, !was),
                    "a byte landed at {gpa:#x} as page_landing({channels}) = {landing:?} says \
                     does not show in both the mapping and the file"
                );
                land_byte(landing, &r, gpa, was);
            }
        }
    }
}

/// A local handover: a destination adopts a running source's RAM (`adopt_ram`), and then its
/// regions have the source's layout and show what the source writes, through the mapping and
/// the file; a layout that is not this VM's (a region a page short, every region a page
/// higher) and a file that does not hold every region are refused, each by a fresh
/// destination. Or it is unsupported, and a handover is refused before the source pauses.
pub fn destination_adopts_the_sources_ram<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    let Some((regions, fds)) = handover(&src) else {
        // A region without a file: the engine refuses the handover itself.
        return;
    };
    let mut dst = f.destination();
    match dst.adopt_ram(&regions, fds) {
        Err(VmError::Unsupported { .. }) => return,
        r => ok("adopt_ram of the source's own layout", r),
    }
    assert_eq!(
        layout(dst.ram()),
        layout(src.ram()),
        "after adopt_ram, the destination's RAM layout is the source's"
    );
    // The suite writes the source's guest memory only while it is paused (its module doc).
    ok("pause", src.pause());
    for r in sorted(dst.ram()) {
        for gpa in [r.gpa + 13, r.gpa + r.size - PAGE_SIZE + 17] {
            let was = host_byte(&r, gpa);
            f.vmm_write(&mut src, gpa, !was);
            assert_eq!(
                (host_byte(&r, gpa), file_byte(&r, gpa)),
                (!was, !was),
                "a byte the source writes at {gpa:#x} does not show in the destination's \
                 mapping and file after adopt_ram"
            );
            f.vmm_write(&mut src, gpa, was);
        }
    }
    ok("resume", src.resume());

    let last = regions.len() - 1;
    let mut short = regions.clone();
    short[last].size -= PAGE_SIZE;
    let higher: Vec<LocalRegion> = regions
        .iter()
        .map(|r| LocalRegion {
            gpa: r.gpa + PAGE_SIZE,
            ..*r
        })
        .collect();
    let fds = || handover(&src).expect("as above").1;
    let files = regions.iter().map(|r| r.fd).max().unwrap_or(0) as usize + 1;
    let cases = [
        ("the last region a page short", short, fds()),
        ("every region a page higher", higher, fds()),
        (
            "a file of one page",
            regions.clone(),
            (0..files).map(|_| short_file()).collect(),
        ),
    ];
    for (what, layout, fds) in cases {
        let mut dst = f.destination();
        refused(
            &format!("adopt_ram of the source's RAM with {what}"),
            || dst.adopt_ram(&layout, fds),
        );
    }
}
