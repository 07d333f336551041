//! QEMU as the peer of `ferry bench disk`: the same built-in guest, RAM, image and workload,
//! migrated with its disk the way libvirt migrates a VM whose storage the hosts do not share
//! (`virsh migrate --copy-storage-all`), through QMP:
//!
//! 1. the destination QEMU starts paused (`-incoming defer -S`) on an empty sparse image of
//!    the same size, with `late-block-activate` (its disk is taken over only when it runs);
//! 2. it serves that disk over NBD (`nbd-server-start` on a Unix socket in the run's own
//!    directory, which only its user may enter: a writable export on loopback TCP would be
//!    any local user's to write; `block-export-add` writable);
//! 3. the source opens the export as a block node (`blockdev-add`, driver `nbd`) and mirrors
//!    its disk into it (`blockdev-mirror`, `sync: full`), in the background (libvirt's
//!    default) or with `write-blocking` (libvirt's `--copy-storage-synchronous-writes`);
//! 4. once the mirror is ready (source and target in sync, `query-block-jobs`), RAM migrates
//!    (`migrate-incoming`, `migrate` over loopback TCP, 2 multifd channels as ferry's 2
//!    channels, a 300 ms downtime limit as ferry's, no bandwidth cap as libvirt sets none);
//! 5. after the migration completed, the source ends the mirror with `block-job-cancel` (a
//!    ready mirror stops in sync, without switching the source to its target), and the
//!    destination stops its NBD server and runs (`cont`).
//!
//! Total time runs from the mirror's start to the migration completed; the downtime is what
//! `query-migrate` reports; the guest's pause runs from the source's `STOP` event to the
//! destination's `RESUME` (both stamped by the host's clock), so it includes step 5. The
//! guest runs at CPL3 under QEMU as under ferry; it has no telemetry port there, so its
//! periodic serial line (`log-ms=`) carries its disk counters (`guest_log.rs`), and the
//! destination's guest reads back [`READS_AFTER`] blocks before the row takes its verdict.
//!
//! The machine is `microvm`, QEMU's machine with virtio-mmio: without ACPI (`acpi=off`) it
//! names each device on the kernel command line (`virtio_mmio.device=`), which is how the
//! guest finds devices, and `virtio-mmio.force-legacy=false` gives the version 2 transport
//! the guest drives.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::guest_log::{self, LogLine};
use super::qmp::{Kill, QemuVersion, Qmp, RemoveDir};

/// The oldest QEMU the row runs on: `block-export-add` came in 5.2, `microvm`'s `acpi`
/// switch in 6.0. Only QEMU 10.0 has been measured.
pub(super) const OLDEST: (u32, u32) = (6, 0);
/// Blocks the destination's guest reads back before the row takes its verdict, as
/// `precopy.rs`'s `DISK_READS_AFTER` for ferry's rows.
const READS_AFTER: u64 = 1000;
/// The guest's serial line every 250 ms: fine enough for its write rate before and during
/// the migration, a few hundred bytes a second of port writes.
const LOG_MS: u64 = 250;
/// How long the guest runs after its prefill before the mirror starts, so that the write
/// rate before the migration is measured over a second of lines.
const SETTLE: Duration = Duration::from_millis(1500);
/// How long the mirror may take to become ready and the migration to complete: as ferry's
/// rows wait for theirs (`precopy.rs`).
const PHASE_TIMEOUT: Duration = Duration::from_secs(120);

/// How the mirror treats the guest's writes while it copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CopyMode {
    /// Copied later from the dirty bitmap (libvirt's default).
    Background,
    /// Written to the target too before the guest's write completes (libvirt's
    /// `--copy-storage-synchronous-writes`): converges whatever the guest writes.
    WriteBlocking,
}

impl CopyMode {
    fn qmp(self) -> &'static str {
        match self {
            CopyMode::Background => "background",
            CopyMode::WriteBlocking => "write-blocking",
        }
    }
}

