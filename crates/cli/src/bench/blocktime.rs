//! The blocktime section of `ferry bench postcopy`: the flat-out scenario (an 8 GiB guest
//! writing a 1 GiB working set flat out, in order, at random and hot/cold, switched to postcopy
//! after pass 1, loopback, 2 data channels), the push in address order (the reference) and
//! hottest first, without and with the preempt connection: the vCPU blocktime (the
//! destination's sum of fault-to-page times), the demand faults (page requests), their
//! latency, how many faults found a page the push had not reached, the postcopy phase against
//! the time its bytes take at raw loopback TCP measured in the same run (idle, and beside a
//! thread that spins, as a guest's vCPU writing flat out holds a core), and the guest's own
//! view: its time in write batches over 1 ms from the switch on (the pause included). Each
//! row runs three times, the two orders alternating, and each group prints its medians; under
//! each run, where the push's time went stage by stage on both sides (`stage_clock.rs`), and
//! the push against raw TCP measured right before that run. Each group then runs QEMU 10
//! with the same guest (`blocktime_qemu.rs`), three times, its median beside ferry's.

use std::net::TcpListener;

use anyhow::Context;
use serde_json::json;

use ferry_migrate::source::PostcopyOrder;
use ferry_migrate::stage_clock::{IntakeStages, PushStages, StageTime};

use super::precopy::{DestinationSetup, Scenario, migrate_over};
use super::process::median;
use super::raw_tcp::raw_tcp_streams;

const GIB: u64 = 1 << 30;

/// Runs per row, the orders alternating from run to run (the machine's load drifts, and
/// each order then sees as much of it); each group prints its medians.
const RUNS: usize = 3;

/// The section's rows whose name contains `only`, if given.
pub(super) fn rows(only: Option<&str>) -> anyhow::Result<Vec<serde_json::Value>> {
    let link = raw_tcp_streams(4 * GIB, 2)?;
    let busy = beside_a_busy_core(|| raw_tcp_streams(4 * GIB, 2))?;
    println!(
        "\nblocktime: 8 GiB guest, 1 GiB working set written flat out, postcopy after pass 1, loopback, 2 channels; push in address order (the reference) and hottest first, {RUNS} runs each, the orders alternating; raw loopback TCP, 2 streams: {:.0} MB/s, beside a thread that spins (as a guest's vCPU that writes): {:.0} MB/s",
        link / 1e6,
        busy / 1e6
    );
    println!(
        "push x = first background batch to Done, against the time its bytes take at raw loopback TCP (2 streams beside a spinning thread) measured right before each run; stages in ms summed over each stage's threads: source walk/serve/room (the migration thread: walking, serving requests, waiting for a queue with room), idle/scan/write (the senders; write's CPU in brackets), destination idle/read/install/wake (the receivers)"
    );
    println!(
        "{:<44} {:>12} {:>8} {:>9} {:>8} {:>7} {:>8} {:>8} {:>7} {:>7} {:>7} {:>10}",
        "migration",
        "blocktime ms",
        "asked",
        "unreached",
        "mean µs",
        "p99",
        "post ms",
        "MB",
        "x link",
        "x busy",
        "push x",
        "slow after"
    );
    let mut rows = Vec::new();
    let patterns = [
        ("in order", "seq"),
        ("random", "random"),
        ("hot/cold", "hotcold"),
    ];
    let order_name = |o: PostcopyOrder| match o {
        PostcopyOrder::Address => "address",
        PostcopyOrder::Hot => "hot",
    };
    for (pattern_name, pattern) in patterns {
        for preempt in [false, true] {
            let group = format!(
                "{pattern_name}, {}",
                if preempt { "preempt" } else { "no preempt" }
            );
            let mut runs: Vec<(PostcopyOrder, Run)> = Vec::new();
            for run in 1..=RUNS {
                let orders = match run % 2 {
                    1 => [PostcopyOrder::Address, PostcopyOrder::Hot],
                    _ => [PostcopyOrder::Hot, PostcopyOrder::Address],
                };
                for order in orders {
                    let name = format!("{group}, {}", order_name(order));
                    if only.is_none_or(|o| name.contains(o)) {
                        let (json, r) = row(&name, pattern, preempt, order, run, link, busy)?;
                        rows.push(json);
                        runs.push((order, r));
                    }
                }
            }
            let address = runs
                .iter()
                .filter(|(o, _)| *o == PostcopyOrder::Address)
                .map(|(_, r)| r.blocktime_ms)
                .collect::<Vec<_>>();
            let qemu_name = format!("{group}, qemu 10");
            if only.is_none_or(|o| qemu_name.contains(o)) {
                rows.extend(qemu_rows(&qemu_name, pattern, preempt, &address)?);
            }
            for order in [PostcopyOrder::Address, PostcopyOrder::Hot] {
                let of: Vec<&Run> = runs
                    .iter()
                    .filter(|(o, _)| *o == order)
                    .map(|(_, r)| r)
                    .collect();
                if of.is_empty() {
                    continue;
                }
                let med = |f: fn(&Run) -> f64| median(&of.iter().map(|r| f(r)).collect::<Vec<_>>());
                let name = format!("{group}, {}", order_name(order));
                println!(
                    "{:<44} {:>12.1} {:>8.0} {:>9} {:>8} {:>7} {:>8.0} {:>8} {:>7.2} {:>7.2} {:>7.2}",
                    format!("{name}, median of {}", of.len()),
                    med(|r| r.blocktime_ms),
                    med(|r| r.requests),
                    "",
                    "",
                    "",
                    med(|r| r.post_ms),
                    "",
                    med(|r| r.x_link),
                    med(|r| r.x_busy),
                    med(|r| r.push_x),
                );
                rows.push(
                    json!({"bench": "postcopy_blocktime_median", "pattern": pattern,
                    "preempt": preempt, "order": order, "runs": of.len(),
                    "vcpu_blocktime_ms": med(|r| r.blocktime_ms), "requests": med(|r| r.requests),
                    "postcopy_ms": med(|r| r.post_ms), "postcopy_vs_link": med(|r| r.x_link),
                    "postcopy_vs_busy_link": med(|r| r.x_busy), "push_vs_link": med(|r| r.push_x)}),
                );
            }
        }
    }
    Ok(rows)
}

