//! `ferry bench snapshot`: saves and restores of an 8 GiB guest holding 4 GiB of random data,
//! each set against references measured in the same run:
//!
//! - the file system's sequential write rate (as much data as the guest holds, in 2 MiB writes,
//!   then `fdatasync`), which bounds a save;
//! - the fresh-memory write rate (`pwrite` of 1 GiB into a fresh memfd, on 1 thread and on as
//!   many threads as an eager restore reads with), which bounds an eager restore.
//!
//! Rows: a save with `stop` of the idle guest (time, rate, the file's allocated blocks against
//! the data the guest holds), its eager, lazy and mapped restores (time to the guest running
//! and to its first report, the rate RAM comes in at), and `--clones` VMs mapped from that
//! file at once (`clones.rs`: their memory against one guest's); a live save while the guest dirties a hot 1 GiB of its working set
//! at 400 MB/s (the pause the guest saw, and the peak memory the save added to this process),
//! and that file's lazy restore with and without its hot set (the guest's demand faults); the
//! same live guest migrated over loopback (`live_gap.rs`: its longest stall).
//! Every restored guest must then finish a verify pass of its whole working set, clean. The same idle guest is also saved and restored by the
//! QEMU installed here (`qemu.rs`), on the same file system: the peer a user would compare.
//!
//! The restores read a file the save just wrote: its pages are in the page cache (warm), as
//! in the QEMU figures the issue quotes. The guest's RAM on either side is fresh memory.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferry_migrate::snapshot::{AfterSave, Loading};
use ferry_migrate::{MigrationStats, Phase};
use ferry_vmm::devices::telemetry::host_monotonic_ns;
use ferry_vmm::memory::{GuestRam, HostPages};
use ferry_vmm::snapshot::SnapshotRequest;
use ferry_vmm::{GuestKind, SerialOutput, StopReason, Vm, VmConfig, VmHandle};
use serde_json::json;

use super::precopy::wait;

#[derive(Debug, Args)]
pub struct SnapshotBenchArgs {
    /// Where the snapshot files go (about 4.3 GB each, one at a time; removed at the end).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Only the idle guest's rows (`idle`) or the writing guest's (`live`).
    #[arg(long, value_parser = ["idle", "live"])]
    only: Option<String>,
    /// Leave QEMU out (by default the idle guest is also saved and restored by the QEMU
    /// installed here, the same guest on the same file system).
    #[arg(long)]
    no_qemu: bool,
    /// Clones mapped from the idle guest's snapshot at once (`--map`), whose memory is
    /// measured together against one guest's; 0 leaves them out.
    #[arg(long, default_value_t = 10)]
    clones: usize,
    /// Guest RAM (the data is half of it).
    #[arg(long, default_value = "8G", value_parser = crate::sizes::parse_size)]
    memory: u64,
}

const GIB: u64 = 1 << 30;
/// Writes of the file system reference.
const FS_CHUNK: usize = 2 << 20;

