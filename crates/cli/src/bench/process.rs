//! A `ferry run` child process that a benchmark drives through its API socket, and what /proc
//! tells of it: the soak and the scaling benchmark measure each VMM process on its own.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_migrate::{MigrationStats, Phase, Progress};
use ferry_vmm::api::client;
use ferry_vmm::request::MigrationRequest;
use serde_json::Value;

/// Longest any one step of a hop may take before the soak calls the run failed: a hop of the
/// default guest takes well under a second, so this only catches a hang.
pub const STEP_LIMIT: Duration = Duration::from_secs(60);
/// How often a step is looked at: a local handover completes in milliseconds, and a look is
/// one request on the API socket (a fraction of a millisecond).
const POLL: Duration = Duration::from_millis(1);

/// A `ferry run` child; killed on drop.
pub struct Vmm {
    pub name: &'static str,
    child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Vmm {
    pub fn spawn(name: &'static str, dir: &Path, args: &[String]) -> anyhow::Result<Vmm> {
        Vmm::spawn_in(None, name, dir, args)
    }

    /// [`Vmm::spawn`] inside the network namespace `netns` when given (`ip netns exec`, which
    /// becomes the process), so that its `--net tap=NAME` is that namespace's tap.
    pub fn spawn_in(
        netns: Option<&str>,
        name: &'static str,
        dir: &Path,
        args: &[String],
    ) -> anyhow::Result<Vmm> {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let mut command = match netns {
            None => Command::new(std::env::current_exe()?),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(std::env::current_exe()?);
                c
            }
        };
        let child = command
            .arg("run")
            .args(args)
            .args(["--serial", "none", "--api-socket"])
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(File::create(&log)?)
            .spawn()
            .context("cannot start ferry run")?;
        Ok(Vmm {
            name,
            child,
            socket,
            log,
        })
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        client::request(&self.socket, "GET", path).ok()
    }

