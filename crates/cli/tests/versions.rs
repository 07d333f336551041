//! Section layout versions end to end on real KVM: a newer ferry takes a guest from an older
//! one, and an older ferry refuses the newer one's guest before the source pauses. A `ferry run
//! --next-section-layout` stands for the newer ferry: its telemetry port writes the next
//! section layout and loads today's too; an ordinary `ferry run` is the older one.

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, stderr};

const GUEST: &str = "ws=64M pattern=random rate=40 verify-ms=200 log-ms=0";
const LIMIT: Duration = Duration::from_secs(60);
/// The telemetry port's layouts (`devices::telemetry_port`): the oldest today's ferry loads,
/// today's, and the next one.
const OLDEST: u32 = ferry_vmm::devices::telemetry_port::OLDEST;
const TODAY: u32 = ferry_vmm::devices::telemetry_port::VERSION;
const NEXT: u32 = ferry_vmm::devices::telemetry_port::NEXT_VERSION;

/// A 512 MiB `ferry run --incoming unix:...` destination (with `extra`).
fn destination(extra: &[&str]) -> (RunningVm, String) {
    common::unix_destination("512M", extra)
}

fn migrate_local(src: &RunningVm, to: &str) -> std::process::Output {
    ferry()
        .args(["migrate", "--local", "--to", to])
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap()
}

#[test]
fn a_newer_ferry_takes_an_older_ones_guest_and_an_older_one_refuses_it_before_the_pause() {
    let old = RunningVm::start("512M", GUEST);
    old.wait_until("a verify pass", LIMIT, |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });

    // Older to newer: the newer ferry loads today's layout.
    let (new, to_new) = destination(&["--next-section-layout"]);
    let out = migrate_local(&old, &to_new);
    assert!(out.status.success(), "{}", stderr(&out));
    new.assert_verifies_clean();
    drop(old);

    // Newer to older: refused at the hello, before the guest paused, naming the section, both
    // versions and the fix; the guest runs on in the newer ferry.
    let (older, to_older) = destination(&[]);
    let out = migrate_local(&new, &to_older);
    assert!(!out.status.success(), "the older ferry took the guest");
    let err = stderr(&out);
    let want = format!(
        "telemetry port state version {NEXT} is outside the versions {OLDEST} to {TODAY} this ferry loads"
    );
    assert!(err.contains(&want), "{err}");
    // The refusal answers the hello (`MigrateError::Refused`), which comes before the pause.
    assert!(
        err.contains("the destination refused the migration"),
        "{err}"
    );
    assert!(err.contains("update the destination's ferry"), "{err}");
    assert_eq!(new.status()["state"], "running");
    drop(older);
    new.assert_verifies_clean();
}