pub fn run(args: &SnapshotBenchArgs) -> anyhow::Result<ExitCode> {
    let data = args.memory / 2;
    let ws = format!(
        "ws={}M fill=random prefill=1 log-ms=0 heartbeat-ms=2",
        data >> 20
    );
    let readers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let mut rows = Vec::new();
    println!("references (same run):");
    // As much as the snapshot holds: the page cache absorbs the first gigabytes of any write
    // and the disk's rate bounds the rest, so a shorter reference flatters the disk.
    let fs = fs_write_rate(&args.dir, data)?;
    println!(
        "  file system, sequential write + fdatasync: {:>8.0} MB/s",
        fs / 1e6
    );
    let fresh1 = fresh_pwrite_rate(GIB, 1)?;
    let fresh_n = fresh_pwrite_rate(GIB, readers)?;
    // The better of the two is what the eager restore is held to.
    let fresh = fresh1.max(fresh_n);
    println!(
        "  pwrite into fresh memory, 1 thread:         {:>8.0} MB/s",
        fresh1 / 1e6
    );
    println!(
        "  pwrite into fresh memory, {readers} threads:        {:>8.0} MB/s",
        fresh_n / 1e6
    );
    rows.push(json!({"bench": "snapshot_ref", "fs_write_mb_s": fs / 1e6,
        "fresh_pwrite_1_mb_s": fresh1 / 1e6, "fresh_pwrite_mb_s": fresh_n / 1e6, "threads": readers}));

    let file = args
        .dir
        .join(format!("ferry-bench-{}.snap", std::process::id()));
    let _cleanup = Remove(file.clone());
    let config = config(args.memory, &format!("{ws} rate=1 verify-ms=3000"));
    if args.only.as_deref() != Some("live") {
        idle_rows(&config, &file, data, (fs, fresh), args, &mut rows)?;
    }
    if args.only.as_deref() != Some("idle") {
        live_rows(&config, &file, &ws, data, &mut rows)?;
    }
    println!();
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The idle guest: a save with `stop`, its eager, lazy and mapped restores, and its clones;
/// `fs` and `fresh` are the references.
fn idle_rows(
    config: &VmConfig,
    file: &Path,
    data: u64,
    (fs, fresh): (f64, f64),
    args: &SnapshotBenchArgs,
    rows: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    println!(
        "\n{} GiB guest, {} GiB random data, idle:",
        config.memory_bytes / GIB,
        data / GIB
    );
    let (stats, _) = save(config, file, AfterSave::Stop, Duration::ZERO)?;
    let allocated = std::fs::metadata(file)?.blocks() * 512;
    let save_ms = stats.total_ms;
    let mb_s = data as f64 / 1e3 / save_ms;
    let passes_ms: f64 = stats.passes.iter().map(|p| p.duration_ms).sum();
    println!(
        "  save --stop        {save_ms:>8.0} ms  {mb_s:>6.0} MB/s = {:.2} of the file system's  (passes {:.0} ms, the file's end and sync {:.0} ms)  file {:.1} MiB allocated for {} MiB of data ({:+.2}%)  pause {:.1} ms",
        mb_s * 1e6 / fs,
        passes_ms,
        save_ms - passes_ms - stats.setup_ms,
        allocated as f64 / (1 << 20) as f64,
        data >> 20,
        (allocated as f64 / data as f64 - 1.0) * 100.0,
        stats.downtime.total_ms
    );
    rows.push(
        json!({"bench": "snapshot", "row": "save_stop", "total_ms": save_ms,
        "data_mb_s": mb_s, "ratio_fs": mb_s * 1e6 / fs, "allocated_bytes": allocated,
        "data_bytes": data, "overhead_percent": (allocated as f64 / data as f64 - 1.0) * 100.0}),
    );
    // Eager restore.
    let r = restore(config, file, Loading::Eager, true)?;
    let eager_ms = r.to_running_ms;
    let rate = r.bytes as f64 / (r.ram_ms / 1e3);
    println!(
        "  eager restore      {:>8.0} ms  {:>6.0} MB/s = {:.2} of fresh memory (the better reference)  RAM {:.0} ms, state {:.1} ms; first report {:.1} ms; verify clean",
        r.to_running_ms,
        rate / 1e6,
        rate / fresh,
        r.ram_ms,
        r.state_ms,
        r.first_report_ms
    );
    rows.push(
        json!({"bench": "snapshot", "row": "restore_eager", "to_running_ms": r.to_running_ms,
        "first_report_ms": r.first_report_ms,
        "ram_ms": r.ram_ms, "mb_s": rate / 1e6, "ratio_fresh": rate / fresh}),
    );
    // Lazy restore.
    let r = restore(config, file, Loading::Lazy, true)?;
    println!(
        "  lazy restore       {:>8.1} ms to the guest running (open {:.1} ms, state {:.1} ms, resume {:.1} ms), first report {:.1} ms; all of RAM in {:.0} ms at {:.2} GB/s; {} demand faults; verify clean",
        r.to_running_ms,
        r.open_ms,
        r.state_ms,
        r.resume_ms,
        r.first_report_ms,
        r.load_ms,
        r.bytes as f64 / 1e6 / r.load_ms,
        r.faults
    );
    rows.push(
        json!({"bench": "snapshot", "row": "restore_lazy", "to_running_ms": r.to_running_ms,
        "first_report_ms": r.first_report_ms,
        "state_load_ms": r.state_ms, "resume_ms": r.resume_ms, "load_ms": r.load_ms,
        "gb_s": r.bytes as f64 / 1e6 / r.load_ms, "demand_faults": r.faults}),
    );
    // Mapped restore: the file's RAM mapped copy-on-write, nothing read.
    let r = restore(config, file, Loading::Mapped, true)?;
    println!(
        "  mapped restore     {:>8.1} ms to the guest running (open {:.1} ms, map {:.1} ms, state {:.1} ms, resume {:.1} ms), first report {:.1} ms (goal 10 ms); verify clean",
        r.to_running_ms, r.open_ms, r.ram_ms, r.state_ms, r.resume_ms, r.first_report_ms
    );
    rows.push(
        json!({"bench": "snapshot", "row": "restore_mapped", "to_running_ms": r.to_running_ms,
        "first_report_ms": r.first_report_ms, "open_ms": r.open_ms, "map_ms": r.ram_ms,
        "state_load_ms": r.state_ms, "resume_ms": r.resume_ms}),
    );
    if args.clones > 0 {
        super::clones::rows(config, file, data, args.clones, rows)?;
    }
    if args.no_qemu {
        return Ok(());
    }
    let dir = file.parent().unwrap_or(Path::new("."));
    match super::qemu::save_and_restore(config.memory_bytes, &config.cmdline, dir)? {
        None => println!("  QEMU: qemu-system-x86_64 is not installed; --no-qemu skips it"),
        Some(q) => {
            println!(
                "  {} ({}): save --stop {:.0} ms (ferry {:.2} of it), restore {:.0} ms (ferry's eager {:.2} of it), file {:.1} MiB allocated",
                q.version,
                if q.mapped_ram {
                    "file: with mapped-ram, 2 multifd channels"
                } else {
                    "no mapped-ram: exec:cat"
                },
                q.save_ms,
                save_ms / q.save_ms,
                q.restore_ms,
                eager_ms / q.restore_ms,
                q.allocated as f64 / (1 << 20) as f64
            );
            rows.push(
                json!({"bench": "snapshot", "row": "qemu", "version": q.version,
                "mapped_ram": q.mapped_ram, "save_ms": q.save_ms, "restore_ms": q.restore_ms,
                "allocated_bytes": q.allocated, "ferry_save_ratio": save_ms / q.save_ms,
                "ferry_restore_ratio": eager_ms / q.restore_ms}),
            );
        }
    }
    Ok(())
}

/// The guest dirtying a hot 1 GiB: a live save, and its lazy restore with and without the hot
/// set.
fn live_rows(
    config: &VmConfig,
    file: &Path,
    ws: &str,
    data: u64,
    rows: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    println!(
        "\nthe same guest dirtying a hot 1 GiB of its data at 400 MB/s (dirty log start: {}):",
        super::live_gap::dirty_log_start()
    );
    let hot = (GIB * 100 / data).clamp(1, 100);
    let config = config_with(
        config,
        &format!("{ws} pattern=hotcold hot={hot} rate=400 verify-ms=0"),
    );
    let (stats, seen) = save(&config, file, AfterSave::Resume, Duration::from_millis(20))?;
    println!(
        "  live save          {:>8.0} ms  {} passes, throttle up to {}%, pause {:.1} ms; the guest saw at most {:.1} ms between heartbeats (2 s before: {:.1} ms; dirty log start {:.1} ms); peak memory added {:.0} MiB (the final pass staged in {:.0} MiB)",
        stats.total_ms,
        stats.passes.len(),
        stats.throttle_max_percent,
        stats.downtime.total_ms,
        seen.gap_ms,
        seen.baseline_ms,
        stats.dirty_start_ms,
        seen.peak_added_mib,
        stats.staged_bytes as f64 / (1 << 20) as f64
    );
    rows.push(
        json!({"bench": "snapshot", "row": "save_live", "total_ms": stats.total_ms,
        "passes": stats.passes.len(), "pause_ms": stats.downtime.total_ms,
        "guest_gap_ms": seen.gap_ms, "guest_gap_before_ms": seen.baseline_ms,
        "throttle_max": stats.throttle_max_percent, "dirty_start_ms": stats.dirty_start_ms,
        "peak_rss_added_mib": seen.peak_added_mib, "staged_bytes": stats.staged_bytes,
        "dirty_log_start": super::live_gap::dirty_log_start()}),
    );
    super::live_gap::migration_row(config.memory_bytes, &config.cmdline, rows)?;
    let with = restore(&config, file, Loading::Lazy, true)?;
    let without = restore(&config, file, Loading::Lazy, false)?;
    println!(
        "  lazy restore, hot set first: {} demand faults ({} hot pages); without it: {} = {:.1}%",
        with.faults,
        with.hot_pages,
        without.faults,
        with.faults as f64 * 100.0 / without.faults.max(1) as f64
    );
    rows.push(
        json!({"bench": "snapshot", "row": "restore_lazy_hot", "faults_hot_first": with.faults,
        "faults_without": without.faults, "hot_pages": with.hot_pages,
        "ratio": with.faults as f64 / without.faults.max(1) as f64}),
    );
    Ok(())
}

/// Removes a file when dropped.
struct Remove(PathBuf);

/// What a save's watchers saw besides its statistics.
struct Seen {
    /// The longest gap between the guest's heartbeats during the save, and in 2 s before it.
    gap_ms: f64,
    baseline_ms: f64,
    /// How far this process's peak resident memory rose above what it held when the save
    /// started (VmHWM, reset at the start through `/proc/self/clear_refs`): what the snapshot
    /// added, the guest's RAM being populated already.
    peak_added_mib: f64,
}

/// A field of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(field: &str) -> anyhow::Result<u64> {
    std::fs::read_to_string("/proc/self/status")?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/self/status"))
}

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn config(memory: u64, cmdline: &str) -> VmConfig {
    VmConfig {
        memory_bytes: memory,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: cmdline.into(),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::Discard,
        balloon: true,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: HostPages::Small,
        next_layout: false,
    }
}

