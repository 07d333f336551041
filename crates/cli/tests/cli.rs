//! The `ferry` binary end to end: argument errors, the control API, Ctrl-C, and a 64 GiB
//! sparse guest's host memory footprint.

mod common;

use std::time::Duration;

use common::{RunningVm, ferry, ferry_output, read, require_kvm, stderr};

#[test]
fn bad_guest_command_lines_are_refused_before_boot() {
    let table = [
        (
            vec!["run", "--cmdline", "ws=lots"],
            "bad value 'lots' for guest parameter 'ws'",
        ),
        (
            vec!["run", "--cmdline", "pattern=zigzag"],
            "expected seq, random or hotcold",
        ),
        (
            vec!["run", "--cmdline", "bogus=1"],
            "unknown guest parameter 'bogus'; known keys are: ws rate",
        ),
        (
            vec!["run", "--cmdline", "verify"],
            "'verify' is not key=value",
        ),
        // Both booted and misbehaved before: the guest halted with the wrong cause, or ran
        // with --vcpus's count while the user's vcpus= said another.
        (
            vec!["run", "--memory", "256M", "--cmdline", "ws=16M free=1G"],
            "free=1024M is more than this guest has left to free",
        ),
        (
            vec!["run", "--vcpus", "2", "--cmdline", "vcpus=4"],
            "vcpus=4 in --cmdline contradicts --vcpus 2",
        ),
    ];
    assert_refused(&table);
}

