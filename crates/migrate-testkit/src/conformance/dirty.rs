//! Checks of dirty tracking: what `fetch_dirty` reports, from the start of tracking to its
//! restart.

use ferry_migrate::SourceVm;

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{
    fetch, ok, start_tracking, touch_each_region, tracking_paused_source,
};

/// Tracking starts empty once armed: a page nobody wrote since is not reported, whatever was
/// written before.
pub fn dirty_log_starts_empty<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("pause", src.pause());
    touch_each_region(f, &mut src);
    start_tracking(&mut src, "start_dirty_log");
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
    start_tracking(&mut src, "start_dirty_log (again)");
    assert_eq!(
        fetch(&mut src),
        Vec::<u64>::new(),
        "writes made while nothing tracked, after a restart"
    );
    let written = touch_each_region(f, &mut src);
    assert_eq!(fetch(&mut src), written, "writes after a restart");
    src.stop_dirty_log();
}
