//! `ferry bench channels`: the data path of issue 4, each figure against a reference from the
//! same run.
//!
//! 1. Zero scan per core (SSE2, AVX2, AVX-512) on hot (cache-resident) and cold (1 GiB, beyond
//!    cache) zero pages, against a plain read of the same cold memory (the bandwidth a scan
//!    cannot beat). Also the destination's two ways to make a stale page zero: clearing it and
//!    punching it out of the memfd, per page and per 16-page run.
//! 2. A 4 GiB guest full of random data migrated over 1, 2 and 4 channels, against raw
//!    loopback TCP over as many streams.
//! 3. A guest whose 8 GiB are all touched but zero (bounded by the scan, not the network).
//! 4. A 64 GiB guest with 256 MiB touched (holes cost nothing).
//! 5. The 4 GiB migrations of 2. again over mutual TLS, against the plain runs.
//!
//! CPU seconds per GiB of guest RAM are reported for each side.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ferry_migrate::zero::{Isa, is_zero_with};
use serde_json::json;

use super::precopy::{Scenario, migrate_once};

#[derive(Debug, Args)]
pub struct ChannelsBenchArgs {
    /// Only the zero-scan measurements (no VMs).
    #[arg(long)]
    scan_only: bool,
    /// Only the migration scenarios whose name contains this.
    #[arg(long)]
    scenario: Option<String>,
    /// Draw each migration scenario into `DIR/<scenario>.svg` (see `ferry report`).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
}

const GIB: u64 = 1 << 30;
const PAGE: usize = 4096;