/// QEMU 10 migrating the same guest in the same pattern, [`RUNS`] times (`blocktime_qemu.rs`),
/// each run printed and then the median, with ferry's address-order median blocktime against
/// QEMU's when the group ran it (`ferry_address_blocktime_ms`).
fn qemu_rows(
    name: &str,
    pattern: &str,
    preempt: bool,
    ferry_address_blocktime_ms: &[f64],
) -> anyhow::Result<Vec<serde_json::Value>> {
    if let Some(why) = super::blocktime_qemu::missing() {
        println!("{name}: no row: {why}");
        return Ok(Vec::new());
    }
    let cmdline = cmdline(pattern);
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    for run in 1..=RUNS {
        let q = super::blocktime_qemu::migrate(8 * GIB, &cmdline, preempt)
            .with_context(|| format!("{name}, run {run}"))?;
        println!(
            "{:<44} {:>12.1} {:>8.0} {:>9} {:>8} {:>7} {:>8.0}",
            format!("{name}, run {run}"),
            q.blocktime_ms,
            q.requests,
            "",
            "",
            "",
            q.post_ms
        );
        rows.push(
            json!({"bench": "postcopy_blocktime_qemu", "pattern": pattern,
            "preempt": preempt, "run": run, "vcpu_blocktime_ms": q.blocktime_ms,
            "requests": q.requests, "postcopy_ms": q.post_ms}),
        );
        runs.push(q);
    }
    let med = |f: fn(&super::blocktime_qemu::QemuPostcopy) -> f64| {
        median(&runs.iter().map(f).collect::<Vec<_>>())
    };
    let blocktime = med(|q| q.blocktime_ms);
    let ours = (!ferry_address_blocktime_ms.is_empty()).then(|| median(ferry_address_blocktime_ms));
    println!(
        "{:<44} {:>12.1} {:>8.0} {:>9} {:>8} {:>7} {:>8.0}{}",
        format!("{name}, median of {RUNS}"),
        blocktime,
        med(|q| q.requests),
        "",
        "",
        "",
        med(|q| q.post_ms),
        match ours {
            Some(f) => format!("   ferry (address order) / QEMU: {:.2}", f / blocktime),
            None => String::new(),
        }
    );
    rows.push(
        json!({"bench": "postcopy_blocktime_qemu_median", "pattern": pattern,
        "preempt": preempt, "runs": RUNS, "vcpu_blocktime_ms": blocktime,
        "requests": med(|q| q.requests), "postcopy_ms": med(|q| q.post_ms),
        "ferry_address_vs_qemu": ours.map(|f| f / blocktime)}),
    );
    Ok(rows)
}

/// The guest of every row, ferry's and QEMU's: a 1 GiB working set written flat out in
/// `pattern`, filled first.
fn cmdline(pattern: &str) -> String {
    format!("ws=1G pattern={pattern} rate=max prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2")
}

/// One run's figures that the medians are taken of.
struct Run {
    blocktime_ms: f64,
    requests: f64,
    post_ms: f64,
    x_link: f64,
    x_busy: f64,
    push_x: f64,
}

