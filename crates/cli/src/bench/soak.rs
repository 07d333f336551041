//! `ferry bench soak`: one dirtying guest migrated back and forth between two VMM processes
//! (`ferry run --then-incoming`), round trip after round trip, checking the guest's verify
//! after every hop. Per hop: the migration's time and downtime and the pause the guest saw;
//! per process, sampled after every round trip (the same moment of the cycle each time: the
//! guest back in the first process, the second waiting): open file descriptors and resident
//! memory. The reference is the run's own first round trip: what a leak would grow from.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use ferry_migrate::source::Preempt;
use ferry_vmm::request::{MigrationMode, MigrationRequest, PostcopyRequest};
use serde_json::json;

use super::plane::Watch;
use super::process::{HopPair, Migrated, PairSpec, STEP_LIMIT, Vmm, migrate_and_verify, quantile};

#[derive(Debug, Args)]
pub struct SoakBenchArgs {
    /// Round trips: first process to second and back.
    #[arg(long, default_value_t = 1000)]
    round_trips: u32,
    /// Which migrations: precopy, postcopy (after one precopy pass, with the preempt
    /// connection), or both, alternating round trips.
    #[arg(long, value_enum, default_value = "both")]
    mode: SoakMode,
    /// Guest RAM of the VM.
    #[arg(long, default_value = "256M", value_parser = crate::sizes::parse_size)]
    memory: u64,
    /// The guest's workload; it dirties and reads back its working set all along.
    #[arg(
        long,
        default_value = "ws=64M pattern=random rate=20 read=20 verify-ms=50 log-ms=0"
    )]
    cmdline: String,
    /// A line per hop (otherwise one per twentieth of the run).
    #[arg(long)]
    every_hop: bool,
    /// Local handovers (`ferry migrate --local`) between the two processes over Unix sockets:
    /// guest RAM's memfd goes back and forth, no page is copied (with --mode precopy only).
    #[arg(long)]
    local: bool,
    /// Drive each hop as a control plane does: `PUT /migration`, then wait on `GET /events` on
    /// both processes for the source's end and the destination's completion (never polling
    /// `GET /migration`), check the completion's job statistics, and time how late the
    /// events' answers came (`bench/plane.rs`).
    #[arg(long)]
    follow_events: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SoakMode {
    Precopy,
    Postcopy,
    Both,
}

/// One hop's figures.
#[derive(Debug)]
struct Hop {
    postcopy: bool,
    total_ms: f64,
    downtime_ms: f64,
    guest_pause_ms: f64,
    /// The guest's own counts after the hop, since it booted.
    verify_passes: u64,
    verify_failures: u64,
    /// With `--follow-events`: how late the source's end and the destination's completion
    /// came after they were logged, ms.
    event_lags_ms: Option<Vec<f64>>,
}

