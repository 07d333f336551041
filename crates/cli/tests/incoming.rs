//! A destination (`ferry run --incoming`) while it waits and while it receives: its API, its
//! cancel, and strays and hostile connections that must not knock it over.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{RunningVm, destination, ferry, start_migrate, stderr};
use ferry_migrate::wire::{Capabilities, HELLO_SIZE, Hello, Refusal, Role};

const MIB: u64 = 1 << 20;

fn connect(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).unwrap()
}

/// A main hello as a source of a `memory`-byte guest would send it.
fn main_hello(memory: u64) -> Vec<u8> {
    Hello {
        role: Role::Main,
        channel: 0,
        uuid: [0x42; 16],
        memory_size: memory,
        status: 0,
        channels: 1,
        capabilities: Capabilities::NONE,
        postcopy_page_shift: 0,
    }
    .encode()
    .to_vec()
}

/// Waits until `dst` listens. Its API answers before its listener is bound (it prepares
/// first): a connection made in between was refused on a loaded machine.
fn waiting(dst: &RunningVm) {
    dst.wait_until("the listener", Duration::from_secs(30), |vm| {
        vm.status_of("/migration")["phase"] == "waiting"
    });
}

fn rejected(dst: &RunningVm) -> u64 {
    dst.status_of("/migration")["rejected_connections"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_waiting_destination_answers_its_api_survives_strays_and_then_receives_a_clean_guest() {
    // The guest dirties 10 MB/s against a 60 MB/s cap: precopy converges in a few passes, and
    // the 64 MiB first pass lasts long enough to be watched.
    let src = RunningVm::start(
        "256M",
        "ws=64M pattern=random rate=10 verify-ms=200 log-ms=0",
    );
    let (dst, port) = destination("256M");
    waiting(&dst);
    let s = dst.status();
    assert_eq!(s["state"], "incoming", "{s:#}");
    let m = dst.status_of("/migration");
    assert_eq!(m["role"], "destination", "{m:#}");
    assert_eq!(m["phase"], "waiting", "{m:#}");
    assert!(
        m["listening_on"]
            .as_str()
            .unwrap()
            .ends_with(&port.to_string())
    );
    assert!(
        !dst.control("pause").status.success(),
        "nothing to pause yet"
    );

    // Before any source: garbage, a truncated hello, a wrong version, an HTTP request, and a
    // connection that never speaks (left open throughout).
    let _silent = connect(port);
    let mut wrong_version = b"FERRYMIG".to_vec();
    wrong_version.extend_from_slice(&99u32.to_le_bytes());
    wrong_version.resize(HELLO_SIZE, 0);
    let strays: [&[u8]; 4] = [
        &b"NOTFERRY".repeat(8),
        b"FERRYMIG",
        &wrong_version,
        b"GET /vm HTTP/1.1\r\nHost: localhost\r\n\r\n",
    ];
    for bytes in strays {
        let mut c = connect(port);
        let _ = c.write_all(bytes);
        let _ = c.shutdown(std::net::Shutdown::Write);
    }
    dst.wait_until("four rejections", Duration::from_secs(20), |vm| {
        rejected(vm) >= 4
    });
    assert_eq!(dst.status()["state"], "incoming", "still waiting");

    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let migrate = start_migrate(
        &src,
        port,
        &[
            "--max-bandwidth",
            "60M",
            "--timeout",
            "60s",
            "--timeout-action",
            "switchover",
        ],
    );
    dst.wait_until("pages arriving", Duration::from_secs(30), |vm| {
        let m = vm.status_of("/migration");
        m["phase"] == "precopy" && m["pages_received"].as_u64() > Some(0)
    });
    let m = dst.status_of("/migration");
    assert_eq!(m["channels_connected"], m["channels_announced"], "{m:#}");
    assert!(
        m["source"].as_str().unwrap().starts_with("tcp:127.0.0.1:"),
        "{m:#}"
    );
    // A second source while the migration runs is refused and disturbs nothing.
    let before = rejected(&dst);
    let mut second = connect(port);
    second.write_all(&main_hello(256 * MIB)).unwrap();
    let mut reply = [0u8; HELLO_SIZE];
    second.read_exact(&mut reply).unwrap();
    assert_eq!(Hello::decode(&reply).unwrap().status, Refusal::Busy as u32);
    // (At least: the silent connection's 10 s may run out meanwhile and be counted too.)
    assert!(rejected(&dst) > before);

    let out = migrate.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    dst.wait_until("the guest running here", Duration::from_secs(30), |vm| {
        vm.status()["state"] == "running"
    });
    assert_eq!(dst.status_of("/migration")["phase"], "completed");
    let resumed = dst.status()["guest"]["verify_passes"].as_u64().unwrap();
    dst.wait_until("verify passes here", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(resumed + 2)
    });
    assert_eq!(dst.status()["guest"]["verify_failures"], 0);
}

#[test]
fn cancel_on_the_destination_ends_it_cleanly_and_the_source_keeps_running() {
    let src = RunningVm::start(
        "512M",
        "ws=256M pattern=random rate=50 verify-ms=300 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = destination("512M");
    let migrate = start_migrate(&src, port, &["--max-bandwidth", "20M"]);
    dst.wait_until("pages arriving", Duration::from_secs(30), |vm| {
        vm.status_of("/migration")["pages_received"].as_u64() > Some(0)
    });
    let cancel = dst.control("cancel");
    assert!(cancel.status.success(), "{}", stderr(&cancel));
    let out = dst.finish(Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cancelled; no guest ran here"),
        "{}",
        stderr(&out)
    );
    let m = migrate.wait_with_output().unwrap();
    assert!(!m.status.success());
    assert!(
        stderr(&m).contains("cancelled on the destination"),
        "the source says why: {}",
        stderr(&m)
    );
    assert_eq!(src.status()["state"], "running");
    let passes = src.status()["guest"]["verify_passes"].as_u64().unwrap();
    src.wait_until(
        "verify passes after the cancel",
        Duration::from_secs(60),
        |vm| vm.status()["guest"]["verify_passes"].as_u64() >= Some(passes + 2),
    );
    assert_eq!(src.status()["guest"]["verify_failures"], 0);
}

#[test]
fn a_waiting_destination_stops_on_cancel_or_shutdown() {
    for verb in ["cancel", "shutdown"] {
        let (dst, _port) = destination("128M");
        let out = dst.control(verb);
        assert!(out.status.success(), "{verb}: {}", stderr(&out));
        let out = dst.finish(Duration::from_secs(20));
        assert!(
            stderr(&out).contains("no guest ran here"),
            "{verb}: {}",
            stderr(&out)
        );
        assert_eq!(out.status.code(), Some(3), "{verb}: {}", stderr(&out));
    }
}

#[test]
fn a_bad_stream_after_a_valid_hello_ends_the_destination_with_the_reason() {
    let (dst, port) = destination("128M");
    waiting(&dst);
    let mut c = connect(port);
    c.write_all(&main_hello(128 * MIB)).unwrap();
    let mut reply = [0u8; HELLO_SIZE];
    c.read_exact(&mut reply).unwrap();
    assert_eq!(
        Hello::decode(&reply).unwrap().status,
        Refusal::Accepted as u32
    );
    // The one announced data channel never connects.
    let out = dst.finish(Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("the incoming migration failed; no guest ran here")
            && err.contains("data channel 1 never connected"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Also `--prealloc`: the destination's RAM is fully populated before the source connects, and
/// the guest that lands in it verifies clean.
#[test]
fn a_guest_migrates_over_a_unix_socket_into_preallocated_memory_and_verifies_clean() {
    let src = RunningVm::start(
        "256M",
        "ws=64M pattern=random rate=20 verify-ms=200 log-ms=0",
    );
    let dir = tempfile::tempdir().unwrap();
    let spec = format!("unix:{}", dir.path().join("migrate.sock").display());
    let dst = RunningVm::start_with("256M", "", &["--incoming", &spec, "--prealloc"]);
    dst.wait_until("the destination's API", Duration::from_secs(30), |vm| {
        vm.socket.exists()
    });
    dst.wait_until("preallocated RAM", Duration::from_secs(30), |vm| {
        vm.status()["memory_allocated_bytes"].as_u64() == Some(256 << 20)
    });
    dst.wait_until("the listener", Duration::from_secs(30), |vm| {
        vm.status_of("/migration")["listening_on"] == spec.as_str()
    });
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let out = ferry()
        .args(["migrate", "--to", &spec, "--timeout", "60s"])
        .args(["--timeout-action", "switchover"])
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    dst.wait_until("the guest running here", Duration::from_secs(30), |vm| {
        vm.status()["state"] == "running"
    });
    let resumed = dst.status()["guest"]["verify_passes"].as_u64().unwrap();
    dst.wait_until("verify passes here", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(resumed + 2)
    });
    assert_eq!(dst.status()["guest"]["verify_failures"], 0);
}

/// Issue 29: a destination that preallocates says so, with its progress, and does not listen
/// until it can take pages; a `ferry migrate` started meanwhile keeps trying and then succeeds.
#[test]
fn a_preallocating_destination_listens_only_when_ready_and_a_waiting_source_gets_through() {
    let src = RunningVm::start("4G", "ws=16M rate=1 verify-ms=200 log-ms=0");
    // 4 GiB to populate: seconds on this project's machines, so it is watched preparing.
    let (dst, port) = common::destination_with("4G", &["--prealloc"]);
    let s = dst.status();
    assert_eq!(s["state"], "preparing", "{s:#}");
    let total = s["preparing"]["total_bytes"].as_u64().unwrap();
    assert_eq!(total, 4 << 30, "{s:#}");
    let m = dst.status_of("/migration");
    assert_eq!(m["phase"], "preparing", "{m:#}");
    assert_eq!(m["preparing"]["task"], "populating guest RAM", "{m:#}");
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "a preparing destination must not accept connections"
    );
    let migrate = start_migrate(&src, port, &["--connect-timeout", "120s"]);
    // Progress moves while it prepares.
    let mut seen = Vec::new();
    while dst.status_of("/migration")["phase"] == "preparing" {
        let done = dst.status()["preparing"]["done_bytes"]
            .as_u64()
            .unwrap_or(total);
        seen.push(done);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]) && seen.iter().all(|&d| d <= total),
        "progress goes up to the total: {seen:?}"
    );
    let out = migrate.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("nothing listens at"), "said it waited: {err}");
    assert_eq!(dst.status()["state"], "running");
    dst.assert_verifies_clean();
}

#[test]
fn a_migration_to_where_nothing_listens_gives_up_after_its_connect_timeout() {
    let src = RunningVm::start("256M", "ws=16M rate=1 verify-ms=0 log-ms=0");
    let port = common::free_port();
    let out = ferry()
        .args(["migrate", "--to", &format!("tcp:127.0.0.1:{port}")])
        .args(["--connect-timeout", "1s"])
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("nothing listened at tcp:127.0.0.1:{port}"))
            && err.contains("tries over")
            && err.contains("Connection refused"),
        "names the address, what it tried and why: {err}"
    );
    assert_eq!(src.status()["state"], "running", "the source runs on");
}
