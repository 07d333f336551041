//! Migration through the `ferry` binary: `ferry run --incoming`, `ferry migrate`, `ferry demo`,
//! and a destination killed mid-precopy. (A waiting destination's API, strays and cancel are in
//! `incoming.rs`.)

mod common;

use std::time::Duration;

use common::{RunningVm, destination, ferry, postcopy_migration, recover, start_migrate, stderr};

#[test]
fn ferry_migrate_moves_a_running_guest_between_two_ferry_processes() {
    let src = RunningVm::start(
        "512M",
        "ws=128M pattern=random rate=100 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = destination("512M");
    let out = ferry()
        .args([
            "migrate",
            "--to",
            &format!("tcp:127.0.0.1:{port}"),
            "--downtime-limit",
            "300ms",
            "--timeout",
            "60s",
            // Pass 1 then lasts ~0.6 s (128 MiB at 200 MB/s, the limiter counting every page
            // as sent), so the 200 ms progress poll sees precopy; unlimited, a 28 MB migration
            // can end between two polls.
            "--max-bandwidth",
            "200M",
        ])
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stderr(&out), text);
    assert!(
        stderr(&out).contains("migration completed"),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("precopy"),
        "live progress lines: {}",
        stderr(&out)
    );
    assert!(
        text.contains("downtime") && !text.contains("\"passes\""),
        "statistics as a table, without the JSON line (--output json gives that): {text}"
    );
    assert_eq!(src.status()["state"], "paused", "the source ends paused");
    dst.wait_until("the destination's API", Duration::from_secs(30), |vm| {
        vm.socket.exists()
    });
    let resumed = dst.status()["guest"]["verify_passes"].as_u64().unwrap();
    dst.wait_until(
        "verify passes on the destination",
        Duration::from_secs(60),
        |vm| vm.status()["guest"]["verify_passes"].as_u64() >= Some(resumed + 3),
    );
    let s = dst.status();
    assert_eq!(s["guest"]["verify_failures"], 0, "{s:#}");
    assert!(s["guest"]["migration_pause_ns"].as_u64().is_some(), "{s:#}");
}

