//! The prediction over the fake VMM: every pass end of a migration keeps one in its
//! statistics once the link's rate is measured, and with `Postcopy::auto` a guest writing
//! faster than the link is moved by postcopy because the prediction chose it.

use std::time::Duration;

use ferry_migrate::predict::Way;
use ferry_migrate::source::{Mode, Postcopy, SourceParams};
use ferry_migrate::stats::PostcopyTrigger;
use ferry_migrate::{Control, Policy};
use ferry_migrate_testkit::loopback::migrate;
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;
/// 32 MiB at 100 MB/s: pass 1 takes ~0.33 s, the rate window far past its 1 MiB.
const GUEST: u64 = 32 * MIB;
const LINK: u64 = 100_000_000;

/// A guest writing 64 random pages per millisecond (up to ~256 MB/s), faster than the link.
/// `always_dirty`: 8 MiB written before every sync as well, so that a loaded machine that
/// keeps the writer thread off the cores for a pass cannot make the guest look idle (as in
/// finish.rs); no throttle slows those writes, so only postcopy ends such a migration.
fn hot_guest(always_dirty: bool) -> (FakeVm, FakeVm) {
    let mut src = FakeVm::new(GUEST, 2);
    src.fill(1);
    src.start_writers(Writers {
        threads: 1,
        seed: 0x5e,
        zero_percent: 5,
        interval: Duration::from_millis(1),
    });
    if always_dirty {
        src.writes_per_sync(2048);
    }
    (src, FakeVm::new(GUEST, 2))
}

fn params(mode: Mode) -> SourceParams {
    let policy = Policy {
        downtime_limit: Duration::from_millis(20),
        ..Policy::default()
    };
    SourceParams {
        max_bandwidth: Some(LINK),
        mode,
        ..SourceParams::new(policy, [0x22; 16])
    }
}

#[test]
fn every_pass_end_keeps_a_prediction_and_the_last_names_the_way_taken() {
    let (mut src, mut dst) = hot_guest(false);
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &params(Mode::Precopy),
        &Control::default(),
    );
    let stats = sent.expect("the default policy finishes");
    received.expect("the destination's side");
    let running: Vec<_> = stats.passes.iter().filter(|p| !p.paused).collect();
    assert!(!running.is_empty());
    for p in &running {
        let predicted = p.predicted.expect("a prediction at every pass end");
        assert_eq!(predicted.pass, p.pass);
        assert!(predicted.postcopy.is_none(), "postcopy was not allowed");
        assert!(predicted.auto_converge.is_some(), "auto-converge is on");
    }
    let last = stats.last_prediction().expect("one");
    assert_eq!(last.chosen, stats.way_taken(), "{stats:?}");
}

#[test]
fn with_postcopy_auto_the_prediction_moves_a_guest_that_outruns_the_link() {
    let (mut src, mut dst) = hot_guest(true);
    let auto = Postcopy {
        auto: true,
        ..Postcopy::default()
    };
    let (sent, received) = migrate(
        &mut src,
        &mut dst,
        &params(Mode::Postcopy(auto)),
        &Control::default(),
    );
    let stats = sent.expect("postcopy finishes");
    received.expect("the destination's side");
    let pc = stats.postcopy.clone().expect("switched to postcopy");
    assert_eq!(pc.trigger, PostcopyTrigger::Prediction, "{stats:?}");
    assert_eq!(
        stats.last_prediction().map(|p| p.chosen),
        Some(Way::Postcopy)
    );
    assert_eq!(stats.throttle_max_percent, 0, "never throttled");
    assert!(src.contents() == dst.contents(), "memory differs");
}
