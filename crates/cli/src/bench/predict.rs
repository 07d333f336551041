//! `ferry bench predict`: how well the prediction (`ferry_migrate::predict`) foretells a
//! migration. A matrix of small migrations (idle, filled, dirtying at several rates, flat
//! out, over loopback and across a capped rate), each with the default policy and with
//! postcopy allowed and the prediction choosing (`--postcopy-auto`), run `--runs` times.
//! Each row sets the first prediction (the end of pass 1, or the first pass with a measured
//! rate) and the last one before the way was taken against what the migration took: the
//! way, the total time and the downtime. Then the medians and 90th percentiles of the
//! errors, and for the capped rows the time against their bytes on the wire at the cap.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use ferry_migrate::MigrationStats;
use ferry_migrate::predict::Prediction;
use serde_json::json;

use super::precopy::{Finish, GUEST, Scenario, migrate_once};

const MIB: u64 = 1 << 20;

#[derive(Debug, Args)]
pub struct PredictBenchArgs {
    /// Runs of every scenario under each policy (13 scenarios x 2 policies x 4 = 104).
    #[arg(long, default_value_t = 4)]
    runs: usize,
    /// Only the first N scenarios (for a quick look).
    #[arg(long)]
    only: Option<usize>,
    /// Instead of the matrix, issue 55's case: an 8 GiB guest writing 1 GiB flat out, also
    /// switched to postcopy after pass 1 (with the default, the best way in hindsight).
    #[arg(long)]
    large: bool,
}

/// One cell of the matrix: a guest, its RAM, and the cap on the link (`--max-bandwidth`).
struct Case {
    name: &'static str,
    memory: u64,
    cmdline: &'static str,
    cap_mb_s: Option<u64>,
}

/// The matrix's guests: at rest, filled with data, dirtying a working set at rising rates up
/// to flat out, then some of them across a capped rate.
const CASES: &[Case] = &[
    case("idle", 512, "ws=64M rate=idle", None),
    case("filled 384M", 512, "ws=384M fill=random rate=idle", None),
    case(
        "128M @ 25 MB/s",
        512,
        "ws=128M pattern=random rate=25",
        None,
    ),
    case(
        "128M @ 100 MB/s",
        512,
        "ws=128M pattern=random rate=100",
        None,
    ),
    case(
        "128M @ 400 MB/s",
        512,
        "ws=128M pattern=random rate=400",
        None,
    ),
    case("128M flat out", 512, "ws=128M rate=max", None),
    case("256M seq @ 200 MB/s", 1024, "ws=256M rate=200", None),
    case("idle, 200 MB/s cap", 512, "ws=64M rate=idle", Some(200)),
    case(
        "filled, 200 MB/s cap",
        512,
        "ws=256M fill=random rate=idle",
        Some(200),
    ),
    case(
        "128M @ 50, 200 cap",
        512,
        "ws=128M pattern=random rate=50",
        Some(200),
    ),
    case("128M flat, 200 cap", 512, "ws=128M rate=max", Some(200)),
    case(
        "filled, 100 MB/s cap",
        256,
        "ws=128M fill=random rate=idle",
        Some(100),
    ),
    case(
        "64M @ 25, 100 cap",
        256,
        "ws=64M pattern=random rate=25",
        Some(100),
    ),
];

/// `--large`: issue 55's guest writing 1 GiB flat out in 8 GiB.
const LARGE: &[Case] = &[case("1G flat out in 8G", 8192, "ws=1G rate=max", None)];

const fn case(name: &'static str, mib: u64, cmdline: &'static str, cap: Option<u64>) -> Case {
    Case {
        name,
        memory: mib * MIB,
        cmdline,
        cap_mb_s: cap,
    }
}

/// What one migration's predictions scored.
#[derive(Debug, Default)]
struct Score {
    /// |predicted / actual - 1| of the total time, first and last prediction.
    total_err: [Option<f64>; 2],
    /// |predicted - actual| of the downtime, ms.
    downtime_err_ms: [Option<f64>; 2],
    /// The last prediction's chosen way was the way taken.
    way_right: bool,
    /// Total time over the bytes on the wire at the cap (capped rows).
    cap_ratio: Option<f64>,
}

