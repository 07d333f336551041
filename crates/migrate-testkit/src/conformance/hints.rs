//! The check of free page hinting: a round of hints asked for while dirty tracking runs, taken
//! as they arrive, stopped, and finished while the guest is paused, as the engine drives it.

use std::time::{Duration, Instant};

use ferry_migrate::wire::PAGE_SIZE;
use ferry_migrate::{SourceVm, VmError};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{ok, sorted};

/// How long a guest with free memory may take to hint some: its driver answers the request
/// at its next look, within a heartbeat or two on an idle machine.
const HINTS_WITHIN: Duration = Duration::from_secs(20);

/// How often the check takes what arrived, as a pass takes hints between its batches.
const TAKE_EVERY: Duration = Duration::from_millis(5);

/// Long enough for a driver to hint again after the stop, had the VMM not ended the round:
/// hints come within moments of each other while a round runs.
const AFTER_STOP: Duration = Duration::from_millis(200);

/// Hints asked for (`start_hints`, after dirty tracking started, as the engine asks) arrive
/// (`take_hints`) as page-aligned, non-empty ranges inside guest RAM; after `stop_hints` and a
/// last take, none arrives any more; `finish_hints` works while the guest is paused. Or
/// hinting is unsupported, and the engine asks nothing more of it.
pub fn free_page_hints_arrive_and_stop_or_are_refused<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("start_dirty_log", src.start_dirty_log());
    match src.start_hints() {
        Err(VmError::Unsupported { .. }) => {
            src.stop_dirty_log();
            return;
        }
        r => ok("start_hints", r),
    }
    let mut hints = Vec::new();
    let deadline = Instant::now() + HINTS_WITHIN;
    while hints.is_empty() {
        assert!(
            Instant::now() < deadline,
            "no free page hint arrived within {HINTS_WITHIN:?} of start_hints (the fixture's \
             guest has free memory to hint: Fixture::source)"
        );
        std::thread::sleep(TAKE_EVERY);
        ok("take_hints", src.take_hints(&mut hints));
    }
    ok("stop_hints", src.stop_hints());
    // Hints that arrived before the stop may still be taken once.
    ok("take_hints after stop_hints", src.take_hints(&mut hints));
    let regions = sorted(src.ram());
    for &(gpa, len) in &hints {
        assert!(
            gpa.is_multiple_of(PAGE_SIZE) && len.is_multiple_of(PAGE_SIZE) && len > 0,
            "a hint of {len:#x} bytes at {gpa:#x}: empty, or not whole pages"
        );
        assert!(
            regions
                .iter()
                .any(|r| gpa >= r.gpa && gpa + len <= r.gpa + r.size),
            "a hint of {len:#x} bytes at {gpa:#x} is not inside one RAM region"
        );
    }
    std::thread::sleep(AFTER_STOP);
    let mut late = Vec::new();
    ok("take_hints", src.take_hints(&mut late));
    assert!(
        late.is_empty(),
        "hints arrived after stop_hints and a take: {late:x?}"
    );
    ok("pause", src.pause());
    ok("finish_hints while paused", src.finish_hints());
    src.stop_dirty_log();
    ok("resume", src.resume());
}
