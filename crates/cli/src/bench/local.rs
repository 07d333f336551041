//! `ferry bench local`: the local handover (`ferry migrate --local`) of a running, writing guest
//! between two `ferry run` processes on this host, at 1 and 64 vCPUs and at 8 and 511 GiB of
//! RAM, hop after hop, every hop verified clean. Per case: how long the handover took (the
//! request to the old process's API telling its end), the downtime the source computed, the
//! pause the guest saw (the gap between its last heartbeat in the old process and its first in
//! the new one), and the bytes sent. The reference, in the same run and between the same two
//! processes: the same guest handed over by copying it over the same kind of Unix socket
//! (`unix:` without `--local`). QEMU's cpr-transfer would be the peer a user compares with; it
//! needs QEMU 10, which the bench names when it is not the QEMU installed.

use std::process::{Command, ExitCode};

use anyhow::Context;
use clap::Args;
use ferry_vmm::request::{MigrationMode, MigrationRequest};
use serde_json::json;

use super::process::{HopPair, Migrated, PairSpec, STEP_LIMIT, Vmm, migrate_and_verify, quantile};

#[derive(Debug, Args)]
pub struct LocalBenchArgs {
    /// Cases as VCPUSxMEMORY, comma separated.
    #[arg(long, default_value = "1x8G,1x511G,64x8G")]
    cases: String,
    /// Local handovers per case, alternately from the first process to the second and back.
    #[arg(long, default_value_t = 10)]
    hops: u32,
    /// The guest's workload: it writes and verifies its working set throughout, and beats
    /// every millisecond so that its pause is seen to the millisecond.
    #[arg(
        long,
        default_value = "ws=1G pattern=random rate=200 heartbeat-ms=1 verify-ms=500 log-ms=0"
    )]
    cmdline: String,
    /// Copying handovers per case, the reference (0: none).
    #[arg(long, default_value_t = 1)]
    copies: u32,
}

/// One case: vCPUs and RAM.
#[derive(Clone, Copy, Debug)]
struct Case {
    vcpus: u8,
    memory: u64,
}

fn parse_cases(s: &str) -> anyhow::Result<Vec<Case>> {
    s.split(',')
        .map(|c| {
            let (v, m) = c
                .split_once('x')
                .with_context(|| format!("case {c}: write VCPUSxMEMORY, e.g. 64x8G"))?;
            Ok(Case {
                vcpus: v.parse().with_context(|| format!("case {c}: vCPUs"))?,
                memory: crate::sizes::parse_size(m).map_err(anyhow::Error::msg)?,
            })
        })
        .collect()
}

/// One handover's figures.
#[derive(Clone, Copy, Debug, Default)]
struct Hop {
    took_ms: f64,
    /// The engine's own account, from the session's start to Resumed.
    total_ms: f64,
    downtime_ms: f64,
    pause_ms: f64,
    bytes: u64,
    pages: u64,
}

impl Hop {
    fn of(m: &Migrated) -> Hop {
        Hop {
            took_ms: m.took.as_secs_f64() * 1e3,
            total_ms: m.stats.total_ms,
            downtime_ms: m.stats.downtime.total_ms,
            pause_ms: m.guest["migration_pause_ns"].as_u64().unwrap_or(0) as f64 / 1e6,
            bytes: m.stats.bytes_sent,
            pages: m.stats.pages_normal + m.stats.pages_zero,
        }
    }
}

/// The median, the 90th percentile and the largest of `f` over `hops`.
fn spread(hops: &[Hop], f: fn(&Hop) -> f64) -> [f64; 3] {
    let mut v: Vec<f64> = hops.iter().map(f).collect();
    [0.5, 0.9, 1.0].map(|q| quantile(&mut v, q))
}

/// `[p50, p90, max]` as the table shows it.
fn three(v: [f64; 3], decimals: usize) -> String {
    format!(
        "{:.*}/{:.*}/{:.*}",
        decimals, v[0], decimals, v[1], decimals, v[2]
    )
}

