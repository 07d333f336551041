//! `ferry bench net`: a guest answering a stream of numbered UDP echo requests (10,000 a second
//! from the host by default) moved again and again, every VMM and frame inside one network
//! namespace the bench makes and deletes (`net_segment.rs`). Rows, each `--moves` times:
//!
//! - `migrate`: ferry across two taps on the bridge: a fresh destination process (`ferry run
//!   --incoming tcp:127.0.0.1:PORT --net tap=B`) for each move, over the namespace's loopback,
//!   the old source killed once the guest runs there; the next move goes back to the first tap;
//! - `local`: a local handover (`ferry migrate --local` over a Unix socket) to a fresh process
//!   on the same tap, which the old process passes it;
//! - `qemu`: QEMU (`net_qemu.rs`) across the same two taps, announcing by itself.
//!
//! Per move (`net_measure.rs` defines each figure and the pause window): frames lost, those
//! lost outside the pause window, echoes duplicated, the first echo after the resume, the first
//! announce the bridge saw after the resume, the downtime the source computed and the pause on
//! the host's clock. The reference, in each row's own stream: the echo round trip before its
//! first move. The guest's pause under ferry is its own (the telemetry's last report before it
//! and first after, heartbeats every millisecond), under QEMU its `STOP` and `RESUME` events.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ferry_vmm::request::{MigrationMode, MigrationRequest};
use serde_json::{Value, json};

use super::net_measure::{Figures, Marks, from_monotonic_ns, median_max};
use super::net_qemu::{self, QemuRow};
use super::net_segment::{
    Announces, BRIDGE, GUEST, RowRun, SETTLE, Segment, TAPS, WARM, parse_mac, sleep_until, streamed,
};
use super::net_trace::Trace;
use super::process::{STEP_LIMIT, Vmm, migrate_and_verify};

#[derive(Debug, Args)]
pub struct NetBenchArgs {
    /// Moves per row (the goal is judged over 100).
    #[arg(long, default_value_t = 10)]
    moves: u32,
    /// Echo requests a second from the host.
    #[arg(long, default_value_t = 10_000)]
    rate: u32,
    /// The guest's RAM.
    #[arg(long, default_value = "256M")]
    memory: String,
    /// The guest's workload beside the echo (`net=` is added): a small working set written
    /// and verified, and a heartbeat every millisecond, so that its pause is seen to the
    /// millisecond.
    #[arg(
        long,
        default_value = "ws=8M rate=20 verify-ms=200 log-ms=0 heartbeat-ms=1"
    )]
    cmdline: String,
    /// Rows to run, comma separated: migrate, local, qemu.
    #[arg(long, default_value = "migrate,local,qemu")]
    rows: String,
    /// Writes one JSON line a ferry move to FILE: the destination NIC's first steps after
    /// the resume, the first echo, and each lost frame's send against the pause window and
    /// the tap the bridge gave it to (both taps watched, a thread each, while it runs).
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
}

/// How a ferry row moves its guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ferry {
    /// Over TCP to a process on the other tap.
    Migrate,
    /// A local handover to a process on the same tap.
    Local,
}

pub fn run(args: &NetBenchArgs) -> anyhow::Result<ExitCode> {
    let memory = crate::sizes::parse_size(&args.memory).map_err(anyhow::Error::msg)?;
    let rows: Vec<&str> = args.rows.split(',').map(str::trim).collect();
    if let Some(bad) = rows
        .iter()
        .find(|r| !["migrate", "local", "qemu"].contains(r))
    {
        anyhow::bail!("--rows: no row {bad:?}; the rows are migrate, local and qemu");
    }
    let guest = format!("{} net={GUEST}", args.cmdline);
    println!(
        "net: {} moves per row of a guest answering {} echo requests/s (`{guest}`), in a namespace of its own",
        args.moves, args.rate
    );
    println!(
        "pause window: from the pause's start to the later of the resume and the first announce seen at the bridge; figures median/max per move"
    );
    let segment = Segment::new()?;
    let announces = Announces::watch(&segment)?;
    let trace = match &args.trace {
        Some(path) => Some(Trace::start(&segment, path)?),
        None => None,
    };
    let mut done: Vec<(&str, RowRun)> = Vec::new();
    let mut failed = false;
    for row in rows {
        let result = match row {
            "migrate" => ferry_row(&segment, &announces, &trace, args, memory, Ferry::Migrate),
            "local" => ferry_row(&segment, &announces, &trace, args, memory, Ferry::Local),
            _ => match net_qemu::usable() {
                Ok(()) => net_qemu::row(
                    &segment,
                    &announces,
                    &QemuRow {
                        memory,
                        cmdline: &guest,
                        moves: args.moves,
                        rate: args.rate,
                    },
                ),
                Err(why) => {
                    println!("qemu: no row: {why}");
                    continue;
                }
            },
        };
        match result {
            Ok(r) => done.push((row, r)),
            Err(e) => {
                failed = true;
                println!("{row}: failed: {e:#}");
            }
        }
    }
    drop(announces);
    drop(trace);
    drop(segment);
    table(&done, args);
    println!(
        "goals: no frame lost outside the pause window and none duplicated over 100 moves each; on a local handover the first echo within the pause plus 1 ms and none lost; announce within 5 ms of the resume"
    );
    Ok(match failed {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    })
}

