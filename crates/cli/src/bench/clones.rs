//! `ferry bench snapshot`'s clones: `--clones` VMs mapped from one snapshot at once
//! (`Loading::Mapped`, `ferry run --restore FILE --map`), their memory set against one guest's
//! measured in the same run, an eager restore of the same file (goal: the clones together at
//! most 1.2 times one guest).
//!
//! Memory is counted two ways, each from before the VMs to when every guest has finished two
//! verify passes of its whole working set after its restore (so each has read every page of
//! its data; each must find it clean):
//! - this process's proportional set size (`Pss` of `/proc/self/smaps_rollup`): a page of
//!   the file's page cache that ten clones map counts once, a page a guest wrote counts in
//!   full; unmoved by what other processes on the host do;
//! - the host's memory in use (`MemTotal - MemFree` of `/proc/meminfo`), with its `Cached`,
//!   `AnonPages` and `Shmem` parts: what the clones cost the host, page cache included,
//!   noisy on a host others share.
//!
//! The file's pages are dropped from the page cache before each measure
//! (`POSIX_FADV_DONTNEED`; the save synced them), so the clones pay for reading their data
//! and the eager guest's own reading of the file shows as `Cached`.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_migrate::snapshot::Loading;
use ferry_vmm::devices::telemetry::host_monotonic_ns;
use ferry_vmm::{StopReason, VmConfig, VmHandle};
use serde_json::json;

use super::precopy::wait;

const MIB: f64 = (1 << 20) as f64;

/// What memory a set of VMs took, in bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Taken {
    pss: i64,
    used: i64,
    cached: i64,
    anon: i64,
    shmem: i64,
}

/// The figures [`Taken`] is the growth of.
fn now() -> anyhow::Result<Taken> {
    let info = std::fs::read_to_string("/proc/meminfo")?;
    let field = |text: &str, name: &str| -> anyhow::Result<i64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
            .map(|kib| kib * 1024)
            .with_context(|| format!("no {name} in /proc"))
    };
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup")?;
    Ok(Taken {
        pss: field(&rollup, "Pss")?,
        used: field(&info, "MemTotal")? - field(&info, "MemFree")?,
        cached: field(&info, "Cached")?,
        anon: field(&info, "AnonPages")?,
        shmem: field(&info, "Shmem")?,
    })
}

impl Taken {
    fn since(self, before: Taken) -> Taken {
        Taken {
            pss: self.pss - before.pss,
            used: self.used - before.used,
            cached: self.cached - before.cached,
            anon: self.anon - before.anon,
            shmem: self.shmem - before.shmem,
        }
    }

    fn show(&self) -> String {
        format!(
            "PSS {:+.0} MiB, host memory in use {:+.0} MiB (Cached {:+.0}, AnonPages {:+.0}, Shmem {:+.0})",
            self.pss as f64 / MIB,
            self.used as f64 / MIB,
            self.cached as f64 / MIB,
            self.anon as f64 / MIB,
            self.shmem as f64 / MIB
        )
    }
}

/// Milliseconds from `started_ns` (the host's monotonic clock) to the restored guest's first
/// report, as the telemetry port stamped it on arrival.
pub(super) fn first_report_ms(h: &VmHandle, started_ns: u64) -> anyhow::Result<f64> {
    wait(h, Duration::from_secs(60), |h| {
        h.telemetry().migration_resumed_host_ns.is_some()
    })
    .context("no report from the restored guest")?;
    let first = h
        .telemetry()
        .migration_resumed_host_ns
        .unwrap_or(started_ns);
    Ok(first.saturating_sub(started_ns) as f64 / 1e6)
}

/// Drops `file`'s clean pages from the page cache.
fn uncache(file: &Path) -> anyhow::Result<()> {
    use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
    let f = std::fs::File::open(file)?;
    posix_fadvise(&f, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .with_context(|| format!("dropping {} from the page cache", file.display()))
}

/// `n` VMs restored from `file` with `loading`, each run until its guest finished two verify
/// passes after its restore (clean), then measured together and stopped. Returns what they took
/// and each one's time from its restore's start to its guest's first report.
fn measure(
    config: &VmConfig,
    file: &Path,
    loading: Loading,
    n: usize,
) -> anyhow::Result<(Taken, Vec<f64>)> {
    uncache(file)?;
    std::thread::sleep(Duration::from_millis(500));
    let before = now()?;
    let mut vms = Vec::new();
    let mut firsts = Vec::new();
    for _ in 0..n {
        let started = host_monotonic_ns();
        let (vm, _) = ferry_vmm::snapshot::restore(config.clone(), file, loading, true)?;
        firsts.push(first_report_ms(&vm.handle(), started)?);
        let passes = vm.handle().telemetry().verify_passes;
        vms.push((vm, passes));
    }
    let t = Instant::now();
    // Two passes: the first may have begun before the snapshot, and read the rest of the
    // working set only after the restore.
    for (vm, passes) in &vms {
        wait(&vm.handle(), Duration::from_secs(600), |h| {
            h.telemetry().verify_passes > *passes + 1
        })
        .context("no verify pass after the restore")?;
    }
    tracing::debug!("{n} guests verified in {:.1} s", t.elapsed().as_secs_f64());
    let taken = now()?.since(before);
    for (vm, _) in vms {
        let h = vm.handle();
        let t = h.telemetry();
        h.stop(StopReason::Requested("benchmark done".into()));
        vm.wait();
        if t.verify_failures > 0 || t.bad_pages_total > 0 {
            bail!(
                "a restored guest found {} bad pages in {} failed verify passes",
                t.bad_pages_total,
                t.verify_failures
            );
        }
    }
    Ok((taken, firsts))
}

/// The clones' rows: one eager guest, then `n` mapped clones, each measured from a cold
/// page cache.
pub(super) fn rows(
    config: &VmConfig,
    file: &Path,
    data: u64,
    n: usize,
    rows: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    let (one, _) = measure(config, file, Loading::Eager, 1)?;
    println!("  one guest, eager restore:       {}", one.show());
    let (all, firsts) = measure(config, file, Loading::Mapped, n)?;
    let ratio = all.pss as f64 / one.pss as f64;
    let used_ratio = all.used as f64 / one.pss as f64;
    let slowest = firsts.iter().copied().fold(0.0, f64::max);
    println!(
        "  {n} clones, mapped at once:      {}\n    = {ratio:.2} of one guest's PSS (goal 1.2), host memory in use {used_ratio:.2} of it; first reports {:.1}-{slowest:.1} ms after each restore's start; every clone verifies clean",
        all.show(),
        firsts.iter().copied().fold(f64::MAX, f64::min),
    );
    rows.push(
        json!({"bench": "snapshot", "row": "clones_mapped", "clones": n,
        "data_bytes": data, "one_pss": one.pss, "one_used": one.used, "clones_pss": all.pss,
        "clones_used": all.used, "clones_cached": all.cached, "clones_anon": all.anon,
        "clones_shmem": all.shmem, "ratio_pss": ratio, "ratio_used": used_ratio,
        "first_report_ms": firsts}),
    );
    Ok(())
}
