//! A conformance suite for VMMs: the contracts of [`SourceVm`] and [`DestinationVm`] that the
//! engine relies on, checked against a real implementation. A VMM implements [`Fixture`] (how
//! to make its VMs, and how to make a write happen in a guest, which the engine cannot know)
//! and instantiates every check as a test with [`conformance_tests!`](crate::conformance_tests):
//!
//! ```ignore
//! // tests/conformance.rs of a VMM crate, with ferry-migrate-testkit in dev-dependencies
//! ferry_migrate_testkit::conformance_tests!(MyFixture::new());
//! ```
//!
//! The checks, and what the engine does that needs them:
//!
//! - [`ram_is_well_formed`]: regions are page aligned, non-empty, non-overlapping once sorted
//!   and accepted by the engine; readable through `host_addr`; and `fd` at `file_offset` holds
//!   the same bytes (pass 1 finds populated memory with `SEEK_DATA` on that file). A
//!   destination's regions have the source's layout.
//! - [`dirty_log_starts_empty`]: a page nobody wrote since tracking started is not reported
//!   (pass 1 sends populated memory once; a log that reported all of RAM would send it
//!   again), and [`vmm_writes_are_reported`], [`guest_writes_are_reported`]: one written
//!   afterwards by the VMM or by the guest is (a lost write is a corrupt migration).
//! - [`fetch_clears_what_it_reports`]: a second fetch without writes reports nothing (else
//!   precopy never converges).
//! - [`dirty_log_restarts`]: stopping and starting again tracks as the first time (a cancelled
//!   migration is followed by another).
//! - [`paused_source_saves_state`], [`destination_loads_the_sources_state`]: switchover.
//! - [`destination_file_is_its_memory`]: a byte written to a destination region's `fd` at
//!   `file_offset` shows through `host_addr` (with [`PageLanding::File`], the engine writes
//!   received pages through the file).
//! - [`destination_refuses_bad_state`]: a section with another version, without its data, or of
//!   a kind the VMM never saved is refused with an error, not a panic and not a silent success.
//!
//! Silent success is what the checks catch: an operation that returns `Ok` without doing its
//! work (a fetch that reports nothing, a load that accepts anything) fails the check watching
//! its effect. [`VmError::Unsupported`] from any operation fails the suite with that name: the
//! engine needs every one of them to migrate a VM.
//!
//! The suite's own invariants: it writes guest memory only while the source is paused and only
//! with the byte already there (or puts it back), so a real guest running a workload stays
//! correct; and it treats sections as opaque (save, change the version, drop the data, load), so
//! a VMM's section encoding is its own business.

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::panic::AssertUnwindSafe;

use ferry_migrate::bitmap::{Cursor, DirtyBitmap};
use ferry_migrate::ram::{Ram, RamRegion};
use ferry_migrate::wire::{PAGE_SIZE, SectionId};
use ferry_migrate::{DestinationVm, PageLanding, Section, SourceVm, VmError};

/// What a VMM provides to run the suite on itself.
pub trait Fixture {
    type Source: SourceVm;
    type Destination: DestinationVm;

    /// A new running source VM. Its guest may write memory while it runs; the suite pauses it
    /// when it needs quiet.
    fn source(&mut self) -> Self::Source;

    /// A new destination VM with the same memory size as [`Fixture::source`]'s, not started.
    fn destination(&mut self) -> Self::Destination;

    /// Writes `byte` at `gpa` of `vm`'s RAM the way the VMM itself writes guest memory (a
    /// device model, a loader), so that the write must show in `fetch_dirty` while tracking.
    /// Called while `vm` is paused too.
    fn vmm_write(&mut self, vm: &mut Self::Source, gpa: u64, byte: u8);

    /// Lets `vm`'s guest (which the suite has just resumed) write memory by its own means,
    /// vCPUs through the hypervisor for a real VMM, and returns once it has: guest address
    /// ranges at least one of whose pages it wrote. The suite pauses `vm` afterwards.
    fn guest_writes(&mut self, vm: &mut Self::Source) -> Vec<Range<u64>>;
}

