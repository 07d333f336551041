//! Helpers for the `ferry` binary's end-to-end tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn ferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
}

/// Fails loudly when /dev/kvm cannot be used (every machine of this project has it).
pub fn require_kvm() {
    ferry_vmm::kvm::require_for_tests();
}

/// Runs `ferry ARGS` to completion.
pub fn ferry_output(args: &[&str]) -> Output {
    ferry().args(args).output().expect("ferry runs")
}

/// A `ferry run` in the background with an API socket and a serial file; killed on drop.
#[derive(Debug)]
pub struct RunningVm {
    pub child: Child,
    pub socket: PathBuf,
    pub serial: PathBuf,
    pub dir: tempfile::TempDir,
}

impl RunningVm {
    pub fn start(memory: &str, cmdline: &str) -> RunningVm {
        RunningVm::start_with(memory, cmdline, &[])
    }

    /// A `ferry run` with extra arguments (e.g. `--incoming tcp:...`); without them, waits
    /// for the API socket.
    pub fn start_with(memory: &str, cmdline: &str, extra: &[&str]) -> RunningVm {
        let vm = RunningVm::spawn(|c| {
            c.args(["--memory", memory, "--cmdline", cmdline])
                .args(extra);
        });
        if extra.is_empty() {
            vm.wait_until("the API socket", Duration::from_secs(30), |vm| {
                vm.socket.exists()
            });
        }
        vm
    }

    /// A `ferry run --restore FILE` (with `extra` arguments) in the background; waits for
    /// the API socket, which answers once the guest runs.
    pub fn restore(file: &Path, extra: &[&str]) -> RunningVm {
        let vm = RunningVm::spawn(|c| {
            c.arg("--restore").arg(file).args(extra);
        });
        vm.wait_until("the API socket", Duration::from_secs(60), |vm| {
            vm.socket.exists()
        });
        vm
    }

    /// `ferry run` with a serial file and an API socket in a directory of its own, and the
    /// arguments `args` adds.
    fn spawn(args: impl FnOnce(&mut Command)) -> RunningVm {
        RunningVm::spawn_in(None, args)
    }

    /// A `ferry run` (with `extra`) inside the network namespace `ns` (`ip netns exec`, which
    /// becomes the process), so that its `--net tap=NAME` is that namespace's tap.
    pub fn start_in(ns: &str, memory: &str, cmdline: &str, extra: &[&str]) -> RunningVm {
        let vm = RunningVm::spawn_in(Some(ns), |c| {
            c.args(["--memory", memory, "--cmdline", cmdline])
                .args(extra);
        });
        vm.wait_until("the API socket", Duration::from_secs(60), |vm| {
            vm.socket.exists()
        });
        vm
    }

    /// A `ferry run --restore FILE` (with `extra`) inside the network namespace `ns`; waits
    /// for the API socket.
    pub fn restore_in(ns: &str, file: &Path, extra: &[&str]) -> RunningVm {
        let vm = RunningVm::spawn_in(Some(ns), |c| {
            c.arg("--restore").arg(file).args(extra);
        });
        vm.wait_until("the API socket", Duration::from_secs(60), |vm| {
            vm.socket.exists()
        });
        vm
    }

