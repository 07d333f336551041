//! QEMU as the peer of `ferry bench snapshot`: the same built-in guest, with the same command
//! line and RAM, booted under `qemu-system-x86_64`, saved stopped into a file in the same
//! directory and restored from it, driven through QMP. With `mapped-ram` (QEMU 9 and later) it
//! saves and restores as issue 36 measured QEMU 10 (`file:` with `mapped-ram` and 2 multifd
//! channels); without it (Debian 12's QEMU 7.2) through `exec:cat`, QEMU's way to a file before
//! `file:` existed.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// What QEMU did with the guest.
pub(super) struct QemuRun {
    pub version: String,
    pub mapped_ram: bool,
    /// From `stop` to the file synced.
    pub save_ms: f64,
    /// From `migrate-incoming` to the migration completed.
    pub restore_ms: f64,
    /// The file's allocated bytes.
    pub allocated: u64,
}

/// Saves and restores a guest of `memory` bytes booted with `cmdline` once its prefill line
/// is on the serial port; `None` when QEMU is not installed.
pub(super) fn save_and_restore(
    memory: u64,
    cmdline: &str,
    dir: &Path,
) -> anyhow::Result<Option<QemuRun>> {
    let Ok(out) = Command::new("qemu-system-x86_64").arg("--version").output() else {
        return Ok(None);
    };
    let version = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    let work = dir.join(format!("ferry-bench-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let _cleanup = RemoveDir(work.clone());
    let elf = work.join("guest.elf");
    std::fs::write(&elf, ferry_guest_image::ELF)?;
    let file = work.join("vm.qemu");
    let serial = work.join("serial.log");
    let qemu = |sock: &Path, extra: &[&str]| -> anyhow::Result<Child> {
        Command::new("qemu-system-x86_64")
            .args(["-M", "pc", "-enable-kvm", "-cpu", "host,-arch-capabilities"])
            .args(["-m", &format!("{}M", memory >> 20), "-display", "none"])
            .arg("-serial")
            .arg(format!("file:{}", serial.display()))
            .arg("-kernel")
            .arg(&elf)
            .args(["-append", cmdline])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting qemu-system-x86_64")
    };
    // Save.
    let sock = work.join("save.qmp");
    let child = Kill(qemu(&sock, &[])?);
    let mut q = Qmp::connect(&sock)?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while !std::fs::read_to_string(&serial)
        .unwrap_or_default()
        .contains("prefilled")
    {
        if Instant::now() > deadline {
            bail!("the guest under QEMU did not finish its prefill");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let caps = q.execute("query-migrate-capabilities", json!({}))?;
    let mapped_ram = caps
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["capability"] == "mapped-ram"));
    let uri = if mapped_ram {
        q.prepare_mapped_ram()?;
        format!("file:{}", file.display())
    } else {
        format!("exec:cat > {}", file.display())
    };
    let t = Instant::now();
    q.execute("stop", json!({}))?;
    q.execute("migrate", json!({ "uri": uri }))?;
    q.wait_completed()?;
    std::fs::File::open(&file)?.sync_all()?;
    let save_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(q);
    drop(child);
    let allocated = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&file)?.blocks() * 512
    };
    // Restore.
    let sock = work.join("restore.qmp");
    let _child = Kill(qemu(&sock, &["-incoming", "defer"])?);
    let mut q = Qmp::connect(&sock)?;
    let uri = if mapped_ram {
        q.prepare_mapped_ram()?;
        format!("file:{}", file.display())
    } else {
        format!("exec:cat {}", file.display())
    };
    let t = Instant::now();
    q.execute("migrate-incoming", json!({ "uri": uri }))?;
    q.wait_completed()?;
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(Some(QemuRun {
        version,
        mapped_ram,
        save_ms,
        restore_ms,
        allocated,
    }))
}

/// Kills and reaps QEMU when dropped.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Removes a directory when dropped.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A QMP connection.
struct Qmp {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Qmp {
    fn connect(sock: &Path) -> anyhow::Result<Qmp> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            match UnixStream::connect(sock) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => return Err(e).context("connecting to QEMU's QMP socket"),
            }
        };
        let mut q = Qmp {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        };
        q.read()?; // the greeting
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn read(&mut self) -> anyhow::Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("QEMU closed its QMP socket");
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Runs `command` and returns its `return`, skipping events.
    fn execute(&mut self, command: &str, arguments: Value) -> anyhow::Result<Value> {
        let mut request = json!({ "execute": command });
        if arguments.as_object().is_some_and(|a| !a.is_empty()) {
            request["arguments"] = arguments;
        }
        writeln!(self.writer, "{request}")?;
        loop {
            let answer = self.read()?;
            if let Some(r) = answer.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = answer.get("error") {
                bail!("QEMU refused {command}: {e}");
            }
        }
    }

    /// `mapped-ram` with 2 multifd channels, as issue 36 measured QEMU 10.
    fn prepare_mapped_ram(&mut self) -> anyhow::Result<()> {
        let caps = json!([
            { "capability": "mapped-ram", "state": true },
            { "capability": "multifd", "state": true },
        ]);
        self.execute("migrate-set-capabilities", json!({ "capabilities": caps }))?;
        self.execute("migrate-set-parameters", json!({ "multifd-channels": 2 }))?;
        Ok(())
    }

    /// Polls `query-migrate` until the migration completed (or failed).
    fn wait_completed(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let status = self.execute("query-migrate", json!({}))?;
            match status["status"].as_str() {
                Some("completed") => return Ok(()),
                Some("failed") => bail!("QEMU's migration failed: {status}"),
                _ if Instant::now() > deadline => bail!("QEMU's migration did not end"),
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}