/// `f` while another thread spins, as a vCPU that writes flat out holds a core.
fn beside_a_busy_core<T>(f: impl FnOnce() -> T) -> T {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        let out = f();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        out
    })
}

/// One migration of the section, its row printed.
fn row(
    name: &str,
    pattern: &str,
    preempt: bool,
    order: PostcopyOrder,
    run: usize,
    link: f64,
    busy: f64,
) -> anyhow::Result<(serde_json::Value, Run)> {
    let s = Scenario {
        postcopy: Some(preempt),
        postcopy_order: order,
        ..Scenario::new(&format!("blocktime, {name}"), 8 * GIB, &cmdline(pattern), 2)
    };
    // The link as it is right before this run (the machine's load drifts over a section):
    // raw loopback TCP beside a spinning thread, as the guest's vCPU spins beside the push.
    let here = beside_a_busy_core(|| raw_tcp_streams(GIB, 2))?;
    let m = migrate_over(
        &s,
        DestinationSetup::default(),
        TcpListener::bind("127.0.0.1:0")?,
    )
    .with_context(|| format!("blocktime run {run} {name}"))?;
    let pc = m
        .stats
        .postcopy
        .clone()
        .context("the migration did not switch to postcopy")?;
    let ideal_ms = pc.bytes as f64 / link * 1e3;
    let busy_ms = pc.bytes as f64 / busy * 1e3;
    // The source's guest stopped at the pause: its counters are the switch's.
    let slow_ms = m
        .guest
        .slow_batch_ns
        .saturating_sub(m.source_guest[1].slow_batch_ns) as f64
        / 1e6;
    // The push against the raw link's time for the bytes written while it ran, the link
    // measured right before the run, beside a spinning thread.
    let push_x = pc.push.ms / (pc.push.bytes as f64 / here * 1e3);
    println!(
        "{:<44} {:>12.1} {:>8} {:>9} {:>8.0} {:>7} {:>8.0} {:>8.0} {:>7.2} {:>7.2} {:>7.2} {:>10.0}",
        format!("{name}, run {run}"),
        pc.vcpu_blocktime_ms,
        pc.requests,
        pc.faults_unreached,
        pc.latency_mean_us,
        pc.latency_p99_us,
        pc.duration_ms,
        pc.bytes as f64 / 1e6,
        pc.duration_ms / ideal_ms,
        pc.duration_ms / busy_ms,
        push_x,
        slow_ms
    );
    let intake = m
        .received
        .postcopy
        .as_ref()
        .map(|r| r.intake)
        .unwrap_or_default();
    print_push_stages(&pc.push, &intake, here);
    let r = Run {
        blocktime_ms: pc.vcpu_blocktime_ms,
        requests: pc.requests as f64,
        post_ms: pc.duration_ms,
        x_link: pc.duration_ms / ideal_ms,
        x_busy: pc.duration_ms / busy_ms,
        push_x,
    };
    Ok((
        json!({"bench": "postcopy_blocktime", "pattern": pattern, "preempt": preempt,
        "order": order, "run": run, "link_bytes_per_s": link, "busy_link_bytes_per_s": busy,
        "vcpu_blocktime_ms": pc.vcpu_blocktime_ms, "requests": pc.requests,
        "faults_unreached": pc.faults_unreached, "guest_slow_batch_ms": slow_ms,
        "postcopy_vs_link": pc.duration_ms / ideal_ms,
        "postcopy_vs_busy_link": pc.duration_ms / busy_ms, "push_vs_link": push_x,
        "run_link_bytes_per_s": here,
        "intake": intake, "postcopy": pc}),
        r,
    ))
}

/// The push's stages, one line: its time and bytes, then where each side's threads spent it.
fn print_push_stages(p: &PushStages, d: &IntakeStages, link: f64) {
    let t = |s: &StageTime| format!("{:.0}", s.ms);
    println!(
        "    push {:.0} ms ({:.0} written) for {:.0} MB, link {:.0} MB/s; source walk {} serve {} room {} ({}x), senders idle {} scan {} write {} ({:.0} CPU); destination idle {} read {} install {} wake {}",
        p.ms,
        p.written_ms,
        p.bytes as f64 / 1e6,
        link / 1e6,
        t(&p.walk),
        t(&p.serve),
        t(&p.room_wait),
        p.room_wait.count,
        t(&p.sender_idle),
        t(&p.scan),
        t(&p.write),
        p.write.cpu_ms,
        t(&d.idle),
        t(&d.read),
        t(&d.install),
        t(&d.wake),
    );
}