/// Whether this QEMU can run the row; the reason to print when it cannot.
pub(super) fn usable(v: &QemuVersion) -> Result<(), String> {
    match (v.major, v.minor) >= OLDEST {
        true => Ok(()),
        false => Err(format!(
            "{} is older than {}.{}, which the mirror to an NBD export needs (block-export-add, microvm without ACPI)",
            v.text, OLDEST.0, OLDEST.1
        )),
    }
}

/// One migration to make.
pub(super) struct QemuDiskSetup<'a> {
    pub memory: u64,
    /// The guest's command line (its workload); `log-ms=` is added.
    pub cmdline: &'a str,
    /// The source's image; the destination gets an empty one of the same size.
    pub image: &'a Path,
    /// Where the destination's image and QEMU's files go.
    pub dir: &'a Path,
    pub copy_mode: CopyMode,
}

/// What one migration measured.
#[derive(Clone, Debug, Default)]
pub(super) struct QemuDiskRun {
    /// From the mirror's start to the migration completed.
    pub total_ms: f64,
    /// From the mirror's start to its `ready`.
    pub mirror_ms: f64,
    /// `query-migrate`'s `downtime`.
    pub downtime_ms: f64,
    /// From the source's `STOP` to the destination's `RESUME`.
    pub pause_ms: f64,
    /// RAM bytes QEMU sent (`ram.transferred`).
    pub ram_mb: f64,
    /// The mirror job's length when it was cancelled: the disk's bytes plus what it copied
    /// again (holes count, sent as zero writes).
    pub mirror_mb: f64,
    /// The guest's disk writes in the second before the mirror, and from its start to the
    /// source's last line.
    pub write_mb_s: [Option<f64>; 2],
    /// Blocks the destination's guest read back after the migration.
    pub reads_after: u64,
    /// Verify failures and request errors, the source's and the destination's.
    pub bad: u64,
    /// Lines in which the guest named a failure.
    pub failures: Vec<String>,
}

/// Migrates a guest with its disk mirrored, as the module doc says.
pub(super) fn migrate(setup: &QemuDiskSetup<'_>) -> anyhow::Result<QemuDiskRun> {
    let work = setup
        .dir
        .join(format!("ferry-bench-qemu-disk-{}", std::process::id()));
    // Its user's alone (0700): it holds the QMP sockets and the writable NBD export's.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(&work)?;
    let _cleanup = RemoveDir(work.clone());
    let run = Paths::new(&work);
    migrate_in(setup, &run).map_err(|e| {
        let said = ["source", "destination"]
            .map(|side| std::fs::read_to_string(run.file(side, "err")).unwrap_or_default());
        e.context(format!(
            "QEMU's own messages: source {:?}, destination {:?}",
            said[0].trim(),
            said[1].trim()
        ))
    })
}

/// The files of one migration.
struct Paths {
    work: PathBuf,
}

impl Paths {
    fn new(work: &Path) -> Paths {
        Paths { work: work.into() }
    }

    fn file(&self, side: &str, ext: &str) -> PathBuf {
        self.work.join(format!("{side}.{ext}"))
    }
}