/// Instantiates every check of [`crate::conformance`] as a `#[test]` in the calling module,
/// each with a fixture made by `$fixture` (an expression evaluated once per test).
#[macro_export]
macro_rules! conformance_tests {
    ($fixture:expr) => {
        $crate::conformance_tests!(@each $fixture;
            ram_is_well_formed,
            dirty_log_starts_empty,
            vmm_writes_are_reported,
            guest_writes_are_reported,
            fetch_clears_what_it_reports,
            dirty_log_restarts,
            paused_source_saves_state,
            throttle_is_set_and_lifted_or_refused,
            destination_loads_the_sources_state,
            destination_file_is_its_memory,
            destination_refuses_bad_state,
        );
    };
    (@each $fixture:expr; $($check:ident,)*) => {
        $(
            #[test]
            fn $check() {
                let mut fixture = $fixture;
                $crate::conformance::$check(&mut fixture);
            }
        )*
    };
}

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
    let layout = |rs: Vec<RamRegion>| -> Vec<(u64, u64)> {
        sorted(rs).iter().map(|r| (r.gpa, r.size)).collect()
    };
    assert_eq!(
        layout(dst.ram()),
        layout(regions),
        "a destination of the same size has another RAM layout"
    );
}

/// Tracking starts empty: a page nobody wrote since is not reported, whatever was written
/// before.
pub fn dirty_log_starts_empty<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("pause", src.pause());
    touch_each_region(f, &mut src);
    ok("start_dirty_log", src.start_dirty_log());
    assert_eq!(
        fetch(&mut src),
        Vec::<u64>::new(),
        "pages written before tracking started, or by nobody"
    );
    src.stop_dirty_log();
}

/// A page the VMM writes while tracking is reported, and only it (once per page).
pub fn vmm_writes_are_reported<F: Fixture>(f: &mut F) {
    let mut src = tracking_paused_source(f);
    let written = touch_each_region(f, &mut src);
    assert_eq!(fetch(&mut src), written, "the pages the VMM wrote");
    src.stop_dirty_log();
}

/// A page the guest writes while tracking is reported.
pub fn guest_writes_are_reported<F: Fixture>(f: &mut F) {
    let mut src = tracking_paused_source(f);
    ok("resume", src.resume());
    let ranges = f.guest_writes(&mut src);
    ok("pause", src.pause());
    let dirty = fetch(&mut src);
    assert!(
        dirty
            .iter()
            .any(|gpa| ranges.iter().any(|r| r.contains(gpa))),
        "none of the {} pages reported lies where the guest wrote ({ranges:x?})",
        dirty.len()
    );
    src.stop_dirty_log();
}

/// Fetching clears: a second fetch without writes reports nothing.
pub fn fetch_clears_what_it_reports<F: Fixture>(f: &mut F) {
    let mut src = tracking_paused_source(f);
    let written = touch_each_region(f, &mut src);
    assert_eq!(fetch(&mut src), written);
    assert_eq!(fetch(&mut src), Vec::<u64>::new(), "after fetching writes");
    src.stop_dirty_log();
}

/// Stopping and starting again tracks as the first time: empty, then writes reported.
pub fn dirty_log_restarts<F: Fixture>(f: &mut F) {
    let mut src = tracking_paused_source(f);
    src.stop_dirty_log();
    touch_each_region(f, &mut src);
    ok("start_dirty_log (again)", src.start_dirty_log());
    assert_eq!(
        fetch(&mut src),
        Vec::<u64>::new(),
        "writes made while nothing tracked, after a restart"
    );
    let written = touch_each_region(f, &mut src);
    assert_eq!(fetch(&mut src), written, "writes after a restart");
    src.stop_dirty_log();
}

