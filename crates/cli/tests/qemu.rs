//! The built-in guest ELF boots under QEMU too, from `ferry guest --write`, with the command
//! line the issue gives: same file, same workload, heartbeats on the serial port; it
//! calibrates its TSC against QEMU's PIT, and on a machine without one says so and goes on;
//! it reads QEMU's RTC as the host's time of day.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn builtin_guest_boots_under_qemu() {
    // Paced, so the guest sleeps on its APIC timer (QEMU's in-kernel irqchip) between
    // bursts: the log lines keep coming only if it wakes.
    let log = three_heartbeats(
        "pc",
        "ws=64M pattern=random rate=20 verify-ms=200 log-ms=250",
    );
    assert!(log.contains("working set 64 MiB (16384 pages"), "{log}");
    assert!(log.contains("pattern random"), "{log}");
    assert!(log.contains("TSC calibrated against the PIT: "), "{log}");
    rtc_reads_the_host_s_time(&log);
}

/// The guest's boot line about the RTC, read from QEMU's MC146818 (another implementation
/// than ferry's, in the same BCD 24-hour format a PC's firmware leaves): the host's time of
/// day, to within the seconds the boot and the heartbeats took.
fn rtc_reads_the_host_s_time(log: &str) {
    let said = log
        .lines()
        .find_map(|l| l.split("the RTC reads ").nth(1))
        .unwrap_or_else(|| panic!("no RTC line: {log}"));
    let seconds: u64 = said.split(' ').next().unwrap().parse().unwrap();
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    eprintln!("the guest read QEMU's RTC as {said}; the host's clock is {host} now");
    assert!(
        seconds <= host + 2 && host - seconds < 60,
        "QEMU's RTC read as {seconds}, the host's clock {host}"
    );
}

/// Issue 53: a machine without a PIT (port 0x61 unassigned, reading all-ones): the guest's
/// calibration fails, it says so, and its workload runs on its clock as before.
#[test]
fn without_a_pit_the_guest_says_so_and_runs_on() {
    let log = three_heartbeats("pc,pit=off", "ws=16M rate=20 verify-ms=200 log-ms=250");
    assert!(log.contains("no PIT answers on port 0x61"), "{log}");
    assert!(!log.contains("TSC calibrated"), "{log}");
}

/// Boots the built-in guest under QEMU's `machine` with `append`, until three heartbeat lines
/// without a verify failure; the serial log.
fn three_heartbeats(machine: &str, append: &str) -> String {
    common::require_kvm();
    let qemu = "qemu-system-x86_64";
    if Command::new(qemu).arg("--version").output().is_err() {
        panic!(
            "\n\n*** THIS TEST NEEDS {qemu} AND CANNOT RUN IT ***\n\
             *** run scripts/test-setup (it installs Debian's qemu-system-x86) ***\n\n"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let elf = dir.path().join("ferry-guest.elf");
    let out = common::ferry()
        .args(["guest", "--write"])
        .arg(&elf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr(&out));

    let mut child = Command::new(qemu)
        .args([
            "-M",
            machine,
            "-enable-kvm",
            "-cpu",
            "host,-arch-capabilities",
            "-m",
            "1G",
        ])
        .args([
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
            "-kernel",
        ])
        .arg(&elf)
        .args(["-append", append])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    let mut heartbeats = 0;
    while heartbeats < 3 {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(line) => {
                if line.starts_with("ferry-guest: t=") {
                    heartbeats += 1;
                    assert!(
                        line.contains("failures=0"),
                        "verify failed under QEMU: {line}"
                    );
                }
                log.push(line);
            }
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "no heartbeat lines from the guest under QEMU; output so far:\n{}",
                    log.join("\n")
                );
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    log.join("\n")
}