pub fn run(args: &SoakBenchArgs) -> anyhow::Result<ExitCode> {
    if args.local && args.mode != SoakMode::Precopy {
        anyhow::bail!("a local handover has no postcopy; give --mode precopy with --local");
    }
    let dir = tempfile::tempdir()?;
    let spec = PairSpec {
        memory: args.memory,
        vcpus: 1,
        cmdline: &args.cmdline,
        unix: args.local,
    };
    let HopPair {
        first: mut a,
        second: mut b,
        at_a,
        at_b,
        ..
    } = HopPair::start_as(dir.path(), &spec)?;
    println!(
        "soak: {} round trips of a {} MiB guest ({}), {:?}{}",
        args.round_trips,
        args.memory >> 20,
        args.cmdline,
        args.mode,
        if args.local { ", local handovers" } else { "" }
    );
    // One watcher per process for the whole run, as a control plane keeps one.
    let mut watches = match args.follow_events {
        true => Some([Watch::start(&a)?, Watch::start(&b)?]),
        false => None,
    };
    let mut hops = Vec::new();
    let mut samples: Vec<[(usize, u64); 2]> = Vec::new();
    let started = Instant::now();
    let every = (args.round_trips / 20).max(1);
    for trip in 0..args.round_trips {
        let postcopy = match args.mode {
            SoakMode::Precopy => false,
            SoakMode::Postcopy => true,
            SoakMode::Both => trip % 2 == 1,
        };
        for leg in 0..2 {
            let (src, dst, to) = if leg == 0 {
                (&mut a, &mut b, &at_b)
            } else {
                (&mut b, &mut a, &at_a)
            };
            // `--local` comes only with `--mode precopy` (refused above otherwise).
            let mode = match (postcopy, args.local) {
                (true, _) => MigrationMode::Postcopy(PostcopyRequest {
                    after_passes: Some(1),
                    preempt: Preempt::Urgent,
                    ..PostcopyRequest::default()
                }),
                (false, true) => MigrationMode::Local,
                (false, false) => MigrationMode::Precopy,
            };
            let watch = watches.as_mut().map(|[wa, wb]| match leg {
                0 => (wa, wb),
                _ => (wb, wa),
            });
            let hop = hop(src, dst, to, mode, watch).with_context(|| {
                format!("round trip {}, {} to {}", trip + 1, src.name, dst.name)
            })?;
            if args.every_hop {
                println!(
                    "{}",
                    json!({"bench": "soak_hop", "round_trip": trip + 1, "from": src.name,
                        "postcopy": postcopy, "total_ms": hop.total_ms,
                        "downtime_ms": hop.downtime_ms, "guest_pause_ms": hop.guest_pause_ms})
                );
            }
            hops.push(hop);
        }
        samples.push([a.usage()?, b.usage()?]);
        if (trip + 1) % every == 0 || trip + 1 == args.round_trips {
            let [(fa, ra), (fb, rb)] = samples[samples.len() - 1];
            eprintln!(
                "soak: {}/{} round trips in {:.0} s; fds {fa}/{fb}, RSS {}/{} MiB",
                trip + 1,
                args.round_trips,
                started.elapsed().as_secs_f64(),
                ra >> 10,
                rb >> 10
            );
        }
    }
    report(&hops, &samples, started.elapsed(), args.local);
    Ok(ExitCode::SUCCESS)
}

/// Migrates the guest from `src` to `dst` (listening on `to`), checks that it verifies clean
/// there, and waits for `src` to listen again.
/// With `watch` (the watchers of `src` and `dst`), followed on the events as a control plane
/// does (`plane.rs`).
fn hop(
    src: &mut Vmm,
    dst: &mut Vmm,
    to: &str,
    mode: MigrationMode,
    watch: Option<(&mut Watch, &mut Watch)>,
) -> anyhow::Result<Hop> {
    let postcopy = mode.postcopy().is_some();
    let body = MigrationRequest {
        timeout_ms: Some(STEP_LIMIT.as_millis() as u64),
        mode,
        ..MigrationRequest::to(to)
    };
    let (total_ms, downtime_ms, guest, event_lags_ms) = match watch {
        Some((ours, theirs)) => {
            let f = super::plane::hop((src, ours), (dst, theirs), &body)?;
            (f.total_ms, f.downtime_ms, f.guest, Some(f.event_lags_ms))
        }
        None => {
            let Migrated { stats, guest, .. } = migrate_and_verify(src, dst, &body)?;
            (stats.total_ms, stats.downtime.total_ms, guest, None)
        }
    };
    src.waiting()?;
    Ok(Hop {
        postcopy,
        total_ms,
        downtime_ms,
        guest_pause_ms: guest["migration_pause_ns"].as_u64().unwrap_or(0) as f64 / 1e6,
        verify_passes: guest["verify_passes"].as_u64().unwrap_or(0),
        verify_failures: guest["verify_failures"].as_u64().unwrap_or(0),
        event_lags_ms,
    })
}

