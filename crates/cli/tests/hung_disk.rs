//! Issue 48: a snapshot whose file system hangs. Its writers block in their writes; a cancel
//! used to wait for them (the pass-end drain and the queue's send ignored it), so the
//! migration's slot stayed busy for as long as the file system hung. Here the file system is a
//! real one, frozen with `fsfreeze` (every write to it blocks until it thaws): the cancel ends
//! the snapshot within a second or so, the guest runs on, the slot takes a new snapshot, and
//! once the file system thaws the blocked writers end and the partial file goes.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{RunningVm, ferry, partials, stderr};

/// A small ext4 file system in an image file, loop-mounted; thawed and unmounted on drop.
struct Mounted {
    dir: tempfile::TempDir,
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", stderr(&out));
}

impl Mounted {
    fn new() -> Mounted {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
        run(Command::new("mkfs.ext4").arg("-q").arg(&image));
        std::fs::create_dir(dir.path().join("mnt")).unwrap();
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(dir.path().join("mnt")));
        Mounted { dir }
    }

    fn mnt(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    fn freeze(&self, how: &str) {
        run(Command::new("fsfreeze").arg(how).arg(self.mnt()));
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("fsfreeze")
            .arg("--unfreeze")
            .arg(self.mnt())
            .output();
        let _ = Command::new("umount").arg("-l").arg(self.mnt()).output();
    }
}

#[test]
fn regression_a_cancel_reaches_a_snapshot_blocked_on_a_hung_file_system() {
    let fs = Mounted::new();
    let src = RunningVm::start(
        "512M",
        "ws=256M pattern=random rate=max verify-ms=200 log-ms=0",
    );
    src.wait_until("a verify pass", Duration::from_secs(60), |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    // A snapshot that never converges (a writer flat out, a 1 ms pause allowed, no aid):
    // it writes until cancelled.
    let mut snapshot = ferry()
        .arg("snapshot")
        .arg("--api-socket")
        .arg(&src.socket)
        .arg("--to")
        .arg(fs.mnt().join("vm.snap"))
        .args(["--downtime-limit", "1ms", "--auto-converge", "off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    src.wait_until("precopy", Duration::from_secs(30), |vm| {
        vm.phase() == "precopy"
    });
    fs.freeze("--freeze");
    // Let the writers reach the frozen file system and the queues fill.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(src.phase(), "precopy", "still writing when cancelled");
    let asked = Instant::now();
    assert!(src.control("cancel").status.success());
    src.wait_until("the cancel", Duration::from_secs(10), |vm| {
        vm.phase() == "cancelled"
    });
    let took = asked.elapsed();
    eprintln!("cancel of a snapshot on a frozen file system took {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let out = snapshot.wait().unwrap();
    assert!(!out.success());
    assert_eq!(src.status()["state"], "running", "the guest runs on");
    // The slot is free: a snapshot elsewhere runs and completes.
    let elsewhere = tempfile::tempdir().unwrap();
    let file = elsewhere.path().join("vm.snap");
    let out = src.snapshot(&file, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Thawed, the blocked writers end and their partial file goes.
    fs.freeze("--unfreeze");
    let deadline = Instant::now() + Duration::from_secs(30);
    while partials(&fs.mnt()) > 0 {
        assert!(Instant::now() < deadline, "the partial file stayed");
        std::thread::sleep(Duration::from_millis(100));
    }
    src.assert_verifies_clean();
    drop(src);
    RunningVm::restore(&file, &[]).assert_verifies_clean();
}
