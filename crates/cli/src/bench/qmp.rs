//! QEMU as a bench's peer: which `qemu-system-x86_64` is installed, a small QMP client, and
//! the guards that kill its processes and remove its files when a row ends. QMP's commands
//! are QEMU's documented interface; `qemu.rs` (snapshots) and `qemu_disk.rs` (a disk
//! migrated with `blockdev-mirror`) drive it.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The installed `qemu-system-x86_64`: its `--version` line and release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct QemuVersion {
    pub text: String,
    pub major: u32,
    pub minor: u32,
}

/// Why a bench has no QEMU row: the sentence it prints.
pub(super) fn installed() -> Result<QemuVersion, String> {
    let out = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .map_err(|e| format!("qemu-system-x86_64 is not installed ({e})"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version(&text).ok_or_else(|| {
        format!(
            "qemu-system-x86_64 --version printed no version: {:?}",
            text.trim()
        )
    })
}

/// The release in `QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)`.
pub(super) fn parse_version(text: &str) -> Option<QemuVersion> {
    let line = text.lines().next()?.trim();
    let number = line.strip_prefix("QEMU emulator version ")?;
    let number = number.split_whitespace().next()?;
    let mut parts = number.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some(QemuVersion {
        text: line.to_string(),
        major,
        minor,
    })
}

/// Starts QEMU (`-M pc`, KVM) on the built-in guest's ELF `elf` with `cmdline`, `memory`
/// bytes of RAM, its serial port into `serial`, QMP on `sock`, and `extra` arguments.
pub(super) fn boot(
    memory: u64,
    elf: &Path,
    cmdline: &str,
    serial: &Path,
    sock: &Path,
    extra: &[&str],
) -> anyhow::Result<Child> {
    Command::new("qemu-system-x86_64")
        .args(["-M", "pc", "-enable-kvm", "-cpu", "host,-arch-capabilities"])
        .args(["-m", &format!("{}M", memory >> 20), "-display", "none"])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .arg("-kernel")
        .arg(elf)
        .args(["-append", cmdline])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting qemu-system-x86_64")
}

/// Waits until the guest under QEMU says on `serial` that it filled its working set
/// (`prefill=1`), for at most five minutes.
pub(super) fn wait_prefilled(serial: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !std::fs::read_to_string(serial)
        .unwrap_or_default()
        .contains("prefilled")
    {
        if Instant::now() > deadline {
            bail!("the guest under QEMU did not finish its prefill");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Kills and reaps a QEMU when dropped.
pub(super) struct Kill(pub Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Removes a directory when dropped.
pub(super) struct RemoveDir(pub PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A QMP connection. Events that arrive while a command runs are kept, in order, for
/// [`Qmp::event_seconds`].
pub(super) struct Qmp {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    events: Vec<Value>,
}

impl Qmp {
    /// Connects (QEMU makes the socket shortly after it starts) and leaves the greeting's
    /// capabilities negotiation behind.
    pub fn connect(sock: &Path) -> anyhow::Result<Qmp> {
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
            events: Vec::new(),
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

    /// Runs `command` and returns its `return`, keeping the events that come before it.
    pub fn execute(&mut self, command: &str, arguments: Value) -> anyhow::Result<Value> {
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
            if answer.get("event").is_some() {
                self.events.push(answer);
            }
        }
    }

    /// Host time (seconds since the epoch) of the last event `name` seen so far.
    pub fn event_seconds(&self, name: &str) -> Option<f64> {
        self.events
            .iter()
            .rev()
            .find(|e| e["event"] == name)
            .and_then(event_seconds)
    }

    /// Sets migration capabilities on (a list of QMP names).
    pub fn capabilities_on(&mut self, names: &[&str]) -> anyhow::Result<()> {
        let caps: Vec<Value> = names
            .iter()
            .map(|n| json!({ "capability": n, "state": true }))
            .collect();
        self.execute("migrate-set-capabilities", json!({ "capabilities": caps }))?;
        Ok(())
    }

    /// `mapped-ram` with 2 multifd channels, as issue 36 measured QEMU 10.
    pub fn prepare_mapped_ram(&mut self) -> anyhow::Result<()> {
        self.capabilities_on(&["mapped-ram", "multifd"])?;
        self.execute("migrate-set-parameters", json!({ "multifd-channels": 2 }))?;
        Ok(())
    }

    /// Polls `query-migrate` until the migration completed, and returns that last answer;
    /// an error if it failed or `timeout` passed.
    pub fn wait_completed(&mut self, timeout: Duration) -> anyhow::Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.execute("query-migrate", json!({}))?;
            match status["status"].as_str() {
                Some("completed") => return Ok(status),
                Some("failed") => bail!("QEMU's migration failed: {status}"),
                _ if Instant::now() > deadline => {
                    bail!("QEMU's migration did not end within {timeout:?}: {status}")
                }
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Polls `query` (a QMP command without arguments) every `every` until `done` holds for
    /// its answer; an error once `timeout` passed.
    pub fn wait_for(
        &mut self,
        query: &str,
        every: Duration,
        timeout: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let answer = self.execute(query, json!({}))?;
            if done(&answer) {
                return Ok(answer);
            }
            if Instant::now() > deadline {
                bail!("QEMU's {query} did not show what was awaited within {timeout:?}: {answer}");
            }
            std::thread::sleep(every);
        }
    }
}

/// An event's `timestamp` (`{"seconds": s, "microseconds": us}`, the host's clock) in seconds.
pub(super) fn event_seconds(event: &Value) -> Option<f64> {
    let t = event.get("timestamp")?;
    Some(t["seconds"].as_f64()? + t["microseconds"].as_f64()? / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_debian_backport_version_line_parses() {
        let v = parse_version(
            "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\nCopyright",
        )
        .unwrap();
        assert_eq!((v.major, v.minor), (10, 0));
        assert!(v.text.ends_with("bpo12+1)"));
        let old = parse_version("QEMU emulator version 7.2.17 (Debian 1:7.2+dfsg-7)").unwrap();
        assert_eq!((old.major, old.minor), (7, 2));
    }

    #[test]
    fn what_is_not_a_version_line_is_none() {
        for text in [
            "",
            "qemu-img version 10.0.2",
            "QEMU emulator version x.y",
            "QEMU emulator version 10",
        ] {
            assert_eq!(parse_version(text), None, "{text:?}");
        }
    }

    #[test]
    fn an_events_timestamp_is_in_seconds() {
        let e =
            json!({"event": "STOP", "timestamp": {"seconds": 1700000000, "microseconds": 250000}});
        assert_eq!(event_seconds(&e), Some(1_700_000_000.25));
        assert_eq!(event_seconds(&json!({"event": "STOP"})), None);
    }
}
