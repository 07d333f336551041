//! The local handover end to end on real KVM: `ferry migrate --local` hands a running guest to a
//! `ferry run --incoming unix:PATH` on the same host without copying its memory, back and forth
//! between two processes (`--then-incoming`), and every way it can fail before Go leaves the
//! guest running at the source, which then hands it over to a fresh destination.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{RunningVm, ferry, stderr};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const GUEST: &str = "ws=128M pattern=random rate=40 verify-ms=200 log-ms=0";
const LIMIT: Duration = Duration::from_secs(60);

/// A 512 MiB `ferry run --incoming unix:...` destination (with `extra`).
fn destination(extra: &[&str]) -> (RunningVm, String) {
    common::unix_destination("512M", extra)
}

fn migrate_local(src: &RunningVm, to: &str, extra: &[&str]) -> std::process::Output {
    ferry()
        .args(["migrate", "--local", "--to", to, "--output", "json"])
        .args(extra)
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap()
}

fn exits(vm: RunningVm) -> (Option<i32>, String) {
    let out = vm.finish(LIMIT);
    (out.status.code(), stderr(&out))
}

fn stats(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("the statistics as JSON")
}

#[test]
fn a_guest_is_handed_back_and_forth_between_two_processes_without_a_page_copied() {
    // A first process that becomes a destination again once the guest left it.
    let dir = tempfile::tempdir().unwrap();
    let back = format!("unix:{}", dir.path().join("back.sock").display());
    let a = RunningVm::start_with("512M", GUEST, &["--then-incoming", back.as_str()]);
    a.wait_until("the API socket", LIMIT, |vm| vm.socket.exists());
    a.wait_until("a verify pass", LIMIT, |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (b, to_b) = destination(&[]);
    let s = stats(&migrate_local(&a, &to_b, &[]));
    assert_eq!(s["pages_normal"], 0, "{s}");
    assert_eq!(s["pages_zero"], 0, "{s}");
    assert!(s["bytes_sent"].as_u64() < Some(64 << 10), "{s}");
    b.assert_verifies_clean();
    // And back into the first process, which waited on its --then-incoming address; the
    // second has no --then-incoming, so it exits once the guest runs in the first again.
    a.wait_until("the first process waiting again", LIMIT, |_| {
        Path::new(back.trim_start_matches("unix:")).exists()
    });
    // This leg as a person reads it: the handover's figures, none of a copy's.
    let out = ferry()
        .args(["migrate", "--local", "--to", back.as_str(), "--api-socket"])
        .arg(&b.socket)
        .output()
        .unwrap();
    let (table, said) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(out.status.success(), "{said}");
    assert!(table.contains("no page copied"), "{table}");
    assert!(!table.contains("dirty"), "a copy's figures: {table}");
    assert!(
        said.contains("the old VMM process, which handed it over, exits"),
        "{said}"
    );
    let (code, err) = exits(b);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("this one exits"), "{err}");
    a.assert_verifies_clean();
}