fn config_with(c: &VmConfig, cmdline: &str) -> VmConfig {
    VmConfig {
        cmdline: cmdline.into(),
        ..c.clone()
    }
}

/// Boots `config`, waits for its prefill, snapshots it into `file` (to stop it after, or live
/// with `downtime` as its limit) and stops it; returns the statistics and the longest gap
/// between the guest's heartbeats the host saw while the snapshot ran (with
/// [`AfterSave::Stop`], the pause from the snapshot's end on is not in it).
fn save(
    config: &VmConfig,
    file: &Path,
    after: AfterSave,
    downtime: Duration,
) -> anyhow::Result<(MigrationStats, Seen)> {
    let vm = Vm::boot(config.clone())?;
    let h = vm.handle();
    prefilled(&h)?;
    let mut req = SnapshotRequest {
        to: file.to_owned(),
        stop: after == AfterSave::Stop,
        ..SnapshotRequest::default()
    };
    if !downtime.is_zero() {
        req.downtime_limit_ms = downtime.as_millis() as u64;
    }
    // The longest gap between the guest's heartbeats (every 2 ms) while the snapshot runs, as
    // a thread looking every millisecond sees their arrival times.
    let done = std::sync::atomic::AtomicBool::new(false);
    let baseline = heartbeat_gap(&h, Duration::from_secs(2));
    // The peak from here on (writing 5 resets VmHWM to what is resident now).
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak memory")?;
    let rss_before = status_kib("VmRSS")?;
    let gap = std::thread::scope(|scope| -> anyhow::Result<u64> {
        let watcher = scope.spawn(|| {
            let (mut last, mut gap) = (h.telemetry().last_report_host_ns, 0u64);
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                let now = h.telemetry().last_report_host_ns;
                if let (Some(a), Some(b)) = (last, now)
                    && b - a > gap
                {
                    gap = b - a;
                    tracing::debug!(
                        "heartbeat gap {:.1} ms in {:?}",
                        gap as f64 / 1e6,
                        h.migration().map(|p| p.phase)
                    );
                }
                last = now;
                std::thread::sleep(Duration::from_millis(1));
            }
            gap
        });
        let saved = h
            .start_snapshot(req)
            .map_err(anyhow::Error::from)
            .and_then(|_| {
                wait(&h, Duration::from_secs(300), |h| {
                    h.migration().is_some_and(|p| !p.phase.is_active())
                })
            });
        done.store(true, std::sync::atomic::Ordering::Release);
        let gap = watcher.join().expect("watcher");
        saved.map(|()| gap)
    })?;
    let peak_added_mib = status_kib("VmHWM")?.saturating_sub(rss_before) as f64 / 1024.0;
    let p = h.migration().context("no snapshot")?;
    h.stop(StopReason::Requested("benchmark done".into()));
    vm.wait();
    if p.phase != Phase::Completed {
        bail!("snapshot {:?}: {}", p.phase, p.error.unwrap_or_default());
    }
    Ok((
        p.stats.context("no statistics")?,
        Seen {
            gap_ms: gap as f64 / 1e6,
            baseline_ms: baseline,
            peak_added_mib,
        },
    ))
}