pub fn run(args: &PredictBenchArgs) -> anyhow::Result<ExitCode> {
    println!(
        "{:<22} {:<9} {:>3} | {:<13} {:>8} {:>7} | {:<13} {:>8} {:>7} | {:>7} {:>8} | {:>7} {:>8} | {:>5}",
        "scenario",
        "policy",
        "run",
        "first: way",
        "total",
        "down",
        "actual: way",
        "total",
        "down",
        "1st err",
        "1st dt",
        "lst err",
        "lst dt",
        "cap x"
    );
    let mut scores = Vec::new();
    let (cases, policies): (&[Case], &[(Finish, &str)]) = match args.large {
        false => (CASES, &POLICIES[..2]),
        true => (LARGE, &POLICIES),
    };
    for c in cases.iter().take(args.only.unwrap_or(usize::MAX)) {
        for &(finish, policy) in policies {
            for run in 1..=args.runs {
                let s = scenario(c, finish);
                let (stats, _) = migrate_once(&s)
                    .with_context(|| format!("'{}' ({policy}, run {run})", c.name))?;
                scores.push(row(c, policy, run, &stats));
            }
        }
    }
    summary(&scores);
    Ok(ExitCode::SUCCESS)
}

/// The policies a case runs under: the default, the prediction choosing, and (`--large`)
/// postcopy after pass 1 as `ferry bench postcopy` runs it.
const POLICIES: [(Finish, &str); 3] = [
    (Finish::Careful, "default"),
    (Finish::PostcopyAuto, "auto"),
    (Finish::Forced, "after-1"),
];

fn scenario(c: &Case, finish: Finish) -> Scenario {
    Scenario {
        finish,
        postcopy: matches!(finish, Finish::PostcopyAuto | Finish::Forced).then_some(true),
        max_bandwidth: c.cap_mb_s.map(|mb| mb * 1_000_000),
        ..Scenario::new(
            c.name,
            c.memory,
            &format!("{} {GUEST}", c.cmdline),
            ferry_migrate::source::DEFAULT_CHANNELS,
        )
    }
}

/// Prints one migration's row and its JSON line, and scores it.
fn row(c: &Case, policy: &str, run: usize, s: &MigrationStats) -> Score {
    let first = s.passes.iter().find_map(|p| p.predicted);
    let last = s.last_prediction().copied();
    let actual_down = s.downtime.total_ms;
    let total_err = |p: Option<Prediction>| {
        let t = p?.forecast().total_ms?;
        Some((t / s.total_ms - 1.0).abs())
    };
    let down_err = |p: Option<Prediction>| Some((p?.forecast().downtime_ms? - actual_down).abs());
    let cap_ratio = c
        .cap_mb_s
        .map(|mb| s.total_ms / (s.bytes_sent as f64 / (mb as f64 * 1e3)));
    let score = Score {
        total_err: [total_err(first), total_err(last)],
        downtime_err_ms: [down_err(first), down_err(last)],
        way_right: last.is_some_and(|p| p.chosen == s.way_taken()),
        cap_ratio,
    };
    let cell = |v: Option<f64>, f: fn(f64) -> String| v.map_or("-".to_string(), f);
    let pct = |v: f64| format!("{:.0}%", v * 100.0);
    let msf = |v: f64| format!("{v:.1}");
    let way = |p: Option<Prediction>| p.map_or("-", |p| p.chosen.name());
    let f = first.map(|p| p.forecast());
    println!(
        "{:<22} {:<9} {:>3} | {:<13} {:>8} {:>7} | {:<13} {:>8.0} {:>7.1} | {:>7} {:>8} | {:>7} {:>8} | {:>5}",
        c.name,
        policy,
        run,
        way(first),
        cell(f.and_then(|f| f.total_ms), |v| format!("{v:.0}")),
        cell(f.and_then(|f| f.downtime_ms), msf),
        s.way_taken().name(),
        s.total_ms,
        actual_down,
        cell(score.total_err[0], pct),
        cell(score.downtime_err_ms[0], msf),
        cell(score.total_err[1], pct),
        cell(score.downtime_err_ms[1], msf),
        cell(cap_ratio, |v| format!("{v:.2}")),
    );
    println!(
        "{}",
        json!({
            "bench": "predict", "scenario": c.name, "policy": policy, "run": run,
            "cap_mb_s": c.cap_mb_s, "first": first, "last": last,
            "actual": {"way": s.way_taken(), "total_ms": s.total_ms, "downtime_ms": actual_down,
                       "bytes_sent": s.bytes_sent, "passes": s.passes.len(),
                       "postcopy_ms": s.postcopy.as_ref().map(|p| p.duration_ms),
                       "final_pages_ms": s.downtime.final_pages_ms, "setup_ms": s.setup_ms,
                       "phases": phase_starts(s)},
            "passes": s.passes.iter().map(|p| json!([p.pass, p.bytes, p.duration_ms, p.dirty_rate_pages_per_s])).collect::<Vec<_>>(),
            "total_err": score.total_err, "downtime_err_ms": score.downtime_err_ms,
            "way_right": score.way_right, "cap_ratio": cap_ratio,
        })
    );
    score
}