/// `--memory`, `--incoming`/`--cmdline` and `--net` of a `ferry run`.
fn run_args(memory: u64, first: [&str; 2], tap: &str) -> Vec<String> {
    ["--memory", &memory.to_string(), first[0], first[1]]
        .into_iter()
        .chain(["--net", &format!("tap={tap}")])
        .map(String::from)
        .collect()
}

/// A ferry row: a VM booted on the first tap, moved `--moves` times under the stream.
fn ferry_row(
    segment: &Segment,
    announces: &Announces,
    trace: &Option<Trace>,
    args: &NetBenchArgs,
    memory: u64,
    how: Ferry,
) -> anyhow::Result<RowRun> {
    let dir = tempfile::tempdir()?;
    let guest = format!("{} net={GUEST}", args.cmdline);
    let mut src = spawn(
        segment,
        dir.path(),
        0,
        &run_args(memory, ["--cmdline", &guest], TAPS[0]),
    )?;
    let vm = src.wait_for("the guest's network workload", "/vm", |v| {
        v["guest"]["net"].is_object()
    })?;
    let mac = vm["net"]["mac"].as_str().context("GET /vm shows no MAC")?;
    segment.ns.neighbour(GUEST, mac, BRIDGE);
    let mac = parse_mac(mac)?;
    let row = match how {
        Ferry::Migrate => "migrate",
        Ferry::Local => "local",
    };
    let seen = |run: &_, marks: &[Marks], end| {
        if let Some(t) = trace {
            t.moves(row, run, marks, end);
        }
    };
    streamed(segment, args.rate, seen, || {
        let warm = Instant::now() + WARM;
        src.wait_for("the guest answering", "/vm", |v| echoes(v) >= 1)?;
        sleep_until(warm);
        let mut marks = Vec::new();
        for i in 1..=args.moves {
            let (tap, to) = match how {
                Ferry::Migrate => (TAPS[i as usize % 2], format!("tcp:127.0.0.1:{}", 4000 + i)),
                Ferry::Local => (
                    TAPS[0],
                    format!("unix:{}", dir.path().join(format!("in{i}.sock")).display()),
                ),
            };
            let mut dst = spawn(
                segment,
                dir.path(),
                i,
                &run_args(memory, ["--incoming", &to], tap),
            )?;
            dst.waiting()?;
            let request = MigrationRequest {
                timeout_ms: Some(STEP_LIMIT.as_millis() as u64),
                mode: match how {
                    Ferry::Migrate => MigrationMode::Precopy,
                    Ferry::Local => MigrationMode::Local,
                },
                ..MigrationRequest::to(&to)
            };
            let begun = Instant::now();
            let m = migrate_and_verify(&mut src, &mut dst, &request)
                .with_context(|| format!("move {i}"))?;
            let (Some(resumed), Some(pause)) = (
                m.guest["migration_resumed_host_ns"].as_u64(),
                m.guest["migration_pause_ns"].as_u64(),
            ) else {
                anyhow::bail!("move {i}: the destination's guest reported no pause");
            };
            let resumed = from_monotonic_ns(resumed);
            let paused = resumed - Duration::from_nanos(pause);
            sleep_until(resumed + SETTLE);
            let vm = dst.get("/vm").unwrap_or_default();
            let (steps, rx_on) = nic_steps(&vm["net"]["since_open"]);
            marks.push(Marks {
                begun,
                paused,
                resumed,
                announce: announces.first_after(mac, paused),
                downtime_ms: m.stats.downtime.total_ms,
                steps,
                rx_on,
                counters: json!({"nic": vm["net"], "guest": vm["guest"]["net"]}),
            });
            src = dst;
        }
        Ok(marks)
    })
}