/// The longest gap between the guest's heartbeats over `window`, with nothing else running.
fn heartbeat_gap(h: &VmHandle, window: Duration) -> f64 {
    let end = Instant::now() + window;
    let (mut last, mut gap) = (h.telemetry().last_report_host_ns, 0u64);
    while Instant::now() < end {
        let now = h.telemetry().last_report_host_ns;
        if let (Some(a), Some(b)) = (last, now) {
            gap = gap.max(b - a);
        }
        last = now;
        std::thread::sleep(Duration::from_millis(1));
    }
    gap as f64 / 1e6
}

/// Waits until the guest has written its working set once.
fn prefilled(h: &VmHandle) -> anyhow::Result<()> {
    wait(h, Duration::from_secs(300), |h| {
        let t = h.telemetry();
        t.config
            .as_ref()
            .is_some_and(|c| t.pages_written >= c.working_set_pages)
            && t.heartbeats > 100
    })
    .context("the guest did not finish its prefill")
}

/// What one restore measured.
pub(super) struct Restored {
    to_running_ms: f64,
    /// From the restore's start to the guest's first report after it (host clock stamps).
    pub(super) first_report_ms: f64,
    open_ms: f64,
    ram_ms: f64,
    state_ms: f64,
    resume_ms: f64,
    /// Lazy: from the resume to all of RAM in place.
    load_ms: f64,
    bytes: u64,
    faults: u64,
    hot_pages: u64,
}