fn migrate_in(setup: &QemuDiskSetup<'_>, run: &Paths) -> anyhow::Result<QemuDiskRun> {
    let elf = run.file("guest", "elf");
    std::fs::write(&elf, ferry_guest_image::ELF)?;
    let size = std::fs::metadata(setup.image)?.len();
    let target = run.file("destination", "img");
    std::fs::File::create(&target)?.set_len(size)?;
    let cmdline = format!("{} log-ms={LOG_MS}", setup.cmdline);
    let start = |side: &str, image: &Path, extra: &[&str]| -> anyhow::Result<Kill> {
        let child = Command::new("qemu-system-x86_64")
            .args(["-M", "microvm,acpi=off,x-option-roms=off", "-enable-kvm"])
            .args(["-cpu", "host,-arch-capabilities", "-nodefaults"])
            .args([
                "-m",
                &format!("{}M", setup.memory >> 20),
                "-display",
                "none",
            ])
            .args(["-global", "virtio-mmio.force-legacy=false"])
            .arg("-serial")
            .arg(format!("file:{}", run.file(side, "log").display()))
            .arg("-kernel")
            .arg(&elf)
            .args(["-append", &cmdline])
            .arg("-blockdev")
            .arg(format!(
                "driver=file,filename={},node-name=disk0",
                image.display()
            ))
            .args(["-device", "virtio-blk-device,drive=disk0"])
            .arg("-qmp")
            .arg(format!(
                "unix:{},server=on,wait=off",
                run.file(side, "qmp").display()
            ))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(run.file(side, "err"))?)
            .spawn()
            .context("starting qemu-system-x86_64")?;
        Ok(Kill(child))
    };
    let _source = start("source", setup.image, &[])?;
    let _destination = start("destination", &target, &["-incoming", "defer", "-S"])?;
    let mut src = Qmp::connect(&run.file("source", "qmp"))?;
    let mut dst = Qmp::connect(&run.file("destination", "qmp"))?;
    let src_log = run.file("source", "log");
    let deadline = Instant::now() + Duration::from_secs(300);
    while !read(&src_log).contains("prefilled") {
        if Instant::now() > deadline {
            bail!("the guest under QEMU did not finish its prefill");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(SETTLE);

    for q in [&mut src, &mut dst] {
        q.capabilities_on(&["multifd"])?;
        q.execute("migrate-set-parameters", json!({ "multifd-channels": 2 }))?;
    }
    dst.capabilities_on(&["late-block-activate"])?;
    // 1 TB/s: no cap, as libvirt leaves it (QEMU's own default is 128 MiB/s).
    src.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": 1u64 << 40, "downtime-limit": 300 }),
    )?;
    let nbd = run.file("destination", "nbd");
    dst.execute(
        "nbd-server-start",
        json!({ "addr": { "type": "unix", "data": { "path": nbd } } }),
    )?;
    dst.execute(
        "block-export-add",
        json!({ "type": "nbd", "id": "disk0", "node-name": "disk0", "writable": true }),
    )?;

    let before = guest_log::lines(&read(&src_log));
    let started = before.last().copied();
    let second_before = started.and_then(|s| before.iter().rev().find(|l| l.t_s <= s.t_s - 1.0));
    let t0 = Instant::now();
    src.execute(
        "blockdev-add",
        json!({ "driver": "nbd", "node-name": "mirror-target", "export": "disk0",
                "server": { "type": "unix", "path": nbd } }),
    )?;
    src.execute(
        "blockdev-mirror",
        json!({ "job-id": "mirror", "device": "disk0", "target": "mirror-target",
                "sync": "full", "copy-mode": setup.copy_mode.qmp() }),
    )?;
    src.wait_for(
        "query-block-jobs",
        Duration::from_millis(10),
        PHASE_TIMEOUT,
        mirror_ready,
    )
    .context("the mirror did not become ready")?;
    let mirror_ms = t0.elapsed().as_secs_f64() * 1e3;

    let migration_port = free_port()?;
    let uri = format!("tcp:127.0.0.1:{migration_port}");
    dst.execute("migrate-incoming", json!({ "uri": uri }))?;
    src.execute("migrate", json!({ "uri": uri }))?;
    let status = src.wait_completed(PHASE_TIMEOUT)?;
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let last_source = guest_log::lines(&read(&src_log)).last().copied();

    let jobs = src.execute("query-block-jobs", json!({}))?;
    src.execute("block-job-cancel", json!({ "device": "mirror" }))?;
    src.wait_for(
        "query-block-jobs",
        Duration::from_millis(2),
        PHASE_TIMEOUT,
        |j| j.as_array().is_some_and(|a| a.is_empty()),
    )
    .context("the cancelled mirror did not end")?;
    dst.execute("nbd-server-stop", json!({}))?;
    dst.execute("cont", json!({}))?;
    dst.wait_for(
        "query-status",
        Duration::from_millis(2),
        PHASE_TIMEOUT,
        |s| s["running"] == true,
    )?;
    let pause_ms = match (src.event_seconds("STOP"), dst.event_seconds("RESUME")) {
        (Some(stop), Some(resume)) => (resume - stop) * 1e3,
        _ => f64::NAN,
    };

    let dst_log = run.file("destination", "log");
    let read_at_stop = last_source.and_then(|l| l.disk).map_or(0, |d| d.read);
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        let last = guest_log::lines(&read(&dst_log)).last().copied();
        let read = last.and_then(|l| l.disk).map_or(0, |d| d.read);
        if read >= read_at_stop + READS_AFTER {
            break last.unwrap_or_default();
        }
        if Instant::now() > deadline {
            bail!(
                "the destination's guest read back {} blocks in 60 s, not {READS_AFTER}",
                read.saturating_sub(read_at_stop)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let disk = after.disk.unwrap_or_default();
    let rate =
        |from: Option<&LogLine>, to: Option<&LogLine>| guest_log::write_rate_mb_s(from?, to?);
    let mut failures: Vec<String> = guest_log::failure_lines(&read(&src_log))
        .into_iter()
        .chain(guest_log::failure_lines(&read(&dst_log)))
        .map(String::from)
        .collect();
    failures.truncate(8);
    Ok(QemuDiskRun {
        total_ms,
        mirror_ms,
        downtime_ms: status["downtime"].as_f64().unwrap_or(f64::NAN),
        pause_ms,
        ram_mb: status["ram"]["transferred"].as_f64().unwrap_or(0.0) / 1e6,
        mirror_mb: mirror_len(&jobs).unwrap_or(0) as f64 / 1e6,
        write_mb_s: [
            rate(second_before, started.as_ref()),
            rate(started.as_ref(), last_source.as_ref()),
        ],
        reads_after: disk.read - read_at_stop,
        bad: disk.bad + disk.errors + after.failures,
        failures,
    })
}

/// Whether `query-block-jobs` shows the mirror ready (in sync with its target).
fn mirror_ready(jobs: &Value) -> bool {
    jobs.as_array().is_some_and(|a| {
        a.iter()
            .any(|j| j["device"] == "mirror" && j["ready"] == true)
    })
}

/// The mirror's `len` in a `query-block-jobs` answer.
fn mirror_len(jobs: &Value) -> Option<u64> {
    jobs.as_array()?.iter().find(|j| j["device"] == "mirror")?["len"].as_u64()
}

/// A loopback port free now (a QEMU listens on it a moment later).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A serial log so far (empty before QEMU made it).
fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_is_ready_only_when_its_job_says_so() {
        let copying = json!([{ "device": "mirror", "type": "mirror", "len": 100, "offset": 40, "ready": false }]);
        let ready = json!([{ "device": "mirror", "type": "mirror", "len": 120, "offset": 120, "ready": true }]);
        let other = json!([{ "device": "backup", "ready": true }]);
        assert!(!mirror_ready(&copying));
        assert!(mirror_ready(&ready));
        assert!(!mirror_ready(&other));
        assert!(!mirror_ready(&json!([])));
        assert_eq!(mirror_len(&ready), Some(120));
        assert_eq!(mirror_len(&other), None);
    }

    #[test]
    fn a_qemu_older_than_the_row_needs_is_refused_with_its_version() {
        let v = |major, minor| QemuVersion {
            text: format!("QEMU emulator version {major}.{minor}.0"),
            major,
            minor,
        };
        assert!(usable(&v(10, 0)).is_ok());
        assert!(usable(&v(6, 0)).is_ok());
        let why = usable(&v(5, 2)).unwrap_err();
        assert!(why.contains("5.2.0") && why.contains("6.0"), "{why}");
    }
}