    /// Polls until `done` holds for `GET path`, or fails naming `what` and the process's log.
    pub fn wait_for(
        &mut self,
        what: &str,
        path: &str,
        done: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + STEP_LIMIT;
        loop {
            if let Some(v) = self.get(path).filter(|v| done(v)) {
                return Ok(v);
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) while waiting for {what}:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not reach {what} within {STEP_LIMIT:?}:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Fails, naming `what` it was waiting for and the process's log, if the process exited.
    pub fn alive(&mut self, what: &str) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}) while waiting for {what}:\n{}",
                self.name,
                self.log_text()
            );
        }
        Ok(())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Open file descriptors and resident memory (KiB), from /proc. The descriptors are the
    /// fewest of a few looks 20 ms apart: a connection of the hop just ended may still be
    /// closing, and what a leak holds stays.
    pub fn usage(&self) -> anyhow::Result<(usize, u64)> {
        let proc = PathBuf::from(format!("/proc/{}", self.child.id()));
        let mut fds = usize::MAX;
        for _ in 0..3 {
            fds = fds.min(std::fs::read_dir(proc.join("fd"))?.count());
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = std::fs::read_to_string(proc.join("status"))?;
        let rss = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmRSS in /proc/PID/status")?;
        Ok((fds, rss))
    }

    /// Peak resident memory of the process so far (VmHWM), KiB.
    pub fn peak_rss_kib(&self) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmHWM in /proc/PID/status")
    }

    pub fn waiting(&mut self) -> anyhow::Result<()> {
        self.wait_for("waiting for a migration", "/migration", |m| {
            m["role"] == "destination" && m["phase"] == "waiting"
        })
        .map(drop)
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two `ferry run --then-incoming` processes a guest can hop between: `first` boots it (and
/// has verified its memory once), `second` waits; each listens at its own address (`at_a`,
/// `at_b`: loopback ports `port_a` and `port_b`, or Unix sockets) whenever it is without the
/// guest.
pub struct HopPair {
    pub first: Vmm,
    pub second: Vmm,
    pub port_a: u16,
    pub port_b: u16,
    pub at_a: String,
    pub at_b: String,
    /// Where the guest is: `first` (as it starts), or `second`.
    pub first_has_guest: bool,
}

/// The guest a [`HopPair`] runs, and where its processes wait.
pub struct PairSpec<'a> {
    pub memory: u64,
    pub vcpus: u8,
    pub cmdline: &'a str,
    /// Unix sockets in the bench's directory (what a local handover needs), not TCP.
    pub unix: bool,
}

impl HopPair {
    pub fn start(dir: &Path, memory: u64, cmdline: &str) -> anyhow::Result<HopPair> {
        let spec = PairSpec {
            memory,
            vcpus: 1,
            cmdline,
            unix: false,
        };
        HopPair::start_as(dir, &spec)
    }

    pub fn start_as(dir: &Path, spec: &PairSpec<'_>) -> anyhow::Result<HopPair> {
        let (port_a, port_b, at_a, at_b) = if spec.unix {
            let at = |name| format!("unix:{}", dir.join(name).display());
            (0, 0, at("first.in"), at("second.in"))
        } else {
            let (a, b) = (free_port()?, free_port()?);
            (a, b, at(a), at(b))
        };
        let machine = [
            "--memory".to_string(),
            spec.memory.to_string(),
            "--vcpus".into(),
            spec.vcpus.to_string(),
        ];
        let mut first = Vmm::spawn(
            "first",
            dir,
            &[
                &machine[..],
                &[
                    "--cmdline".into(),
                    spec.cmdline.into(),
                    "--then-incoming".into(),
                    at_a.clone(),
                ],
            ]
            .concat(),
        )?;
        let mut second = Vmm::spawn(
            "second",
            dir,
            &[
                &machine[..],
                &[
                    "--incoming".into(),
                    at_b.clone(),
                    "--then-incoming".into(),
                    at_b.clone(),
                ],
            ]
            .concat(),
        )?;
        first.wait_for("a first verify pass", "/vm", |s| {
            s["guest"]["verify_passes"].as_u64() >= Some(1)
        })?;
        second.waiting()?;
        Ok(HopPair {
            first,
            second,
            port_a,
            port_b,
            at_a,
            at_b,
            first_has_guest: true,
        })
    }
}

/// The middle value (the mean of the two middle ones for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// `values`' value at `q` (0..=1), sorting them.
pub fn quantile(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values
        .get(((values.len().saturating_sub(1)) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// The address a destination on loopback `port` is given as.
pub fn at(port: u16) -> String {
    format!("tcp:127.0.0.1:{port}")
}

pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A migration that completed, and the guest's counters after it verified on the destination.
pub struct Migrated {
    pub stats: MigrationStats,
    pub guest: Value,
    /// From the request to the source's API telling the migration's end (within [`POLL`]).
    pub took: Duration,
}

/// Starts a migration on `src` with `body` (PUT /migration), follows it to its end, and waits
/// for the guest to run on `dst` and verify its memory once more; fails unless the migration
/// completed and the guest found no bad page.
pub fn migrate_and_verify(
    src: &mut Vmm,
    dst: &mut Vmm,
    request: &MigrationRequest,
) -> anyhow::Result<Migrated> {
    let body = serde_json::to_string(request).context("encoding the migration request")?;
    let asked = Instant::now();
    client::request_with_body(&src.socket, "PUT", "/migration", &body)
        .context("could not start the migration")?;
    // Once it completes, `src` goes on to wait for the guest's return and tells how the
    // migration ended as `previous`.
    let ended = src.wait_for("the migration's end", "/migration", |m| {
        m["role"] == "destination"
            || matches!(
                m["phase"].as_str(),
                Some("completed" | "failed" | "cancelled")
            )
    })?;
    let took = asked.elapsed();
    let ended = match ended["role"] == "destination" {
        true => ended["previous"].clone(),
        false => ended,
    };
    let progress: Progress = serde_json::from_value(ended).context("unreadable progress")?;
    if progress.phase != Phase::Completed {
        bail!(
            "the migration ended {:?}: {}",
            progress.phase,
            progress.error.unwrap_or_default()
        );
    }
    let stats = progress
        .stats
        .context("a completed migration has statistics")?;
    let arrived = dst.wait_for("the guest running", "/vm", |s| s["state"] == "running")?;
    let guest = verified_again(dst, &arrived)?;
    Ok(Migrated { stats, guest, took })
}

/// The guest's counters on `dst` once it finished a verify pass after a migration, `arrived`
/// being `dst`'s status when the guest ran there; fails on a bad page.
pub(super) fn verified_again(dst: &mut Vmm, arrived: &Value) -> anyhow::Result<Value> {
    let passes = arrived["guest"]["verify_passes"].as_u64().unwrap_or(0);
    let guest = dst.wait_for("a verify pass after the migration", "/vm", |s| {
        s["guest"]["verify_passes"].as_u64() > Some(passes)
    })?["guest"]
        .clone();
    if guest["verify_failures"] != 0 || guest["bad_reads"] != 0 {
        bail!("the guest found bad pages after the migration: {guest:#}");
    }
    Ok(guest)
}