/// Restores `file` into a VM of `config`'s devices, waits for a clean verify pass (and a lazy
/// load's end), stops it.
fn restore(
    config: &VmConfig,
    file: &Path,
    loading: Loading,
    hot_first: bool,
) -> anyhow::Result<Restored> {
    let started_ns = host_monotonic_ns();
    let (vm, restored) = ferry_vmm::snapshot::restore(config.clone(), file, loading, hot_first)?;
    let h = vm.handle();
    let first_report_ms = super::clones::first_report_ms(&h, started_ns)?;
    let s = &restored.stats;
    let mut r = Restored {
        first_report_ms,
        to_running_ms: s.to_running_ms,
        open_ms: s.open_ms,
        ram_ms: s.ram_ms,
        state_ms: s.state_load_ms,
        resume_ms: s.resume_ms,
        load_ms: 0.0,
        bytes: s.bytes_read,
        faults: 0,
        hot_pages: 0,
    };
    if let Some(lazy) = restored.lazy {
        let l = lazy.wait(|_| h.stop(StopReason::Failed("the lazy restore failed".into())))?;
        ferry_vmm::snapshot::loaded(&h);
        r.load_ms = l.load_ms;
        r.bytes = l.bytes_read;
        r.faults = l.demand_faults;
        r.hot_pages = l.hot_pages;
    }
    let verifies = h.telemetry().verify_passes;
    let verifying = h.telemetry().config.is_some_and(|c| c.verify_ms > 0);
    if verifying {
        wait(&h, Duration::from_secs(120), |h| {
            h.telemetry().verify_passes > verifies
        })
        .context("no verify pass after the restore")?;
    }
    let t = h.telemetry();
    h.stop(StopReason::Requested("benchmark done".into()));
    vm.wait();
    if t.verify_failures > 0 || t.bad_pages_total > 0 {
        bail!(
            "the restored guest found {} bad pages in {} failed verify passes",
            t.bad_pages_total,
            t.verify_failures
        );
    }
    Ok(r)
}

/// Bytes per second the file system takes `bytes` of data at in `dir`, written sequentially
/// and made durable with `fdatasync`, the way a snapshot's end is.
fn fs_write_rate(dir: &Path, bytes: u64) -> anyhow::Result<f64> {
    let path = dir.join(format!("ferry-bench-fs-{}", std::process::id()));
    let _cleanup = Remove(path.clone());
    let mut f =
        File::create(&path).with_context(|| format!("cannot write in {}", dir.display()))?;
    let mut chunk = vec![0u8; FS_CHUNK];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for w in chunk.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    let t = Instant::now();
    for _ in 0..bytes / FS_CHUNK as u64 {
        f.write_all(&chunk)?;
    }
    f.sync_data()?;
    Ok(bytes as f64 / t.elapsed().as_secs_f64())
}

/// Bytes per second `pwrite` lands `bytes` in a fresh memfd at, split over `threads`.
fn fresh_pwrite_rate(bytes: u64, threads: usize) -> anyhow::Result<f64> {
    let ram = GuestRam::new(bytes)?;
    let chunk = vec![0x5au8; FS_CHUNK];
    let per = bytes / threads as u64;
    let t = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let ram = &ram;
        let chunk = &chunk;
        let workers: Vec<_> = (0..threads as u64)
            .map(|i| {
                s.spawn(move || -> std::io::Result<()> {
                    for off in (i * per..(i + 1) * per).step_by(FS_CHUNK) {
                        ram.memfd().write_all_at(chunk, off)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().expect("writer")?;
        }
        Ok(())
    })?;
    Ok(bytes as f64 / t.elapsed().as_secs_f64())
}
