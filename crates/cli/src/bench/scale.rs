//! `ferry bench scale`: what a migration costs as the configured RAM grows and the memory the
//! guest uses does not. An idle built-in guest that wrote 256 MiB once (`rate=idle
//! prefill=1`) is migrated between two `ferry run` processes at 8, 64, 256 and 511 GiB (the
//! largest the built-in guest maps). Per size: total, setup (and the dirty log's start within
//! it), each pass, the longest step of precopy's control loop and the longest dirty sync, the
//! downtime, the migration threads' CPU on each side, each process's peak resident memory,
//! and how long the destination took to be ready. The reference is the smallest size in the
//! same run; the summary is the growth per added GiB.

use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ferry_migrate::MigrationStats;
use ferry_vmm::request::MigrationRequest;
use serde_json::json;

use super::process::{Migrated, STEP_LIMIT, Vmm, free_port, migrate_and_verify};

#[derive(Debug, Args)]
pub struct ScaleBenchArgs {
    /// Guest RAM sizes in GiB, smallest first (the first is the reference): `--sizes-gib 8
    /// 64` or `--sizes-gib 8,64`.
    #[arg(long, num_args = 1.., value_delimiter = ',', default_values_t = [8u64, 64, 256, ferry_vmm::limit::BUILTIN_GUEST_MAX_MEMORY >> 30])]
    sizes_gib: Vec<u64>,
    /// The guest's workload: what it touches, the same at every size.
    #[arg(long, default_value = "ws=256M rate=idle prefill=1 log-ms=0")]
    cmdline: String,
}

/// One size's figures.
struct Row {
    gib: u64,
    stats: MigrationStats,
    /// Peak resident memory of the source and destination processes, MiB.
    rss_mib: [f64; 2],
    /// From starting the destination to its API saying it waits.
    ready_ms: f64,
}

pub fn run(args: &ScaleBenchArgs) -> anyhow::Result<ExitCode> {
    println!(
        "{:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>7} {:>7} {:>8} {:>8} {:>8}",
        "GiB",
        "total ms",
        "setup",
        "log on",
        "pass 1",
        "passes",
        "max step",
        "max sync",
        "downtime",
        "CPU src",
        "CPU dst",
        "RSS src",
        "RSS dst",
        "dst rdy"
    );
    let mut rows = Vec::new();
    for &gib in &args.sizes_gib {
        let row = measure(gib, &args.cmdline)?;
        let s = &row.stats;
        let rest: f64 = s.passes.iter().skip(1).map(|p| p.duration_ms).sum();
        println!(
            "{:>6} {:>8.1} {:>8.1} {:>8.2} {:>8.1} {:>8.1} {:>9.2} {:>9.2} {:>8.1} {:>7.3} {:>7.3} {:>8.1} {:>8.1} {:>8.0}",
            gib,
            s.total_ms,
            s.setup_ms,
            s.dirty_start_ms,
            s.passes.first().map_or(0.0, |p| p.duration_ms),
            rest,
            s.max_step_ms,
            s.max_sync_ms,
            s.downtime.total_ms,
            s.cpu_seconds_source,
            s.cpu_seconds_destination,
            row.rss_mib[0],
            row.rss_mib[1],
            row.ready_ms
        );
        rows.push(row);
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last())
        && last.gib > first.gib
    {
        let per = |f: fn(&Row) -> f64| (f(last) - f(first)) / (last.gib - first.gib) as f64;
        let total = per(|r| r.stats.total_ms);
        let setup = per(|r| r.stats.setup_ms);
        let rss = [per(|r| r.rss_mib[0]), per(|r| r.rss_mib[1])];
        println!(
            "growth per added GiB: total {total:+.3} ms, setup {setup:+.3} ms, RSS {:+.3} MiB source, {:+.3} MiB destination; {} GiB took {:.2}x the {} GiB guest's time",
            rss[0],
            rss[1],
            last.gib,
            last.stats.total_ms / first.stats.total_ms.max(1e-6),
            first.gib
        );
        println!(
            "{}",
            json!({"bench": "scale_summary", "total_ms_per_gib": total, "setup_ms_per_gib": setup,
                "rss_mib_per_gib": {"source": rss[0], "destination": rss[1]},
                "largest_over_smallest": last.stats.total_ms / first.stats.total_ms.max(1e-6)})
        );
    }
    for r in &rows {
        println!(
            "{}",
            json!({"bench": "scale", "gib": r.gib, "total_ms": r.stats.total_ms,
                "setup_ms": r.stats.setup_ms, "dirty_start_ms": r.stats.dirty_start_ms,
                "passes_ms": r.stats.passes.iter().map(|p| p.duration_ms).collect::<Vec<_>>(),
                "max_step_ms": r.stats.max_step_ms, "max_sync_ms": r.stats.max_sync_ms,
                "downtime_ms": r.stats.downtime.total_ms,
                "cpu_seconds": {"source": r.stats.cpu_seconds_source,
                    "destination": r.stats.cpu_seconds_destination},
                "peak_rss_mib": {"source": r.rss_mib[0], "destination": r.rss_mib[1]},
                "destination_ready_ms": r.ready_ms})
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Boots the guest at `gib` GiB in one process, starts a destination in another, migrates,
/// checks the guest verifies there, and reads both processes' peak memory.
fn measure(gib: u64, cmdline: &str) -> anyhow::Result<Row> {
    let dir = tempfile::tempdir()?;
    let memory = format!("{gib}G");
    let to = format!("tcp:127.0.0.1:{}", free_port()?);
    let mut src = Vmm::spawn(
        "source",
        dir.path(),
        &[
            "--memory".into(),
            memory.clone(),
            "--cmdline".into(),
            cmdline.into(),
        ],
    )?;
    // The guest has written its working set once it verified it (prefill, then a pass).
    src.wait_for("the guest's first verify pass", "/vm", |s| {
        s["guest"]["verify_passes"].as_u64() >= Some(1)
    })?;
    let started = Instant::now();
    let mut dst = Vmm::spawn(
        "destination",
        dir.path(),
        &["--memory".into(), memory, "--incoming".into(), to.clone()],
    )?;
    dst.waiting()?;
    let ready_ms = started.elapsed().as_secs_f64() * 1e3;
    let body = MigrationRequest {
        timeout_ms: Some(STEP_LIMIT.as_millis() as u64),
        ..MigrationRequest::to(to)
    };
    let Migrated { stats, .. } = migrate_and_verify(&mut src, &mut dst, &body)?;
    let rss_mib = [src.peak_rss_kib()?, dst.peak_rss_kib()?].map(|k| k as f64 / 1024.0);
    Ok(Row {
        gib,
        stats,
        rss_mib,
        ready_ms,
    })
}
