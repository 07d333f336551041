//! Checks of what auto-converge uses to slow a guest down: the throttle, the per-vCPU dirty
//! limit, and the per-vCPU dirtying a VMM reports (`vcpu_dirty`), which shows who a limit
//! slowed. Each is optional: a VMM that cannot refuses as unsupported, and then refuses for
//! good, never succeeds without an effect.

use std::time::{Duration, Instant};

use ferry_migrate::policy::DIRTY_LIMIT_FLOOR;
use ferry_migrate::{SourceVm, VcpuDirty, VmError};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{fetch, ok, tracking_paused_source};

/// The dirty limit the check sets: the lowest the engine asks for, which a guest writing as
/// [`Fixture::guest_writes`] says outruns, so its vCPU must be seen to sleep.
const LIMIT: u64 = DIRTY_LIMIT_FLOOR;

/// How long the guest may write under the limit before a vCPU is seen to sleep. A VMM charges
/// a vCPU when it learns what the vCPU dirtied (a dirty sync, a full log), and it sleeps
/// within moments of owing; seconds leave room for a loaded machine.
const LIMIT_SEEN_WITHIN: Duration = Duration::from_secs(20);

/// Time for a vCPU to take a sleep it owes, or to wake from one it began before the limit was
/// lifted: the sleep a VMM takes at once is a slice of its debt (50 ms in ferry's VMM; QEMU's
/// dirty limit sleeps similar slices), ten times over.
const LIFT_SETTLES_WITHIN: Duration = Duration::from_millis(500);

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

/// A dirty limit set while the guest writes faster makes a writing vCPU sleep, which
/// `vcpu_dirty` reports, with the pages it dirtied; once lifted, no vCPU sleeps for it any
/// more. Or it is refused as unsupported, again for another rate, and `vcpu_dirty` reports no
/// sleep (a migration asked for a limit then fails before it starts, and auto-converge
/// throttles instead).
pub fn dirty_limit_slows_a_writing_vcpu_or_is_refused<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    ok("start_dirty_log", src.start_dirty_log());
    match src.set_dirty_limit(Some(LIMIT)) {
        Err(VmError::Unsupported { .. }) => {
            let again = src.set_dirty_limit(Some(LIMIT * 10));
            assert!(
                matches!(again, Err(VmError::Unsupported { .. })),
                "set_dirty_limit refused {LIMIT} B/s as unsupported, then answered {again:?} \
                 for {} B/s",
                LIMIT * 10
            );
            f.guest_writes(&mut src);
            fetch(&mut src);
            assert_eq!(slept_ms(&src.vcpu_dirty()), 0.0, "with no dirty limit");
            ok("pause", src.pause());
            src.stop_dirty_log();
            return;
        }
        r => ok(&format!("set_dirty_limit({LIMIT} B/s)"), r),
    }
    let deadline = Instant::now() + LIMIT_SEEN_WITHIN;
    // A dirty sync after each stretch of writes, as precopy makes them: where a VMM learns
    // what each vCPU dirtied, and charges it.
    while slept_ms(&src.vcpu_dirty()) == 0.0 {
        assert!(
            Instant::now() < deadline,
            "no vCPU slept for a {LIMIT} B/s dirty limit within {LIMIT_SEEN_WITHIN:?} of guest \
             writes: vcpu_dirty() = {:?}",
            src.vcpu_dirty()
        );
        f.guest_writes(&mut src);
        fetch(&mut src);
    }
    let counts = src.vcpu_dirty();
    assert!(
        counts
            .iter()
            .any(|v| v.dirtied_pages > 0 && v.limited_ms > 0.0),
        "a vCPU slept for the dirty limit, and none that slept dirtied a page: {counts:?}"
    );

    ok("set_dirty_limit(None)", src.set_dirty_limit(None));
    fetch(&mut src);
    std::thread::sleep(LIFT_SETTLES_WITHIN);
    let before = slept_ms(&src.vcpu_dirty());
    // Writes and a sync, and the time a vCPU charged for them would take to sleep.
    f.guest_writes(&mut src);
    fetch(&mut src);
    std::thread::sleep(LIFT_SETTLES_WITHIN);
    let after = slept_ms(&src.vcpu_dirty());
    assert_eq!(
        after,
        before,
        "vCPUs slept {:.1} ms more for a dirty limit lifted {LIFT_SETTLES_WITHIN:?} before",
        after - before
    );
    ok("pause", src.pause());
    src.stop_dirty_log();
}

/// `vcpu_dirty` counts what each vCPU dirtied since tracking started: nothing for a guest
/// paused since; pages, by some vCPU, once the guest wrote (and was synced); no sleep without
/// a dirty limit; each vCPU once; and nothing again after tracking restarts. Or nothing at
/// all: a VMM that cannot tell which vCPU dirtied a page reports an empty list.
pub fn vcpu_dirty_counts_since_tracking_started<F: Fixture>(f: &mut F) {
    let mut src = tracking_paused_source(f);
    idle(
        &src.vcpu_dirty(),
        "with the guest paused since tracking started",
    );
    ok("resume", src.resume());
    f.guest_writes(&mut src);
    ok("pause", src.pause());
    fetch(&mut src);
    let counts = src.vcpu_dirty();
    if !counts.is_empty() {
        let mut ids: Vec<u32> = counts.iter().map(|v| v.vcpu).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), counts.len(), "a vCPU counted twice: {counts:?}");
        assert!(
            counts.iter().any(|v| v.dirtied_pages > 0),
            "the guest wrote, and no vCPU dirtied a page: {counts:?}"
        );
        assert_eq!(slept_ms(&counts), 0.0, "with no dirty limit: {counts:?}");
    }
    src.stop_dirty_log();
    ok("start_dirty_log (again)", src.start_dirty_log());
    fetch(&mut src);
    idle(
        &src.vcpu_dirty(),
        "after tracking restarted with the guest paused",
    );
    src.stop_dirty_log();
}

/// Time all vCPUs slept for a dirty limit, in ms.
fn slept_ms(counts: &[VcpuDirty]) -> f64 {
    counts.iter().map(|v| v.limited_ms).sum()
}

/// Asserts that no vCPU dirtied a page or slept.
fn idle(counts: &[VcpuDirty], when: &str) {
    assert!(
        counts
            .iter()
            .all(|v| v.dirtied_pages == 0 && v.limited_ms == 0.0),
        "vcpu_dirty() {when}: {counts:?}"
    );
}