/// The NIC's first steps since its gate opened (`since_open` in `GET /vm`) on the host's
/// clock, and the thread that gave the guest its first frame.
fn nic_steps(since_open: &Value) -> (Vec<(String, Instant)>, Option<String>) {
    let steps = ["opened_ns", "first_turn_ns", "first_rx_ns", "first_tx_ns"]
        .into_iter()
        .filter_map(|k| {
            let ns = since_open[k].as_u64()?;
            Some((k.trim_end_matches("_ns").to_string(), from_monotonic_ns(ns)))
        })
        .collect();
    let on = since_open["first_rx_on"].as_str().map(String::from);
    (steps, on)
}

/// The guest's echoes so far, in a `GET /vm`.
fn echoes(vm: &Value) -> u64 {
    vm["guest"]["net"]["echoes_sent"].as_u64().unwrap_or(0)
}

/// The `i`th `ferry run` of a row, inside the namespace, in a directory of its own.
fn spawn(segment: &Segment, dir: &Path, i: u32, args: &[String]) -> anyhow::Result<Vmm> {
    let dir = dir.join(format!("vmm{i}"));
    std::fs::create_dir_all(&dir)?;
    Vmm::spawn_in(Some(segment.name()), "vmm", &dir, args)
}

/// The table, then one JSON line a row.
fn table(rows: &[(&str, RowRun)], args: &NetBenchArgs) {
    println!(
        "{:<8} {:>5} {:>10} {:>10} {:>6} {:>13} {:>13} {:>13} {:>13} {:>9}",
        "row",
        "moves",
        "lost",
        "outside",
        "dup",
        "1st echo ms",
        "announce ms",
        "downtime ms",
        "pause ms",
        "rtt ms"
    );
    for (name, r) in rows {
        let of =
            |f: fn(&Figures) -> Option<f64>| median_max(r.figures.iter().filter_map(f).collect());
        let cols = [
            of(|f| Some(f.lost)),
            of(|f| Some(f.lost_outside)),
            of(|f| Some(f.duplicates)),
            of(|f| f.first_echo_ms),
            of(|f| f.announce_ms),
            of(|f| Some(f.downtime_ms)),
            of(|f| Some(f.pause_ms)),
        ];
        let cell = |v: Option<[f64; 2]>, d: usize| {
            v.map_or("-".into(), |[m, x]| format!("{m:.d$}/{x:.d$}"))
        };
        println!(
            "{:<8} {:>5} {:>10} {:>10} {:>6} {:>13} {:>13} {:>13} {:>13} {:>9.3}",
            name,
            r.figures.len(),
            cell(cols[0], 0),
            cell(cols[1], 0),
            cell(cols[2], 0),
            cell(cols[3], 2),
            cell(cols[4], 2),
            cell(cols[5], 2),
            cell(cols[6], 2),
            r.rtt_ms
        );
        let j = |v: Option<[f64; 2]>| v.map_or(Value::Null, |[m, x]| json!({"p50": m, "max": x}));
        let total = |f: fn(&Figures) -> f64| r.figures.iter().map(f).sum::<f64>();
        println!(
            "{}",
            json!({"bench": "net", "row": name, "moves": r.figures.len(), "rate": args.rate,
                "lost": j(cols[0]), "lost_outside": j(cols[1]), "duplicates": j(cols[2]),
                "first_echo_ms": j(cols[3]), "announce_ms": j(cols[4]),
                "downtime_ms": j(cols[5]), "pause_ms": j(cols[6]),
                "lost_total": total(|f| f.lost), "lost_outside_total": total(|f| f.lost_outside),
                "duplicates_total": total(|f| f.duplicates),
                "outside_before_ms_max": j(of(|f| f.outside_before_ms)).get("max"),
                "outside_after_ms_max": j(of(|f| f.outside_after_ms)).get("max"),
                "rtt_ms_no_move": r.rtt_ms, "lost_no_move": r.lost_before,
                "sent": r.sent, "echoes": r.echoes})
        );
    }
}