/// A paused source saves its state as sections, and runs again after.
pub fn paused_source_saves_state<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("pause", src.pause());
    let sections = ok("save_state", src.save_state());
    assert!(!sections.is_empty(), "save_state returned no sections");
    ok("resume", src.resume());
}

/// A throttle is taken and lifted, in any state a migration may set it (running, and lifted
/// while paused); or refused as unsupported, never failed otherwise (the engine turns
/// auto-converge off on `Unsupported` and fails the migration on anything else).
pub fn throttle_is_set_and_lifted_or_refused<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    match src.set_throttle(50) {
        Err(VmError::Unsupported { .. }) => return,
        r => ok("set_throttle(50)", r),
    }
    ok("set_throttle(99)", src.set_throttle(99));
    ok("pause", src.pause());
    ok("set_throttle(0) while paused", src.set_throttle(0));
    ok("resume", src.resume());
    ok("set_throttle(20)", src.set_throttle(20));
    ok("set_throttle(0)", src.set_throttle(0));
}

/// What a paused source saved, a fresh destination loads.
pub fn destination_loads_the_sources_state<F: Fixture>(f: &mut F) {
    let sections = saved_state(f);
    let mut dst = f.destination();
    ok("load_state", dst.load_state(&sections));
}

/// A destination's memory can be written through its file: a byte written at each region's
/// first and last page through `fd` reads back through the mapping, whatever
/// [`DestinationVm::page_landing`] says today (a VMM may change its answer per migration).
/// The bytes are put back, so a fresh destination stays as it was.
pub fn destination_file_is_its_memory<F: Fixture>(f: &mut F) {
    let dst = f.destination();
    let landing = dst.page_landing(1);
    assert!(
        matches!(landing, PageLanding::Mapping | PageLanding::File),
        "page_landing() = {landing:?}"
    );
    for r in sorted(dst.ram()) {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", r.fd))
            .unwrap_or_else(|e| panic!("the file of region {:#x} (fd {}): {e}", r.gpa, r.fd));
        for gpa in [r.gpa + 5, r.gpa + r.size - PAGE_SIZE + 9] {
            let was = file_byte(&r, gpa);
            let at = r.file_offset + (gpa - r.gpa);
            file.write_all_at(&[!was], at)
                .unwrap_or_else(|e| panic!("writing guest address {gpa:#x} to the file: {e}"));
            assert_eq!(
                host_byte(&r, gpa),
                !was,
                "a byte written to the file at guest address {gpa:#x} does not show in the mapping"
            );
            file.write_all_at(&[was], at).unwrap();
        }
    }
}

/// A destination refuses, with an error, a section of another version, a section without its
/// data, and a section of a kind the source never saved.
pub fn destination_refuses_bad_state<F: Fixture>(f: &mut F) {
    let good = saved_state(f);
    let mut dst = f.destination();
    let mut bad: Vec<(String, Vec<Section>)> = Vec::new();
    for i in 0..good.len() {
        let mut v = good.clone();
        v[i].version = v[i].version.wrapping_add(1);
        bad.push((format!("section {i} with version + 1"), v));
        if !good[i].data.is_empty() {
            let mut v = good.clone();
            v[i].data.clear();
            bad.push((format!("section {i} without its data"), v));
        }
    }
    let mut v = good.clone();
    v.push(unknown_section(&good));
    bad.push(("an unknown section".into(), v));
    for (what, sections) in bad {
        match std::panic::catch_unwind(AssertUnwindSafe(|| dst.load_state(&sections))) {
            Ok(Err(VmError::Unsupported { operation })) => {
                panic!("{what}: {operation} is unsupported; the engine needs load_state")
            }
            Ok(Err(_)) => {}
            Ok(Ok(())) => panic!("load_state accepted {what}"),
            Err(_) => panic!("load_state panicked on {what} instead of refusing it"),
        }
    }
}