fn report(hops: &[Hop], samples: &[[(usize, u64); 2]], took: Duration, local: bool) {
    println!(
        "{:<9} {:>5} {:>28} {:>28} {:>28}",
        "hops",
        "n",
        "total ms p50/p99/max",
        "downtime ms p50/p99/max",
        "guest pause ms p50/p99/max"
    );
    let first = if local { "local" } else { "precopy" };
    for (name, postcopy) in [(first, false), ("postcopy", true)] {
        let of = |f: fn(&Hop) -> f64| -> Vec<f64> {
            hops.iter()
                .filter(|h| h.postcopy == postcopy)
                .map(f)
                .collect()
        };
        let (mut total, mut down, mut pause) = (
            of(|h| h.total_ms),
            of(|h| h.downtime_ms),
            of(|h| h.guest_pause_ms),
        );
        if total.is_empty() {
            continue;
        }
        let three = |v: &mut Vec<f64>| {
            let (p50, p99, max) = (quantile(v, 0.5), quantile(v, 0.99), quantile(v, 1.0));
            (
                format!("{p50:.1}/{p99:.1}/{max:.1}"),
                json!({"p50": p50, "p99": p99, "max": max}),
            )
        };
        let (t, tj) = three(&mut total);
        let (d, dj) = three(&mut down);
        let (p, pj) = three(&mut pause);
        println!("{name:<9} {:>5} {t:>28} {d:>28} {p:>28}", total.len());
        println!(
            "{}",
            json!({"bench": "soak_hops", "mode": name, "hops": total.len(),
                "total_ms": tj, "downtime_ms": dj, "guest_pause_ms": pj})
        );
    }
    println!(
        "{:<9} {:>14} {:>8} {:>22} {:>14}",
        "process", "fds first/last", "fds max", "RSS MiB first/mid/last", "RSS MiB max"
    );
    for (i, name) in ["first", "second"].into_iter().enumerate() {
        let fds: Vec<usize> = samples.iter().map(|s| s[i].0).collect();
        let rss: Vec<u64> = samples.iter().map(|s| s[i].1).collect();
        let (Some(&f0), Some(&f1), Some(&r0), Some(&rmid), Some(&r1)) = (
            fds.first(),
            fds.last(),
            rss.first(),
            rss.get(rss.len() / 2),
            rss.last(),
        ) else {
            continue;
        };
        let (fmax, rmax) = (
            fds.iter().copied().max().unwrap_or(0),
            rss.iter().copied().max().unwrap_or(0),
        );
        let mib = |kib: u64| kib as f64 / 1024.0;
        println!(
            "{name:<9} {:>14} {fmax:>8} {:>22} {:>14.1}",
            format!("{f0}/{f1}"),
            format!("{:.1}/{:.1}/{:.1}", mib(r0), mib(rmid), mib(r1)),
            mib(rmax)
        );
        // Growth over the second half: what a leak adds hop after hop, once the allocator's
        // arenas and the first hops' caches have settled.
        println!(
            "{}",
            json!({"bench": "soak_process", "process": name, "fds_first": f0, "fds_last": f1,
                "fds_max": fmax, "fd_growth": f1 as i64 - f0 as i64, "rss_kib_first": r0,
                "rss_kib_mid": rmid, "rss_kib_last": r1, "rss_kib_max": rmax,
                "rss_growth_kib": r1 as i64 - r0 as i64,
                "rss_growth_second_half_kib": r1 as i64 - rmid as i64})
        );
    }
    let mut lags: Vec<f64> = hops
        .iter()
        .filter_map(|h| h.event_lags_ms.as_ref())
        .flatten()
        .copied()
        .collect();
    if hops.iter().any(|h| h.event_lags_ms.is_some()) {
        let (p50, p99, max) = (
            quantile(&mut lags, 0.5),
            quantile(&mut lags, 0.99),
            quantile(&mut lags, 1.0),
        );
        let lags = lags.len();
        println!(
            "events awaited: {lags}, logged to answered ms p50/p99/max {p50:.2}/{p99:.2}/{max:.2}"
        );
        println!(
            "{}",
            json!({"bench": "soak_events", "events_awaited": lags,
                "lag_ms": {"p50": p50, "p99": p99, "max": max}})
        );
    }
    let last = hops.last();
    let (passes, failures) = last.map_or((0, 0), |h| (h.verify_passes, h.verify_failures));
    println!(
        "{} hops in {:.0} s; the guest verified its memory {passes} times, {failures} failed",
        hops.len(),
        took.as_secs_f64()
    );
    println!(
        "{}",
        json!({"bench": "soak", "round_trips": samples.len(), "hops": hops.len(),
            "verify_passes": passes, "verify_failures": failures, "seconds": took.as_secs_f64()})
    );
}
