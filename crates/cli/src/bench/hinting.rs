//! `ferry bench hinting`: free page hinting on and off, in one run, on the built-in guest
//! with 8 GiB of RAM of which it filled and freed 6 GiB (`free=6G`) and uses 256 MiB: idle,
//! and churning its free memory at a moderate rate (allocate, write, verify, free) as a
//! compile does. Each case is migrated with hints off (the reference: every populated page is
//! sent) and on, and the table shows total time, bytes sent, pages skipped as hinted,
//! downtime, the pause the guest saw, and the guest's own work while it migrated (MB/s of
//! working-set pages and churned blocks written), with the saving against the reference.

use std::process::ExitCode;

use clap::Args;
use serde_json::json;

use super::precopy::{DestinationSetup, Scenario, migrate_into};
use ferry_vmm::devices::telemetry::GuestTelemetry;

const GIB: u64 = 1 << 30;
/// Churn rate of the second case, MB/s: a tenth of what the guest can write, as a compile
/// allocates and frees while it computes.
const CHURN_MB_S: u32 = 200;

#[derive(Debug, Args)]
pub struct HintingBenchArgs {
    /// Only the idle case (for a quick look).
    #[arg(long)]
    idle_only: bool,
}

pub fn run(args: &HintingBenchArgs) -> anyhow::Result<ExitCode> {
    let guest = "ws=256M rate=1 prefill=1 free=6G verify-ms=0 log-ms=0 heartbeat-ms=2";
    let mut cases = vec![("idle 8G, 6G freed".to_string(), guest.to_string())];
    if !args.idle_only {
        cases.push((
            format!("8G, 6G freed, churn {CHURN_MB_S} MB/s"),
            format!("{guest} churn={CHURN_MB_S}"),
        ));
    }
    println!(
        "{:<32} {:>6} {:>9} {:>10} {:>13} {:>10} {:>10} {:>11}",
        "case",
        "hints",
        "total ms",
        "MB sent",
        "pages hinted",
        "downtime",
        "guest ms",
        "guest MB/s"
    );
    let mut rows = Vec::new();
    for (name, cmdline) in &cases {
        let mut reference = None;
        for hints in [false, true] {
            let s = Scenario {
                free_page_hints: hints,
                ..Scenario::new(name, 8 * GIB, cmdline, 2)
            };
            let m = migrate_into(&s, DestinationSetup::default())?;
            let (st, pause_ms) = (m.stats, m.pause_ms);
            let work = work_mb_s(&m.source_guest, st.total_ms);
            println!(
                "{:<32} {:>6} {:>9.0} {:>10.1} {:>13} {:>10.1} {:>10.1} {:>11.1}",
                name,
                if hints { "on" } else { "off" },
                st.total_ms,
                st.bytes_sent as f64 / 1e6,
                st.pages_skipped_hinted,
                st.downtime.total_ms,
                pause_ms,
                work
            );
            let mut row = json!({
                "bench": "hinting", "case": name, "hints": hints, "total_ms": st.total_ms,
                "bytes_sent": st.bytes_sent, "pages_skipped_hinted": st.pages_skipped_hinted,
                "hint_rounds": st.hint_rounds, "downtime_ms": st.downtime.total_ms,
                "guest_pause_ms": pause_ms, "guest_work_mb_s": work, "stats": st,
            });
            match reference {
                None => reference = Some((st.total_ms, st.bytes_sent)),
                Some((ms, bytes)) => {
                    let less_time = 100.0 * (1.0 - st.total_ms / ms);
                    let less_bytes = 100.0 * (1.0 - st.bytes_sent as f64 / bytes as f64);
                    println!(
                        "{:<32} {less_time:>5.0}% less time, {less_bytes:.1}% fewer bytes than without hints",
                        ""
                    );
                    row["less_time_percent"] = json!(less_time);
                    row["fewer_bytes_percent"] = json!(less_bytes);
                }
            }
            rows.push(row);
        }
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// What the source's guest wrote while it migrated, MB/s: working-set pages and churned
/// blocks, between the telemetry at the start and at the end.
fn work_mb_s([before, after]: &[GuestTelemetry; 2], total_ms: f64) -> f64 {
    let churned = |g: &GuestTelemetry| g.free_memory.map_or(0, |f| f.blocks_churned);
    let bytes = (after.pages_written - before.pages_written) * 4096
        + (churned(after) - churned(before)) * (2 << 20);
    bytes as f64 / 1e6 / (total_ms / 1e3).max(1e-3)
}