#[test]
fn killing_the_destination_mid_precopy_leaves_the_source_running() {
    let src = RunningVm::start(
        "1G",
        "ws=512M pattern=random rate=50 verify-ms=300 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (mut dst, port) = destination("1G");
    let migrate = start_migrate(&src, port, &["--max-bandwidth", "20M"]);
    std::thread::sleep(Duration::from_millis(1500));
    dst.child.kill().unwrap();
    let out = migrate.wait_with_output().unwrap();
    assert!(!out.status.success(), "the migration must fail");
    let before = src.status();
    assert_eq!(before["state"], "running", "{before:#}");
    assert_eq!(src.status_of("/migration")["phase"], "failed");
    let passes = before["guest"]["verify_passes"].as_u64().unwrap();
    src.wait_until(
        "verify passes after the failure",
        Duration::from_secs(60),
        |vm| vm.status()["guest"]["verify_passes"].as_u64() >= Some(passes + 2),
    );
    assert_eq!(src.status()["guest"]["verify_failures"], 0);
}

#[test]
fn a_cancelled_migration_exits_with_status_3_and_the_source_keeps_running() {
    let src = RunningVm::start(
        "1G",
        "ws=512M pattern=random rate=50 verify-ms=300 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = destination("1G");
    let stats = src.dir.path().join("cancelled.json");
    // 20 MB/s: pass 1 of 512 MiB takes ~25 s, so the cancel lands mid-precopy.
    let migrate = start_migrate(
        &src,
        port,
        &[
            "--max-bandwidth",
            "20M",
            "--stats-out",
            stats.to_str().unwrap(),
        ],
    );
    std::thread::sleep(Duration::from_millis(1500));
    let cancel = src.control("cancel");
    assert!(cancel.status.success(), "{}", stderr(&cancel));
    let out = migrate.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("migration cancelled"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        stderr(&out).matches("keeps running").count(),
        1,
        "said once"
    );
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(said.starts_with("cancelled after "), "{said}");
    assert!(!said.contains("downtime"), "no table of zeros: {said}");
    assert_eq!(src.status()["state"], "running");
    assert_eq!(src.status_of("/migration")["phase"], "cancelled");
    let written: serde_json::Value =
        serde_json::from_str(&common::read(&stats)).expect("--stats-out wrote JSON");
    let timeline = written["timeline"].as_array().expect("a timeline");
    assert!(timeline.len() > 5, "{written:#}");
    assert_eq!(timeline.last().unwrap()["phase"], "cancelled");
    // The destination reads the source's cancel as a cancel (it read "failed", exit 1).
    let out = dst.finish(Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the source cancelled the migration"),
        "{}",
        stderr(&out)
    );
}

/// A destination started with `--incoming-retry` waits on after the source cancels, and takes
/// the next migration: the source just tries again. The first is started with `--detach`.
#[test]
fn a_destination_with_incoming_retry_takes_the_next_migration_after_a_cancel() {
    let src = RunningVm::start(
        "512M",
        "ws=128M pattern=random rate=20 verify-ms=300 log-ms=0 prefill=1",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = common::destination_with("512M", &["--incoming-retry"]);
    // 5 MB/s: pass 1 of 128 MiB takes ~25 s, so the cancel lands mid-precopy. --detach
    // returns once the migration started, and it goes on.
    let first = start_migrate(&src, port, &["--max-bandwidth", "5M", "--detach"])
        .wait_with_output()
        .unwrap();
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(
        stderr(&first).contains("in the background"),
        "{}",
        stderr(&first)
    );
    src.wait_until("precopy", Duration::from_secs(60), |vm| {
        vm.phase() == "precopy"
    });
    assert!(src.control("cancel").status.success());
    src.wait_until("cancelled", Duration::from_secs(30), |vm| {
        vm.phase() == "cancelled"
    });
    dst.wait_until("waiting again", Duration::from_secs(30), |vm| {
        vm.status_of("/migration")["phase"] == "waiting"
    });
    let out = start_migrate(&src, port, &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    dst.assert_verifies_clean();
}

#[test]
fn ferry_demo_migrates_and_the_guest_verifies_clean() {
    common::require_kvm();
    let out = ferry()
        .args([
            "demo",
            "--memory",
            "1G",
            "--ws",
            "256M",
            "--rate",
            "100",
            "--verify-passes",
            "2",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stderr(&out), text);
    assert!(text.contains("guest verdict: CLEAN"), "{text}");
    assert!(text.contains("downtime"), "{text}");
}

/// A 256 MiB guest running `guest`, migrated with postcopy after one pass at 10 MB/s (so that
/// postcopy lasts seconds) and paused there with `ferry migrate-pause`: the source, the
/// destination, and the `ferry migrate` that follows it.
fn paused_postcopy_migration(guest: &str) -> (RunningVm, RunningVm, std::process::Child) {
    let (src, dst, following) = postcopy_migration(guest, &[]);
    let out = src.control("migrate-pause");
    assert!(out.status.success(), "{}", stderr(&out));
    for vm in [&src, &dst] {
        vm.wait_until("postcopy_paused", Duration::from_secs(30), |vm| {
            vm.phase() == "postcopy_paused"
        });
    }
    (src, dst, following)
}

#[test]
fn ferry_migrate_pause_recover_and_resume_finish_a_postcopy_migration_with_the_guest_clean() {
    let (src, dst, first) =
        paused_postcopy_migration("ws=64M pattern=random read=30 rate=max verify-ms=200 log-ms=0");
    // A second pause has nothing to break.
    let again = src.control("migrate-pause");
    assert!(!again.status.success(), "a paused migration cannot pause");
    let (at, resumed) = recover(&src, &dst);
    assert!(
        at.starts_with("tcp:127.0.0.1:"),
        "it prints where it listens: {at}"
    );
    let text = String::from_utf8_lossy(&resumed.stdout);
    assert!(text.contains("1 recovery"), "the recovery line: {text}");
    let first = first.wait_with_output().unwrap();
    assert!(
        first.status.success(),
        "the first ferry migrate: {}",
        stderr(&first)
    );
    assert!(
        stderr(&first).contains("migration completed") && stderr(&first).contains("recovered 1×"),
        "it followed the migration through its recovery to the end: {}",
        stderr(&first)
    );
    dst.assert_verifies_clean();
}

/// Issue 48: `ferry migrate --resume` whose attempt failed kept following the migration,
/// paused again, instead of saying so and exiting non-zero. Now it ends with status 1 and the
/// next step; a recovery after it completes the migration with the guest clean.
#[test]
fn regression_a_resume_that_fails_exits_non_zero_and_the_migration_can_still_recover() {
    let (src, dst, first) =
        paused_postcopy_migration("ws=64M pattern=random rate=max verify-ms=200 log-ms=0");
    // Nothing listens there: the attempt fails at its connect.
    let nowhere = format!("tcp:127.0.0.1:{}", common::free_port());
    let started = std::time::Instant::now();
    let failed = ferry()
        .args(["migrate", "--resume", "--to", &nowhere])
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    assert_eq!(failed.status.code(), Some(1), "{}", stderr(&failed));
    assert!(
        stderr(&failed).contains("the resume failed")
            && stderr(&failed).contains("postcopy-paused again"),
        "{}",
        stderr(&failed)
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(src.phase(), "postcopy_paused");
    recover(&src, &dst);
    let first = first.wait_with_output().unwrap();
    assert!(first.status.success(), "{}", stderr(&first));
    dst.assert_verifies_clean();
}

/// `ferry migrate` following a postcopy-paused migration ignored Ctrl-C and SIGTERM (a cancel
/// is refused there): it now stops following, says the migration goes on in the VMM, and exits
/// 4; the migration is unharmed and a recovery completes it.
#[test]
fn regression_ferry_migrate_following_a_paused_postcopy_stops_on_sigterm_with_status_4() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let (src, dst, mut following) =
        paused_postcopy_migration("ws=64M pattern=random rate=max verify-ms=200 log-ms=0");
    kill(Pid::from_raw(following.id() as i32), Signal::SIGTERM).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while following.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = following.kill();
            panic!("ferry migrate still followed 30 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = following.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("stopped following") && stderr(&out).contains("goes on in the VMM"),
        "{}",
        stderr(&out)
    );
    assert_eq!(src.phase(), "postcopy_paused", "the migration goes on");
    recover(&src, &dst);
    dst.assert_verifies_clean();
}

/// Ctrl-C on a source `ferry run` during a migration stopped the VM at once with exit 0 (the
/// guest gone, and `ferry migrate` blaming a missing socket): the migration is now cancelled
/// first, and the VMM says so and exits 3.
#[test]
fn regression_ctrl_c_on_a_migrating_source_cancels_the_migration_first_and_exits_3() {
    let src = RunningVm::start(
        "512M",
        "ws=256M pattern=random rate=40 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (_dst, port) = destination("512M");
    // 20 MB/s: pass 1 takes seconds.
    let migrate = start_migrate(&src, port, &["--max-bandwidth", "20M"]);
    src.wait_until("precopy", Duration::from_secs(60), |vm| {
        ferry_vmm::api::client::request(&vm.socket, "GET", "/migration")
            .is_ok_and(|m| m["phase"] == "precopy")
    });
    let status = std::process::Command::new("kill")
        .args(["-INT", &src.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = src.finish(Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cancelling it first")
            && stderr(&out).contains("the migration away was cancelled"),
        "{}",
        stderr(&out)
    );
    // The VMM exits as soon as it stopped: its follower saw the cancel, or the VMM go away.
    let migrate = migrate.wait_with_output().unwrap();
    assert!(!migrate.status.success());
    assert!(
        stderr(&migrate).contains("cancelled") || stderr(&migrate).contains("source VMM stopped"),
        "ferry migrate says what happened: {}",
        stderr(&migrate)
    );
}

/// `ferry migrate` printed a table and a 3 KB JSON line together on stdout; `--output json`
/// prints the JSON line alone, parseable as it is.
#[test]
fn ferry_migrate_output_json_prints_one_parseable_line_and_nothing_else() {
    let src = RunningVm::start(
        "256M",
        "ws=32M pattern=random rate=20 verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = destination("256M");
    let out = start_migrate(&src, port, &["--output", "json"])
        .wait_with_output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    let stats: serde_json::Value =
        serde_json::from_str(text.trim()).expect("stdout is one JSON value");
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(
        stats["passes"].as_array().is_some_and(|p| !p.is_empty()),
        "{stats}"
    );
    assert!(
        stats.get("timeline").is_none(),
        "the timeline goes only to --stats-out"
    );
    dst.assert_verifies_clean();
}

/// `ferry migrate-set` changes a running migration's settings: a capped migration whose cap
/// is lifted finishes far sooner than the cap allowed, and the settings are shown in force.
/// Without a running migration it is refused with the reason, and without a setting it is a
/// usage error.
#[test]
fn ferry_migrate_set_lifts_the_bandwidth_cap_of_a_running_migration() {
    let src = RunningVm::start(
        "512M",
        "ws=256M pattern=random rate=20 verify-ms=300 log-ms=0 prefill=1",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let idle = src.control("migrate-set");
    assert_eq!(idle.status.code(), Some(2), "{}", stderr(&idle));
    let set = |extra: &[&str]| {
        common::ferry()
            .arg("migrate-set")
            .args(extra)
            .arg("--api-socket")
            .arg(&src.socket)
            .output()
            .unwrap()
    };
    let refused = set(&["--max-bandwidth", "unlimited"]);
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("no migration is running from this VM"),
        "{}",
        stderr(&refused)
    );
    let (dst, port) = destination("512M");
    let cap = 10_000_000.0;
    let migrate = start_migrate(&src, port, &["--max-bandwidth", "10M", "--output", "json"]);
    src.wait_until("precopy", Duration::from_secs(60), |vm| {
        vm.phase() == "precopy"
    });
    let out = set(&["--max-bandwidth", "unlimited", "--downtime-limit", "1s"]);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        said.contains("downtime limit 1000 ms, bandwidth unlimited"),
        "{said}"
    );
    let out = migrate.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let stats: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    let (total_ms, sent) = (
        stats["total_ms"].as_f64().unwrap(),
        stats["bytes_sent"].as_f64().unwrap(),
    );
    let capped_ms = sent / cap * 1e3;
    assert!(
        total_ms < capped_ms / 2.0,
        "{total_ms:.0} ms; {capped_ms:.0} ms at the cap"
    );
    dst.assert_verifies_clean();
}