    fn spawn_in(ns: Option<&str>, args: impl FnOnce(&mut Command)) -> RunningVm {
        require_kvm();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let serial = dir.path().join("serial.log");
        let mut command = match ns {
            None => ferry(),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_ferry")]);
                c
            }
        };
        command.arg("run");
        args(&mut command);
        let child = command
            .arg("--serial")
            .arg(&serial)
            .arg("--api-socket")
            .arg(&socket)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ferry run starts");
        RunningVm {
            child,
            socket,
            serial,
            dir,
        }
    }

    /// `ferry status` as JSON.
    pub fn status(&self) -> serde_json::Value {
        let out = ferry()
            .arg("status")
            .arg("--api-socket")
            .arg(&self.socket)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ferry status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("status is JSON")
    }

    /// `GET path` on the API, as JSON.
    pub fn status_of(&self, path: &str) -> serde_json::Value {
        ferry_vmm::api::client::request(&self.socket, "GET", path).expect("API answers")
    }

    /// The phase `GET /migration` shows (null when the API does not answer).
    pub fn phase(&self) -> serde_json::Value {
        ferry_vmm::api::client::request(&self.socket, "GET", "/migration")
            .map(|m| m["phase"].clone())
            .unwrap_or_default()
    }

    /// `ferry snapshot` of this VM into `file` with `extra` flags, to its end.
    pub fn snapshot(&self, file: &Path, extra: &[&str]) -> Output {
        ferry()
            .arg("snapshot")
            .arg("--api-socket")
            .arg(&self.socket)
            .arg("--to")
            .arg(file)
            .args(extra)
            .output()
            .unwrap()
    }

    pub fn control(&self, verb: &str) -> Output {
        ferry()
            .arg(verb)
            .arg("--api-socket")
            .arg(&self.socket)
            .output()
            .unwrap()
    }

    pub fn wait_until(&self, what: &str, timeout: Duration, done: impl Fn(&RunningVm) -> bool) {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; serial:\n{}",
                std::fs::read_to_string(&self.serial).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the guest to finish two more verify passes and checks that none found a bad
    /// page: what a migrated guest must show.
    pub fn assert_verifies_clean(&self) {
        let before = self.status()["guest"]["verify_passes"].as_u64().unwrap();
        self.wait_until("two more verify passes", Duration::from_secs(60), |vm| {
            vm.status()["guest"]["verify_passes"].as_u64() >= Some(before + 2)
        });
        let g = self.status()["guest"].clone();
        assert_eq!(g["verify_failures"], 0, "{g}");
        assert_eq!(g["bad_reads"], 0, "{g}");
    }

    /// Waits for the process to exit and returns its output.
    pub fn finish(mut self, timeout: Duration) -> Output {
        let deadline = Instant::now() + timeout;
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "ferry run did not exit within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let child = std::mem::replace(&mut self.child, Command::new("true").spawn().unwrap());
        child.wait_with_output().unwrap()
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A free loopback port (bound, then released for the destination to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts a destination (`ferry run --incoming`) on a fresh port and waits until its API
/// answers (it does while it waits for the migration).
pub fn destination(memory: &str) -> (RunningVm, u16) {
    destination_with(memory, &[])
}

/// [`destination`] with more `ferry run` arguments.
pub fn destination_with(memory: &str, extra: &[&str]) -> (RunningVm, u16) {
    let port = free_port();
    let spec = format!("tcp:127.0.0.1:{port}");
    let mut args = vec!["--incoming", &spec];
    args.extend_from_slice(extra);
    let vm = RunningVm::start_with(memory, "", &args);
    vm.wait_until("the destination's API", Duration::from_secs(30), |vm| {
        vm.socket.exists()
    });
    (vm, port)
}

/// A `ferry run --incoming unix:PATH` (with `extra`) of `memory`, its API up; and `unix:PATH`,
/// in a directory of its own that outlives it.
pub fn unix_destination(memory: &str, extra: &[&str]) -> (RunningVm, String) {
    let dir = tempfile::tempdir().unwrap().keep();
    let spec = format!("unix:{}", dir.join("in.sock").display());
    let mut args = vec!["--incoming", spec.as_str()];
    args.extend_from_slice(extra);
    let vm = RunningVm::start_with(memory, "", &args);
    vm.wait_until("the destination's API", Duration::from_secs(60), |vm| {
        vm.socket.exists()
    });
    (vm, spec)
}

/// How many `.partial` files (a snapshot's, until it is complete) `dir` holds.
pub fn partials(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".partial")
        })
        .count()
}

/// A 256 MiB guest running `guest` migrated to a new destination with postcopy after one pass
/// at 10 MB/s (so that postcopy lasts seconds), with `extra` flags, once the destination runs
/// the guest in postcopy: the source, the destination, and the `ferry migrate` that follows it.
pub fn postcopy_migration(guest: &str, extra: &[&str]) -> (RunningVm, RunningVm, Child) {
    let src = RunningVm::start("256M", guest);
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = destination("256M");
    let mut args = vec![
        "--postcopy",
        "--postcopy-after-passes",
        "1",
        "--max-bandwidth",
        "10M",
    ];
    args.extend_from_slice(extra);
    let following = start_migrate(&src, port, &args);
    for vm in [&src, &dst] {
        vm.wait_until("postcopy", Duration::from_secs(60), |vm| {
            vm.phase() == "postcopy"
        });
    }
    (src, dst, following)
}

/// `ferry migrate` from `src` to the destination on `port`, in the background.
pub fn start_migrate(src: &RunningVm, port: u16, extra: &[&str]) -> std::process::Child {
    ferry()
        .args(["migrate", "--to", &format!("tcp:127.0.0.1:{port}")])
        .args(extra)
        .arg("--api-socket")
        .arg(&src.socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Recovers a postcopy-paused migration: `ferry migrate-recover` on the destination, then
/// `ferry migrate --resume` on the source to where it listens; both must succeed. Returns
/// that address and the resume's output.
pub fn recover(src: &RunningVm, dst: &RunningVm) -> (String, Output) {
    let out = ferry()
        .args(["migrate-recover", "--listen", "tcp:127.0.0.1:0"])
        .arg("--api-socket")
        .arg(&dst.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let at = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let resumed = ferry()
        .args(["migrate", "--resume", "--to", &at])
        .arg("--api-socket")
        .arg(&src.socket)
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{}\n{}",
        stderr(&resumed),
        String::from_utf8_lossy(&resumed.stdout)
    );
    (at, resumed)
}