/// When each phase began, ms from the start (the timeline's first sample in it).
fn phase_starts(s: &MigrationStats) -> Vec<(ferry_migrate::Phase, f64)> {
    let mut out: Vec<(ferry_migrate::Phase, f64)> = Vec::new();
    for t in &s.timeline {
        if out.last().is_none_or(|l| l.0 != t.phase) {
            out.push((t.phase, t.t_ms));
        }
    }
    out
}

/// The value at quantile `q` of `v` (nearest rank), `None` when empty.
fn quantile(mut v: Vec<f64>, q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

fn summary(scores: &[Score]) {
    let n = scores.len();
    let pick = |f: &dyn Fn(&Score) -> Option<f64>| scores.iter().filter_map(f).collect::<Vec<_>>();
    let fmt = |v: Option<f64>, scale: f64, unit: &str| {
        v.map_or("-".into(), |v| format!("{:.1}{unit}", v * scale))
    };
    println!();
    println!(
        "{n} migrations; goals: total within 15% (median) and 30% (p90), downtime within 20 ms (p90)"
    );
    let mut out = json!({"bench": "predict", "summary": true, "migrations": n});
    for (i, which) in ["first", "last"].iter().enumerate() {
        let totals = pick(&|s| s.total_err[i]);
        let downs = pick(&|s| s.downtime_err_ms[i]);
        let (med, p90, dp90) = (
            quantile(totals.clone(), 0.5),
            quantile(totals.clone(), 0.9),
            quantile(downs.clone(), 0.9),
        );
        println!(
            "{which:<5} prediction ({} rows with one): total error median {}, p90 {}; downtime error median {}, p90 {}",
            totals.len(),
            fmt(med, 100.0, "%"),
            fmt(p90, 100.0, "%"),
            fmt(quantile(downs.clone(), 0.5), 1.0, " ms"),
            fmt(dp90, 1.0, " ms"),
        );
        out[which] = json!({"rows": totals.len(), "total_err_median": med, "total_err_p90": p90,
                            "downtime_err_ms_median": quantile(downs, 0.5), "downtime_err_ms_p90": dp90});
    }
    let right = scores.iter().filter(|s| s.way_right).count();
    let caps = pick(&|s| s.cap_ratio);
    println!(
        "the last prediction's way was the way taken in {right} of {n}; capped rows: time / (bytes at the cap) median {}, max {} (goal <= 1.2)",
        fmt(quantile(caps.clone(), 0.5), 1.0, ""),
        fmt(caps.iter().copied().reduce(f64::max), 1.0, ""),
    );
    out["way_right"] = json!(right);
    out["cap_ratio_max"] = json!(caps.iter().copied().reduce(f64::max));
    println!("{out}");
}