/// Each command fails as a usage error (exit 2, whether the flag's parser or the VM's
/// configuration refused the value), and its error contains the expected text.
fn assert_refused(table: &[(Vec<&str>, &str)]) {
    for (args, want) in table {
        let out = ferry_output(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr(&out).contains(want), "{args:?}: {}", stderr(&out));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn bad_memory_sizes_are_refused_with_the_fix() {
    let table = [
        (
            vec!["run", "--memory", "10M"],
            "--memory 10M is below the minimum of 64M",
        ),
        (
            vec!["run", "--memory", "1000T"],
            "--memory 1000T is above the most this VM may have here, 65535G: ferry maps at most 64T",
        ),
        (
            vec!["run", "--memory", "1T"],
            "--memory 1T is above the most this VM may have here, 511G: the built-in guest maps 512 GiB of addresses",
        ),
        (
            vec!["run", "--memory", "65M"],
            "not a multiple of 2M; round it, e.g. to 66M",
        ),
        (vec!["run", "--memory", "2X"], "'2X' is not a size"),
        // A fraction and a lower-case suffix parse (both were refused without a reason); this
        // one is refused for what it is.
        (vec!["run", "--memory", "65.5m"], "not a multiple of 2M"),
        (
            vec!["run", "--memory", "64M", "--cmdline", "ws=256M"],
            "--memory 64M is too small for this guest: its working set of 256M",
        ),
        (
            vec!["run", "--vcpus", "65"],
            "--vcpus 65 is not supported: a VM has 1 to 64 vCPUs",
        ),
        (
            vec!["run", "--incoming-retry"],
            "--incoming-retry is for a destination; give --incoming",
        ),
        (
            vec![
                "migrate-set",
                "--api-socket",
                "x.sock",
                "--max-bandwidth",
                "0",
            ],
            "a limit of 0 would never send a page",
        ),
    ];
    assert_refused(&table);
    // A file that cannot be read is a failure, not a usage error.
    let out = ferry_output(&["run", "--guest", "/nonexistent/kernel.elf"]);
    assert!(
        stderr(&out).contains("cannot read guest kernel"),
        "{}",
        stderr(&out)
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[test]
fn api_reports_the_guest_and_pauses_resumes_and_shuts_down() {
    let vm = RunningVm::start("256M", "ws=16M verify-ms=100 log-ms=100");
    vm.wait_until(
        "heartbeats and a verify pass",
        Duration::from_secs(30),
        |vm| {
            let s = vm.status();
            // The write rate is published once its window spans 250 ms.
            s["guest"]["heartbeats"].as_u64() > Some(5)
                && s["guest"]["verify_passes"].as_u64() > Some(0)
                && s["guest"]["write_rate_pages_per_s"].as_f64() > Some(0.0)
        },
    );
    let s = vm.status();
    assert_eq!(s["state"], "running");
    assert_eq!(s["memory_bytes"], 256u64 << 20);
    assert_eq!(s["vcpus"], 1);
    assert_eq!(s["guest"]["verify_failures"], 0);
    assert!(
        s["guest"]["write_rate_pages_per_s"].as_f64() > Some(0.0),
        "{s:#}"
    );
    assert!(s["guest"]["last_report_host_ns"].as_u64() <= s["host_monotonic_ns"].as_u64());

    assert!(vm.control("pause").status.success());
    let paused = vm.status();
    assert_eq!(paused["state"], "paused");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        vm.status()["guest"]["reports"],
        paused["guest"]["reports"],
        "no reports while paused"
    );

    assert!(vm.control("resume").status.success());
    vm.wait_until("reports after resume", Duration::from_secs(30), |vm| {
        vm.status()["guest"]["reports"].as_u64() > paused["guest"]["reports"].as_u64()
    });
    assert!(vm.control("shutdown").status.success());
    let out = vm.finish(Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("stopped on request (API shutdown)"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn ctrl_c_stops_cleanly() {
    let vm = RunningVm::start("128M", "ws=8M log-ms=100");
    vm.wait_until("the guest's first line", Duration::from_secs(30), |vm| {
        common::read(&vm.serial).contains("ferry-guest: t=")
    });
    // Signal the child through the kill command, as a terminal's Ctrl-C would.
    let status = std::process::Command::new("kill")
        .args(["-INT", &vm.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = vm.finish(Duration::from_secs(30));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("stopped on request (Ctrl-C)"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn status_without_a_vm_says_what_to_do() {
    let out = ferry_output(&["status", "--api-socket", "/nonexistent/ferry.sock"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is `ferry run --api-socket /nonexistent/ferry.sock` running?"),
        "{}",
        stderr(&out)
    );
}

/// `ferry bench state --help` shows its default vCPU counts as `1 8 32 64`, and `--vcpus 1 8`
/// was refused ("unexpected argument '8'"). Cheap: the second value here is out of range, so
/// the parse refuses it by name before any VM boots, which it can do only if it took it as
/// one of the list.
#[test]
fn regression_bench_state_takes_its_vcpu_counts_as_its_help_shows_them() {
    let help = ferry_output(&["bench", "state", "--help"]);
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: 1 8 32 64]"), "{help}");
    for args in [
        &["bench", "state", "--vcpus", "1", "65"][..],
        &["bench", "state", "--vcpus", "1,65"],
    ] {
        let out = ferry_output(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            stderr(&out)
                .contains("invalid value '65' for '--vcpus <VCPUS>...': 65 is not in 1..=64"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

/// A 64 GiB guest that touches 256 MiB costs about 256 MiB of host memory: RAM is a sparse
/// memfd mapped MAP_NORESERVE, and the guest maps all 64 GiB but writes only its working set.
#[test]
fn sparse_64g_guest_uses_little_host_memory() {
    let vm = RunningVm::start("64G", "ws=256M verify-ms=200 log-ms=0");
    vm.wait_until(
        "two verify passes (the working set fully written)",
        Duration::from_secs(120),
        |vm| vm.status()["guest"]["verify_passes"].as_u64() >= Some(2),
    );
    let s = vm.status();
    assert_eq!(s["memory_bytes"], 64u64 << 30);
    assert_eq!(s["guest"]["verify_failures"], 0);
    assert_eq!(s["guest"]["config"]["working_set_pages"], 65536);
    let allocated = s["memory_allocated_bytes"].as_u64().unwrap();
    let rss = vm_rss_bytes(vm.child.id());
    eprintln!(
        "64G guest, 256M working set: memfd allocated {} MiB, process RSS {} MiB",
        allocated >> 20,
        rss >> 20
    );
    assert!(
        allocated >= 256 << 20,
        "the working set is resident: {allocated}"
    );
    assert!(
        allocated <= (256 + 16) << 20,
        "guest RAM beyond the working set was allocated: {allocated}"
    );
    assert!(
        rss <= (256 + 96) << 20,
        "process RSS {rss} is far above the working set"
    );
}

fn vm_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// A `ferry run` under umask 002 (a group-writable default), with `extra` arguments.
fn run_under_umask_002(extra: &[&str]) -> RunningVm {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let serial = dir.path().join("serial.log");
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg("umask 002; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_ferry"))
        .args(["run", "--memory", "64M", "--cmdline", "ws=1M"])
        .arg("--serial")
        .arg(&serial)
        .arg("--api-socket")
        .arg(&socket)
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let vm = RunningVm {
        child,
        socket,
        serial,
        dir,
    };
    vm.wait_until("the API socket", Duration::from_secs(30), |vm| {
        vm.socket.exists()
    });
    vm
}

#[test]
fn regression_the_api_socket_is_private_whatever_the_umask_and_a_file_in_its_place_is_kept() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |vm: &RunningVm| std::fs::metadata(&vm.socket).unwrap().permissions().mode() & 0o777;
    let vm = run_under_umask_002(&[]);
    assert_eq!(mode(&vm), 0o600, "the default mode, not the umask's 775");
    assert_eq!(vm.status()["state"], "running");
    drop(vm);
    let vm = run_under_umask_002(&["--api-socket-mode", "660"]);
    assert_eq!(mode(&vm), 0o660);
    drop(vm);

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "keep me").unwrap();
    let out = ferry()
        .args([
            "run",
            "--memory",
            "64M",
            "--cmdline",
            "ws=1M",
            "--serial",
            "none",
        ])
        .arg("--api-socket")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("is not a socket"), "{}", stderr(&out));
    assert_eq!(
        read(&file),
        "keep me",
        "the file given as --api-socket is kept"
    );
}

/// `ferry shutdown` returned before the VMM let go of its API socket, so a script that
/// restarted a VMM on the same path right after could find it in use.
#[test]
fn regression_a_vmm_starts_on_the_same_api_socket_right_after_ferry_shutdown_returns() {
    let first = RunningVm::start("64M", "ws=1M log-ms=0");
    let out = first.control("shutdown");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        std::os::unix::net::UnixStream::connect(&first.socket).is_err(),
        "the first VMM no longer answers once ferry shutdown returned"
    );
    let mut second = ferry()
        .args(["run", "--memory", "64M", "--cmdline", "ws=1M log-ms=0"])
        .args(["--serial", "none", "--api-socket"])
        .arg(&first.socket)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(v) = ferry_vmm::api::client::request(&first.socket, "GET", "/vm") {
            break v;
        }
        assert!(
            second.try_wait().unwrap().is_none(),
            "the second VMM exited: {}",
            stderr(&second.wait_with_output().unwrap())
        );
        assert!(
            std::time::Instant::now() < deadline,
            "the second VMM never answered"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status["state"], "running");
    let _ = second.kill();
    let _ = second.wait();
}

/// Logs written to a file or pipe carry no colour codes (they did: tracing's ANSI styling).
#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    common::require_kvm();
    let out = common::ferry()
        .env("FERRY_LOG", "debug")
        .args(["run", "--memory", "64M", "--vcpus", "2", "--serial", "none"])
        .args(["--cmdline", "ws=8M run-ms=200"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("vCPU 1 started"),
        "a debug line was logged: {err}"
    );
    assert!(!err.contains('\u{1b}'), "{err:?}");
}

/// Errors say each cause once and in the words of the flags: a refused connection is not an
/// "invalid migration request" nor a bare HTTP status, an OS error is printed once, a peer
/// that is not a migration listener (a destination's API socket) is named as the likely slip
/// within seconds, a failed migration is "failed" (not a Debug name), and a cancelled one says
/// "keeps running" once, without a table of zeros.
#[test]
fn migration_errors_say_each_cause_once_in_plain_words() {
    let src = RunningVm::start("256M", "ws=16M rate=10 log-ms=0");
    let port = common::free_port().to_string();
    let refused = common::ferry()
        .args(["migrate", "--connect-timeout", "0s", "--to"])
        .arg(format!("tcp:127.0.0.1:{port}"))
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    let err = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot connect to"), "{err}");
    assert!(!err.contains("invalid migration request"), "{err}");
    assert!(!err.contains("502") && !err.contains("503"), "{err}");
    assert_eq!(err.matches("os error").count(), 1, "{err}");
    // A destination's API socket given as --to: not a migration listener.
    let dst = RunningVm::start("256M", "ws=16M rate=10 log-ms=0");
    let out = common::ferry()
        .args(["migrate", "--to"])
        .arg(format!("unix:{}", dst.socket.display()))
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("migration failed: "), "{err}");
    assert!(err.contains("not, say, its API socket"), "{err}");
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(table.starts_with("failed after "), "{table}");
    assert!(!table.contains("downtime"), "no table of zeros: {table}");
    assert_eq!(src.status()["state"], "running");
}
