//! The policy that finishes, over the fake VMM: a guest that dirties memory faster than the
//! link carries it stalls precopy; the default policy throttles it until precopy converges,
//! and with postcopy on a stall the guest moves to the destination instead. Without either,
//! the same guest runs into the timeout.

use std::time::Duration;

use ferry_migrate::source::{Mode, Postcopy, SourceParams};
use ferry_migrate::stats::PostcopyTrigger;
use ferry_migrate::{Control, MigrateError, Policy, TimeoutAction};
use ferry_migrate_testkit::loopback::migrate;
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;
/// 32 MiB at 100 MB/s: a pass over all of it takes ~0.33 s.
const GUEST: u64 = 32 * MIB;
const LINK: u64 = 100_000_000;

/// A guest writing 64 random pages per millisecond (up to ~256 MB/s of dirty pages): at the
/// 100 MB/s link the unique pages it dirties during a pass outnumber half of what the pass
/// sends until the throttle reaches ~80%.
fn hot_guest() -> (FakeVm, FakeVm) {
    let mut src = FakeVm::new(GUEST, 2);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 0xac,
        zero_percent: 5,
        interval: Duration::from_millis(1),
    });
    (src, FakeVm::new(GUEST, 2))
}

fn params(policy: Policy, mode: Mode) -> SourceParams {
    SourceParams {
        max_bandwidth: Some(LINK),
        mode,
        ..SourceParams::new(policy, [0x11; 16])
    }
}

/// 20 ms at 100 MB/s: ~2 MB, a few hundred pages, so only a throttled guest fits.
const DOWNTIME: Duration = Duration::from_millis(20);

#[test]
fn the_default_policy_throttles_a_stalled_guest_until_precopy_converges() {
    let (mut src, mut dst) = hot_guest();
    let policy = Policy {
        downtime_limit: DOWNTIME,
        ..Policy::default()
    };
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &params(policy, Mode::Precopy),
        &Control::default(),
    );
    let stats = sent.expect("the default policy finishes");
    received.expect("the destination's side");
    assert!(stats.converged, "converged by the throttle: {stats:?}");
    assert!(
        stats.throttle_max_percent >= 20,
        "the guest was throttled: {stats:?}"
    );
    // The throttle rose in the policy's steps, one per stalled pass, and never fell.
    let steps: Vec<u8> = stats.passes.iter().map(|p| p.throttle_percent).collect();
    eprintln!("throttle per pass: {steps:?}");
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    assert!(
        steps.iter().all(|&t| t == 0 || (20..=99).contains(&t)),
        "{steps:?}"
    );
    assert_eq!(src.throttle(), 0, "the throttle is lifted at the end");
    assert!(src.contents() == dst.contents(), "memory differs");
}

/// The fake VMM cannot tell which writer dirtied a page, like a VMM without a dirty ring:
/// auto-converge asked to limit each vCPU throttles instead, from the first stall, and says so.
#[test]
fn auto_converge_by_dirty_limit_throttles_where_the_vmm_cannot_limit_each_vcpu() {
    let (mut src, mut dst) = hot_guest();
    let policy = Policy {
        downtime_limit: DOWNTIME,
        converge_by: ferry_migrate::ConvergeBy::DirtyLimit,
        ..Policy::default()
    };
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &params(policy, Mode::Precopy),
        &Control::default(),
    );
    let stats = sent.expect("the throttle finishes it");
    received.expect("the destination's side");
    assert!(stats.converged, "{stats:?}");
    assert!(stats.dirty_limit_unsupported, "{stats:?}");
    assert_eq!(stats.dirty_limit_min, None);
    // The first stalled pass throttled already: the fallback took the step at once.
    assert_eq!(
        stats
            .passes
            .iter()
            .map(|p| p.throttle_percent)
            .find(|&t| t > 0),
        Some(20),
        "{:?}",
        stats.passes
    );
    assert_eq!(src.throttle(), 0, "the throttle is lifted at the end");
    assert!(src.contents() == dst.contents(), "memory differs");
}

/// A migration asked for a dirty limit the VMM cannot enforce fails before it sends a page,
/// with the VMM's reason, and the guest runs on.
#[test]
fn a_dirty_limit_the_vmm_cannot_enforce_fails_the_migration_and_the_guest_runs_on() {
    let (mut src, mut dst) = hot_guest();
    let p = SourceParams {
        dirty_limit: Some(10_000_000),
        ..params(Policy::default(), Mode::Precopy)
    };
    let (sent, _) = migrate(&mut src, &mut dst, &p, &Control::default());
    let e = sent.expect_err("refused");
    assert!(e.to_string().contains("dirty limit"), "{e}");
    let before = src.writes();
    std::thread::sleep(Duration::from_millis(50));
    assert!(src.writes() > before, "the guest writes on");
}

#[test]
fn postcopy_on_stall_moves_the_guest_instead_of_throttling_it() {
    let (mut src, mut dst) = hot_guest();
    let policy = Policy {
        downtime_limit: DOWNTIME,
        ..Policy::default()
    };
    let on_stall = Postcopy {
        on_stall: true,
        ..Postcopy::default()
    };
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &params(policy, Mode::Postcopy(on_stall)),
        &Control::default(),
    );
    let stats = sent.expect("postcopy finishes");
    received.expect("the destination's side");
    let pc = stats.postcopy.clone().expect("switched to postcopy");
    assert_eq!(pc.trigger, PostcopyTrigger::Policy);
    // Two stalled passes are the trigger: pass 1 and the first dirty pass.
    assert_eq!(pc.after_passes, 2, "{stats:?}");
    assert_eq!(stats.throttle_max_percent, 0, "never throttled");
    assert!(src.contents() == dst.contents(), "memory differs");
}

#[test]
fn without_auto_converge_the_same_guest_runs_into_the_timeout_and_keeps_running() {
    let (mut src, mut dst) = hot_guest();
    // 8 MiB written before every sync as well: a loaded machine once kept the writer thread
    // off the cores for a whole pass, so the guest looked idle and converged.
    src.writes_per_sync(2048);
    let policy = Policy {
        downtime_limit: DOWNTIME,
        timeout: Some(Duration::from_secs(2)),
        timeout_action: TimeoutAction::Cancel,
        auto_converge: None,
        converge_by: Default::default(),
    };
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &params(policy, Mode::Precopy),
        &Control::default(),
    );
    assert!(
        matches!(sent, Err(MigrateError::Timeout(_))),
        "precopy alone does not converge: {sent:?}"
    );
    assert!(received.is_err());
    assert!(!src.is_paused(), "the source keeps running");
    assert_eq!(src.throttle(), 0);
}