#[test]
fn local_is_refused_for_a_tcp_destination_before_anything_is_asked() {
    let out = common::ferry_output(&[
        "migrate",
        "--local",
        "--to",
        "tcp:127.0.0.1:1",
        "--api-socket",
        "/nonexistent",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("give --to unix:PATH"), "{err}");
}

/// The failure matrix's local rows: each fails before Go, so the source's guest runs on and a
/// second handover, to a fresh destination, verifies clean.
#[test]
fn a_local_handover_that_fails_before_go_leaves_the_guest_running_at_the_source() {
    let src = RunningVm::start("512M", GUEST);
    src.wait_until("a verify pass", LIMIT, |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    // Configured differently: refused at the hello, before the pause.
    let (dst, to) = destination(&["--vcpus", "2"]);
    let out = migrate_local(&src, &to, &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--vcpus 1"), "{}", stderr(&out));
    assert_eq!(src.status()["state"], "running");
    drop(dst);
    // Killed before it answered: the source hears the connection end, well before its peer
    // timeout. (A destination gone after it mapped the memory is the engine test's.)
    let (dst, to) = destination(&["--peer-timeout", "30s"]);
    let pid = Pid::from_raw(dst.child.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let migrate = ferry()
        .args(["migrate", "--local", "--to", &to, "--peer-timeout", "20s"])
        .arg("--api-socket")
        .arg(&src.socket)
        .output();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        kill(pid, Signal::SIGKILL).unwrap();
    });
    let struck = Instant::now();
    let out = migrate.unwrap();
    killer.join().unwrap();
    assert!(!out.status.success(), "the handover failed");
    assert!(
        struck.elapsed() < Duration::from_secs(15),
        "{:?}",
        struck.elapsed()
    );
    drop(dst);
    assert_eq!(src.status()["state"], "running");
    // Stopped past the source's peer timeout: the same.
    let (dst, to) = destination(&[]);
    let pid = Pid::from_raw(dst.child.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let out = migrate_local(&src, &to, &["--peer-timeout", "2s"]);
    assert!(!out.status.success(), "the handover failed");
    kill(pid, Signal::SIGCONT).unwrap();
    // It wakes to a source that gave up, and waits for the next one, with no guest.
    assert_ne!(
        dst.status()["state"],
        "running",
        "no guest ran at the destination"
    );
    drop(dst);
    assert_eq!(src.status()["state"], "running");
    // Nothing lost: a handover to a fresh destination verifies clean.
    src.assert_verifies_clean();
    let (dst, to) = destination(&[]);
    stats(&migrate_local(&src, &to, &[]));
    dst.assert_verifies_clean();
    let (code, _) = exits(src);
    assert_eq!(code, Some(0));
}

/// `ferry bench soak --local` and `ferry bench local` at small counts: every hop a local
/// handover that verifies clean, no page sent, and no descriptor kept per hop.
#[test]
fn local_handovers_back_and_forth_verify_and_keep_no_descriptor() {
    common::require_kvm();
    let rows = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = ferry().args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}\n{text}", stderr(&out));
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let soak = rows(&[
        "bench",
        "soak",
        "--local",
        "--mode",
        "precopy",
        "--round-trips",
        "10",
    ]);
    let of = |rows: &[serde_json::Value], bench: &str| -> Vec<serde_json::Value> {
        rows.iter()
            .filter(|r| r["bench"] == bench)
            .cloned()
            .collect()
    };
    let all = of(&soak, "soak");
    assert_eq!(all[0]["hops"], 20, "{soak:?}");
    assert_eq!(all[0]["verify_failures"], 0, "{soak:?}");
    assert_eq!(of(&soak, "soak_hops")[0]["mode"], "local", "{soak:?}");
    for p in of(&soak, "soak_process") {
        assert_eq!(p["fd_growth"], 0, "{soak:?}");
    }
    let bench = rows(&[
        "bench",
        "local",
        "--cases",
        "1x1G",
        "--hops",
        "2",
        "--cmdline",
        "ws=64M pattern=random rate=50 heartbeat-ms=1 verify-ms=100 log-ms=0",
    ]);
    let cases = of(&bench, "local");
    assert_eq!(cases.len(), 2, "local and copied: {bench:?}");
    let local = &cases[0];
    assert_eq!(local["handover"], "local", "{bench:?}");
    assert_eq!(local["pages_sent_max"], 0, "{bench:?}");
    assert!(
        local["bytes_sent_max"].as_u64() < Some(64 << 10),
        "{bench:?}"
    );
    assert!(
        cases[1]["pages_sent_max"].as_u64() > Some(0),
        "the copy copies: {bench:?}"
    );
}

/// Guest RAM on 2 MiB huge pages goes over as a hugetlbfs memfd: the destination, on huge
/// pages too, maps it and gives its own reservation back, and the guest verifies there.
#[test]
fn a_guest_on_huge_pages_is_handed_over_on_huge_pages() {
    common::require_kvm();
    // Both processes reserve their 512 MiB until the handover, and a margin.
    let _pool = ferry_vmm::memory::HugePagePool::reserve_more(2 * 256 + 16)
        .unwrap_or_else(|e| panic!("cannot reserve huge pages (root is needed): {e}"));
    let src = RunningVm::start_with("512M", GUEST, &["--hugepages"]);
    src.wait_until("the API socket", LIMIT, |vm| vm.socket.exists());
    src.wait_until("a verify pass", LIMIT, |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, to) = common::unix_destination("512M", &["--hugepages"]);
    let s = stats(&migrate_local(&src, &to, &[]));
    assert_eq!(s["pages_normal"], 0, "{s}");
    dst.assert_verifies_clean();
    // A destination on 4 KiB pages is refused before the pause, and says how to start it.
    let (small, to) = destination(&[]);
    let out = migrate_local(&dst, &to, &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("with --hugepages"),
        "{}",
        stderr(&out)
    );
    drop(small);
    assert_eq!(dst.status()["state"], "running");
    let (code, _) = exits(src);
    assert_eq!(code, Some(0));
}