pub fn run(args: &LocalBenchArgs) -> anyhow::Result<ExitCode> {
    let cases = parse_cases(&args.cases)?;
    let heartbeat_ms = args
        .cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("heartbeat-ms="))
        .unwrap_or("10");
    println!(
        "local handover: {} hops per case of a guest running `{}`; the guest's pause is the gap between its heartbeats (every {heartbeat_ms} ms) across the handover",
        args.hops, args.cmdline
    );
    println!("QEMU cpr-transfer: {}", qemu_cpr());
    println!(
        "handover: the request to the old process's API telling the end (the engine's own count in brackets); figures p50/p90/max in ms"
    );
    println!(
        "{:<9} {:>5} {:>22} {:>18} {:>16} {:>16} {:>11} {:>7}",
        "case", "hops", "handover", "(engine)", "downtime", "guest pause", "bytes", "pages"
    );
    for case in cases {
        let dir = tempfile::tempdir()?;
        let spec = PairSpec {
            memory: case.memory,
            vcpus: case.vcpus,
            cmdline: &args.cmdline,
            unix: true,
        };
        let name = format!("{}x{}", case.vcpus, ferry_migrate::ram::Size(case.memory));
        let mut pair = HopPair::start_as(dir.path(), &spec)
            .with_context(|| format!("starting the two processes of {name}"))?;
        let before = [pair.first.usage()?, pair.second.usage()?];
        let local = hops(&mut pair, args.hops, MigrationMode::Local)
            .with_context(|| format!("{name}, local"))?;
        let after = [pair.first.usage()?, pair.second.usage()?];
        let copied = hops(&mut pair, args.copies, MigrationMode::Precopy)
            .with_context(|| format!("{name}, copied"))?;
        for (kind, hops) in [("local", &local), ("copied", &copied)] {
            if hops.is_empty() {
                continue;
            }
            let took = spread(hops, |h| h.took_ms);
            let total = spread(hops, |h| h.total_ms);
            let down = spread(hops, |h| h.downtime_ms);
            let pause = spread(hops, |h| h.pause_ms);
            let bytes = hops.iter().map(|h| h.bytes).max().unwrap_or(0);
            let pages = hops.iter().map(|h| h.pages).max().unwrap_or(0);
            println!(
                "{:<9} {:>5} {:>22} {:>18} {:>16} {:>16} {:>11} {:>7}",
                format!("{name}{}", if kind == "copied" { " cp" } else { "" }),
                hops.len(),
                three(took, 1),
                format!("({})", three(total, 1)),
                three(down, 2),
                three(pause, 2),
                bytes,
                pages
            );
            let json3 = |v: [f64; 3]| json!({"p50": v[0], "p90": v[1], "max": v[2]});
            println!(
                "{}",
                json!({"bench": "local", "case": name, "vcpus": case.vcpus,
                    "memory": case.memory, "handover": kind, "hops": hops.len(),
                    "handover_ms": json3(took), "engine_total_ms": json3(total),
                    "downtime_ms": json3(down), "guest_pause_ms": json3(pause),
                    "heartbeat_ms": heartbeat_ms,
                    "bytes_sent_max": bytes, "pages_sent_max": pages})
            );
        }
        let [(fa0, ra0), (fb0, rb0)] = before;
        let [(fa1, ra1), (fb1, rb1)] = after;
        println!(
            "{}",
            json!({"bench": "local_processes", "case": name,
                "fds": [[fa0, fa1], [fb0, fb1]],
                "rss_kib": [[ra0, ra1], [rb0, rb1]]})
        );
    }
    println!(
        "goals: guest pause at most 2 ms at 1 vCPU and 15 ms at 64, the same at 8 and 511 GiB; handover at most 20 ms at 1 vCPU; no page sent"
    );
    Ok(ExitCode::SUCCESS)
}

/// `n` handovers between the pair's processes, alternately each way (the guest ends where it
/// started when `n` is even), each a migration of `mode` (local, or copying).
fn hops(pair: &mut HopPair, n: u32, mode: MigrationMode) -> anyhow::Result<Vec<Hop>> {
    let mut out = Vec::new();
    for i in 0..n {
        let (src, dst, to): (&mut Vmm, &mut Vmm, &str) = match pair.first_has_guest {
            true => (&mut pair.first, &mut pair.second, &pair.at_b),
            false => (&mut pair.second, &mut pair.first, &pair.at_a),
        };
        let body = MigrationRequest {
            timeout_ms: Some(STEP_LIMIT.as_millis() as u64),
            mode: mode.clone(),
            ..MigrationRequest::to(to)
        };
        let m = migrate_and_verify(src, dst, &body).with_context(|| format!("hop {}", i + 1))?;
        src.waiting()?;
        pair.first_has_guest = !pair.first_has_guest;
        out.push(Hop::of(&m));
    }
    Ok(out)
}

/// Whether the installed QEMU has cpr-transfer (QEMU 10 and later), in words.
fn qemu_cpr() -> String {
    let Ok(out) = Command::new("qemu-system-x86_64").arg("--version").output() else {
        return "no QEMU installed; no reference in this run".into();
    };
    let version = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    let major: u32 = version
        .split_whitespace()
        .find_map(|w| w.split('.').next().and_then(|m| m.parse().ok()))
        .unwrap_or(0);
    match major {
        m if m >= 10 => format!("{version}: has it, not measured by this bench yet"),
        _ => format!("{version} has none (it came with QEMU 10); no QEMU reference in this run"),
    }
}