/// A section of a kind no section in `saved` has. The only place the suite names a section
/// kind, so that a change to how sections are named touches one function.
fn unknown_section(saved: &[Section]) -> Section {
    let id = SectionId(
        saved
            .iter()
            .map(|s| s.id.0)
            .max()
            .unwrap_or(0)
            .wrapping_add(1)
            .max(1),
    );
    assert!(saved.iter().all(|s| s.id != id), "the source saved {id}");
    Section {
        id,
        instance: 0,
        version: 1,
        data: vec![0; 8],
    }
}

fn saved_state<F: Fixture>(f: &mut F) -> Vec<Section> {
    let mut src = f.source();
    ok("pause", src.pause());
    ok("save_state", src.save_state())
}

/// A paused source with dirty tracking on (started after the pause, so the log is empty):
/// nothing writes but the suite.
fn tracking_paused_source<F: Fixture>(f: &mut F) -> F::Source {
    let mut src = f.source();
    ok("pause", src.pause());
    ok("start_dirty_log", src.start_dirty_log());
    src
}

/// Unwraps an operation's result; `Unsupported` and failures fail the check, named.
fn ok<T>(operation: &str, r: Result<T, VmError>) -> T {
    match r {
        Ok(v) => v,
        Err(e @ VmError::Unsupported { .. }) => {
            panic!("{operation}: {e}; the engine needs it to migrate a VM")
        }
        Err(e) => panic!("{operation} failed: {e}"),
    }
}

fn sorted(mut regions: Vec<RamRegion>) -> Vec<RamRegion> {
    regions.sort_by_key(|r| r.gpa);
    regions
}

/// One `fetch_dirty` into a fresh bitmap: the reported pages, in address order.
fn fetch(src: &mut impl SourceVm) -> Vec<u64> {
    let mut bitmap = DirtyBitmap::new(&sorted(src.ram()));
    ok("fetch_dirty", src.fetch_dirty(&mut bitmap));
    let (mut cursor, mut pages) = (Cursor::default(), Vec::new());
    while !cursor.at_end(&bitmap) {
        bitmap.take(&mut cursor, usize::MAX, &mut pages);
    }
    pages
}

/// Has the VMM write, unchanged, a byte in the first and the last page of every region (a
/// page boundary apart from any other), and returns those pages in address order.
fn touch_each_region<F: Fixture>(f: &mut F, src: &mut F::Source) -> Vec<u64> {
    let mut pages = Vec::new();
    for r in sorted(src.ram()) {
        for page in [r.gpa, r.gpa + r.size - PAGE_SIZE] {
            let gpa = page + 100;
            f.vmm_write(src, gpa, host_byte(&r, gpa));
            pages.push(page);
        }
    }
    pages.dedup();
    pages
}

/// The byte at `gpa` of region `r`, read through its mapping with `/proc/self/mem`, so that a
/// region that is not mapped fails with an error instead of a fault.
fn host_byte(r: &RamRegion, gpa: u64) -> u8 {
    let mem = std::fs::File::open("/proc/self/mem").expect("/proc/self/mem");
    let at = r.host_addr as u64 + (gpa - r.gpa);
    let mut b = [0u8];
    mem.read_exact_at(&mut b, at)
        .unwrap_or_else(|e| panic!("guest address {gpa:#x} is not readable at {at:#x}: {e}"));
    b[0]
}

/// The byte at `gpa` of region `r`, read from its file at `file_offset`.
fn file_byte(r: &RamRegion, gpa: u64) -> u8 {
    let file = std::fs::File::open(format!("/proc/self/fd/{}", r.fd))
        .unwrap_or_else(|e| panic!("the file of region {:#x} (fd {}): {e}", r.gpa, r.fd));
    let mut b = [0u8];
    file.read_exact_at(&mut b, r.file_offset + (gpa - r.gpa))
        .unwrap_or_else(|e| panic!("reading guest address {gpa:#x} from the file: {e}"));
    b[0]
}
