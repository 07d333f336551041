//! The blocktime section of `ferry bench postcopy`: the flat-out scenario (an 8 GiB guest
//! writing a 1 GiB working set flat out, in order, at random and hot/cold, switched to postcopy
//! after pass 1, loopback, 2 data channels), the push in address order (the reference) and
//! hottest first, without and with the preempt connection: the vCPU blocktime (the
//! destination's sum of fault-to-page times), the demand faults (page requests), their
//! latency, how many faults found a page the push had not reached, the postcopy phase against
//! the time its bytes take at raw loopback TCP measured in the same run (idle, and beside a
//! thread that spins, as a guest's vCPU writing flat out holds a core), and the guest's own
//! view: its time in write batches over 1 ms from the switch on (the pause included).

use std::net::TcpListener;

use anyhow::Context;
use serde_json::json;

use ferry_migrate::source::PostcopyOrder;

use super::precopy::{DestinationSetup, Scenario, migrate_over};
use super::raw_tcp::raw_tcp_streams;

const GIB: u64 = 1 << 30;

/// Runs per row.
const RUNS: usize = 2;

/// The section's rows whose name contains `only`, if given.
pub(super) fn rows(only: Option<&str>) -> anyhow::Result<Vec<serde_json::Value>> {
    let link = raw_tcp_streams(4 * GIB, 2)?;
    let busy = beside_a_busy_core(|| raw_tcp_streams(4 * GIB, 2))?;
    println!(
        "\nblocktime: 8 GiB guest, 1 GiB working set written flat out, postcopy after pass 1, loopback, 2 channels; push in address order (the reference) and hottest first; raw loopback TCP, 2 streams: {:.0} MB/s, beside a thread that spins (as a guest's vCPU that writes): {:.0} MB/s",
        link / 1e6,
        busy / 1e6
    );
    println!(
        "{:<44} {:>12} {:>8} {:>9} {:>8} {:>7} {:>8} {:>8} {:>7} {:>7} {:>10}",
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
        "slow after"
    );
    let mut rows = Vec::new();
    let patterns = [
        ("in order", "seq"),
        ("random", "random"),
        ("hot/cold", "hotcold"),
    ];
    for (pattern_name, pattern) in patterns {
        for preempt in [false, true] {
            for order in [PostcopyOrder::Address, PostcopyOrder::Hot] {
                for run in 1..=RUNS {
                    let name = format!(
                        "{pattern_name}, {}, {}",
                        if preempt { "preempt" } else { "no preempt" },
                        match order {
                            PostcopyOrder::Address => "address",
                            PostcopyOrder::Hot => "hot",
                        }
                    );
                    if only.is_none_or(|o| name.contains(o)) {
                        rows.push(row(&name, pattern, preempt, order, run, link, busy)?);
                    }
                }
            }
        }
    }
    Ok(rows)
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
) -> anyhow::Result<serde_json::Value> {
    let s = Scenario {
        postcopy: Some(preempt),
        postcopy_order: order,
        ..Scenario::new(
            &format!("blocktime, {name}"),
            8 * GIB,
            &format!(
                "ws=1G pattern={pattern} rate=max prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2"
            ),
            2,
        )
    };
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
    println!(
        "{:<44} {:>12.1} {:>8} {:>9} {:>8.0} {:>7} {:>8.0} {:>8.0} {:>7.2} {:>7.2} {:>10.0}",
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
        slow_ms
    );
    Ok(
        json!({"bench": "postcopy_blocktime", "pattern": pattern, "preempt": preempt,
        "order": order, "run": run, "link_bytes_per_s": link, "busy_link_bytes_per_s": busy,
        "vcpu_blocktime_ms": pc.vcpu_blocktime_ms, "requests": pc.requests,
        "faults_unreached": pc.faults_unreached, "guest_slow_batch_ms": slow_ms,
        "postcopy_vs_link": pc.duration_ms / ideal_ms,
        "postcopy_vs_busy_link": pc.duration_ms / busy_ms, "postcopy": pc}),
    )
}
