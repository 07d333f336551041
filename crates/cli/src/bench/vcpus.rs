//! `ferry bench vcpus`: precopy of a guest whose every vCPU writes, in one run: 1, 16 and 64
//! vCPUs, each dirtying its share of a 4 GiB working set at the same rate, in a 64 GiB VM, so
//! the dirty rate grows with the vCPUs while the dirty log spans 64 GiB. Per row: what the
//! guest wrote while it migrated, the highest dirty rate a pass saw, the passes, the
//! longest dirty sync (harvest and clear of the log, the control loop's longest step), the
//! longest batch of writes the source's guest timed (a stall any step caused a vCPU), total
//! time, downtime and the pause the guest saw. The reference is the one-vCPU row.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::json;

use super::precopy::{DestinationSetup, Finish, Scenario, migrate_into};

const GIB: u64 = 1 << 30;

#[derive(Debug, Args)]
pub struct VcpusBenchArgs {
    /// vCPU counts to measure, each 1 to 64: `--vcpus 1 16` or `--vcpus 1,16`.
    #[arg(
        long,
        num_args = 1..,
        value_delimiter = ',',
        value_parser = clap::value_parser!(u8).range(1..=i64::from(ferry_vmm::vm::MAX_VCPUS)),
        default_values_t = [1u8, 16, 64]
    )]
    vcpus: Vec<u8>,
    /// MB/s each vCPU writes.
    #[arg(long, default_value_t = 8)]
    rate: u32,
    /// Guest RAM, GiB (the dirty log spans all of it).
    #[arg(long, default_value_t = 64)]
    memory_gib: u64,
}

pub fn run(args: &VcpusBenchArgs) -> anyhow::Result<ExitCode> {
    println!(
        "{} GiB guest, 4 GiB working set split between the vCPUs, each writing random pages at {} MB/s; auto-converge on, 300 ms limit",
        args.memory_gib, args.rate
    );
    println!(
        "{:>5} {:>10} {:>14} {:>6} {:>12} {:>13} {:>9} {:>9} {:>9}",
        "vCPUs",
        "guest MB/s",
        "dirty pages/s",
        "passes",
        "max sync ms",
        "guest max ms",
        "total ms",
        "downtime",
        "guest ms"
    );
    let mut rows = Vec::new();
    for &n in &args.vcpus {
        let heartbeat_ms = (u32::from(n) / 4).max(2);
        let cmdline = format!(
            "ws=4G pattern=random rate={} prefill=1 verify-ms=0 log-ms=0 heartbeat-ms={heartbeat_ms}",
            args.rate
        );
        let s = Scenario {
            vcpus: n,
            finish: Finish::Careful,
            downtime: Duration::from_millis(300),
            ..Scenario::new(
                &format!("{n} vCPUs writing"),
                args.memory_gib * GIB,
                &cmdline,
                2,
            )
        };
        let m = migrate_into(&s, DestinationSetup::default())?;
        let st = &m.stats;
        let [before, after] = &m.source_guest;
        let written_mb = (after.pages_written - before.pages_written) as f64 * 4096.0 / 1e6;
        let guest_mb_s = written_mb / (st.total_ms / 1e3).max(1e-3);
        // The highest rate a pass saw while the guest ran.
        let dirty = st
            .passes
            .iter()
            .filter(|p| !p.paused)
            .map(|p| p.dirty_rate_pages_per_s)
            .fold(0.0, f64::max);
        let guest_max_ms = after.max_batch_ns as f64 / 1e6;
        println!(
            "{:>5} {:>10.1} {:>14.0} {:>6} {:>12.2} {:>13.2} {:>9.0} {:>9.1} {:>9.1}",
            n,
            guest_mb_s,
            dirty,
            st.passes.len(),
            st.max_sync_ms,
            guest_max_ms,
            st.total_ms,
            st.downtime.total_ms,
            m.pause_ms
        );
        rows.push(json!({
            "bench": "vcpus", "vcpus": n, "memory_gib": args.memory_gib, "guest_mb_s": guest_mb_s,
            "dirty_pages_per_s": dirty, "passes": st.passes.len(), "max_sync_ms": st.max_sync_ms,
            "guest_max_batch_ms": guest_max_ms, "total_ms": st.total_ms,
            "downtime_ms": st.downtime.total_ms, "guest_pause_ms": m.pause_ms, "stats": st,
        }));
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}