pub fn run(args: &ChannelsBenchArgs) -> anyhow::Result<ExitCode> {
    let mut rows = scan_rows();
    rows.extend(zeroing_rows()?);
    if !args.scan_only {
        rows.extend(migration_rows(
            args.scenario.as_deref(),
            args.report.as_deref(),
        )?);
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// GB/s of `f` over `bytes`, repeated for at least 300 ms.
fn rate(bytes: usize, mut f: impl FnMut() -> bool) -> f64 {
    let start = Instant::now();
    let mut done = 0usize;
    while start.elapsed() < Duration::from_millis(300) {
        std::hint::black_box(f());
        done += bytes;
    }
    done as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn scan_rows() -> Vec<serde_json::Value> {
    // Every page is zero but for its last 8 bytes, which hold the page's index: the scan reads
    // each page in full (its worst case, and a zero page's cost), and no two pages are equal,
    // so a host that merges identical pages cannot turn "cold" memory into one cached page.
    let unique_tail = |pages: usize| {
        let mut v = vec![0u8; pages * PAGE];
        for (i, p) in v.chunks_exact_mut(PAGE).enumerate() {
            p[PAGE - 8..].copy_from_slice(&(i as u64 + 1).to_le_bytes());
        }
        v
    };
    let hot = unique_tail(64);
    let cold = unique_tail((GIB as usize) / PAGE);
    let read_bw = rate(cold.len(), || cold.iter().fold(0u8, |a, &b| a | b) != 0);
    println!(
        "zero scan of pages with a non-zero last word, one core (GB/s); plain read of the same cold buffer: {read_bw:.1} GB/s"
    );
    println!(
        "{:<8} {:>10} {:>10} {:>14}",
        "isa", "hot", "cold", "cold / read"
    );
    let best = Isa::detect();
    let mut rows = Vec::new();
    for isa in [Isa::Sse2, Isa::Avx2, Isa::Avx512] {
        if (isa == Isa::Avx512 && best != Isa::Avx512) || (isa == Isa::Avx2 && best == Isa::Sse2) {
            continue;
        }
        let scan = |buf: &[u8]| {
            buf.chunks_exact(PAGE)
                .filter(|p| is_zero_with(isa, p))
                .count()
                == 0
        };
        let h = rate(hot.len(), || scan(&hot));
        let c = rate(cold.len(), || scan(&cold));
        println!(
            "{:<8} {:>10.1} {:>10.1} {:>14.2}",
            format!("{isa:?}"),
            h,
            c,
            c / read_bw
        );
        rows.push(
            json!({"bench": "zero_scan", "isa": format!("{isa:?}"), "hot_gb_s": h, "cold_gb_s": c,
            "read_gb_s": read_bw, "cold_ratio": c / read_bw}),
        );
    }
    rows
}

/// Making stale pages zero on a destination: clearing them with stores against punching them
/// out of the memfd, per page and per 16-page run (the measurement behind `Ram::zero_run`).
fn zeroing_rows() -> anyhow::Result<Vec<serde_json::Value>> {
    let pages = 16 * 1024u64;
    let ram = ferry_vmm::memory::GuestRam::new(128 << 20)?;
    let base = 32u64 << 20;
    let fill = vec![0x5au8; (pages as usize) * PAGE];
    let mut results = Vec::new();
    for run in [1u64, 16] {
        let zeros = vec![0u8; run as usize * PAGE];
        ram.write(base, &fill)?;
        let start = Instant::now();
        for i in (0..pages).step_by(run as usize) {
            ram.write(base + i * PAGE as u64, &zeros)?;
        }
        let clear = start.elapsed().as_secs_f64() * 1e6 / pages as f64;
        ram.write(base, &fill)?;
        let start = Instant::now();
        for i in (0..pages).step_by(run as usize) {
            ram.punch_hole(base + i * PAGE as u64, run * PAGE as u64)?;
        }
        let punch = start.elapsed().as_secs_f64() * 1e6 / pages as f64;
        println!(
            "making stale pages zero, runs of {run:>2}: clear {clear:.3} us/page, punch {punch:.3} us/page"
        );
        results.push(json!({"bench": "zeroing", "run_pages": run, "clear_us_per_page": clear, "punch_us_per_page": punch}));
    }
    Ok(results)
}

/// The built-in guest idling after its prefill, with heartbeats every 2 ms (the resolution of
/// the pause it reports).
const IDLE_GUEST: &str = "prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2 rate=1";

/// A guest of `memory` bytes holding 4 GiB of random (incompressible, never zero) data and
/// otherwise idle, migrated over `channels` channels.
pub(super) fn random_data(name: &str, memory: u64, channels: u16) -> Scenario {
    Scenario::new(
        name,
        memory,
        &format!("ws=4G fill=random {IDLE_GUEST}"),
        channels,
    )
}

fn migration_rows(
    only: Option<&str>,
    report: Option<&Path>,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let guest = IDLE_GUEST;
    let mut scenarios: Vec<(Scenario, u16, Option<u16>)> = Vec::new();
    for channels in [1, 2, 4] {
        scenarios.push((
            random_data(&format!("4G random data, {channels} ch"), 5 * GIB, channels),
            channels,
            Some(channels),
        ));
    }
    // The same over mutual TLS, and with page checksums, against the plain rows above and the
    // same raw TCP; and both at once at 2 channels (does TLS leave checksums anything to do?).
    let variants = [
        (true, false, "TLS", [1, 2, 4].as_slice()),
        (false, true, "page checksums", &[1, 2, 4]),
        (true, true, "TLS + page checksums", &[2]),
    ];
    for (tls, checksum_pages, label, counts) in variants {
        for &channels in counts {
            scenarios.push((
                Scenario {
                    tls,
                    checksum_pages,
                    ..random_data(
                        &format!("4G random data, {channels} ch, {label}"),
                        5 * GIB,
                        channels,
                    )
                },
                channels,
                Some(channels),
            ));
        }
    }
    scenarios.push((
        Scenario::new(
            "8G touched, all zero",
            9 * GIB,
            &format!("ws=8G zero=100 {guest}"),
            2,
        ),
        2,
        None,
    ));
    scenarios.push((
        Scenario::new(
            "64G, 256M touched",
            64 * GIB,
            &format!("ws=256M {guest}"),
            2,
        ),
        2,
        None,
    ));
    println!(
        "{:<24} {:>9} {:>8} {:>9} {:>8} {:>9} {:>6} {:>11} {:>11}",
        "scenario",
        "total ms",
        "MB sent",
        "MB/s",
        "raw MB/s",
        "ratio",
        "down",
        "src s/GiB",
        "dst s/GiB"
    );
    let mut rows = Vec::new();
    for (s, channels, raw_streams) in scenarios {
        if only.is_some_and(|o| !s.name.contains(o)) {
            continue;
        }
        let (stats, _) = migrate_once(&s).with_context(|| format!("scenario '{}'", s.name))?;
        if let Some(dir) = report {
            crate::report::write_scenario_svg(dir, &s.name, &stats)?;
        }
        let sending_ms: f64 = stats.passes.iter().map(|p| p.duration_ms).sum();
        let mb_s = stats.bytes_sent as f64 / 1e3 / sending_ms.max(1e-3);
        let raw = match raw_streams {
            Some(n) => super::raw_tcp::raw_tcp_streams(stats.bytes_sent, n)? / 1e6,
            None => f64::NAN,
        };
        let gib = s.memory as f64 / GIB as f64;
        println!(
            "{:<24} {:>9.0} {:>8.0} {:>9.0} {:>8.0} {:>9.2} {:>6.1} {:>11.3} {:>11.3}",
            s.name,
            stats.total_ms,
            stats.bytes_sent as f64 / 1e6,
            mb_s,
            raw,
            mb_s / raw,
            stats.downtime.total_ms,
            stats.cpu_seconds_source / gib,
            stats.cpu_seconds_destination / gib
        );
        rows.push(json!({"bench": "channels", "scenario": s.name, "channels": channels, "tls": s.tls,
            "checksum_pages": s.checksum_pages, "total_ms": stats.total_ms,
            "bytes_sent": stats.bytes_sent, "data_mb_s": mb_s, "raw_tcp_mb_s": raw, "ratio": mb_s / raw,
            "downtime_ms": stats.downtime.total_ms, "cpu_s_per_gib_source": stats.cpu_seconds_source / gib,
            "cpu_s_per_gib_destination": stats.cpu_seconds_destination / gib, "pages_zero": stats.pages_zero,
                        "pages_skipped_holes": stats.pages_skipped_holes, "dirty_start_ms": stats.dirty_start_ms,
            "passes": stats.passes}));
    }
    for (label, tls, checksum_pages, base_tls) in [
        ("TLS", true, false, false),
        ("page checksums", false, true, false),
        ("page checksums under TLS", true, true, true),
    ] {
        cost(&rows, label, (tls, checksum_pages), base_tls);
    }
    Ok(rows)
}

/// Prints what a feature costs at each channel count that ran both ways: throughput as a share
/// of the run without it, and CPU per GiB on each side against it. `with` is the rows' (tls,
/// checksum_pages); the reference row has no page checksums and TLS as `base_tls`.
fn cost(rows: &[serde_json::Value], label: &str, with: (bool, bool), base_tls: bool) {
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let is = |r: &serde_json::Value, tls: bool, pages: bool| {
        r["tls"] == tls && r["checksum_pages"] == pages && r["raw_tcp_mb_s"].is_number()
    };
    for tls in rows.iter().filter(|r| is(r, with.0, with.1)) {
        let Some(plain) = rows
            .iter()
            .find(|r| is(r, base_tls, false) && r["channels"] == tls["channels"])
        else {
            continue;
        };
        println!(
            "{label} cost, {} ch: {:.0} MB/s against {:.0} without ({:.0}%); CPU s/GiB source {:.3} against {:.3} ({:+.0}%), destination {:.3} against {:.3} ({:+.0}%)",
            tls["channels"],
            f(tls, "data_mb_s"),
            f(plain, "data_mb_s"),
            100.0 * f(tls, "data_mb_s") / f(plain, "data_mb_s"),
            f(tls, "cpu_s_per_gib_source"),
            f(plain, "cpu_s_per_gib_source"),
            100.0 * (f(tls, "cpu_s_per_gib_source") / f(plain, "cpu_s_per_gib_source") - 1.0),
            f(tls, "cpu_s_per_gib_destination"),
            f(plain, "cpu_s_per_gib_destination"),
            100.0
                * (f(tls, "cpu_s_per_gib_destination") / f(plain, "cpu_s_per_gib_destination")
                    - 1.0),
        );
    }
}
