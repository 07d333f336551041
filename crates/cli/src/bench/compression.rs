//! `ferry bench compression`: page compression (issue 33, item 3) on the built-in guest with
//! `fill=mixed` (50% text-like, 30% code-like and 20% random pages), each migration set
//! against the same guest migrated without compression in the same run:
//!
//! - at `--max-bandwidth 125M` (1 Gbit/s): off, `zstd` at levels 1 and 3, and `auto`; and
//!   `auto` on a guest of random pages, which must go raw and lose nothing to the tries;
//! - unlimited on loopback: off, `zstd` and `auto`, where the link is faster than compression
//!   and `auto` must send raw.
//!
//! Each row prints the total time against its reference's, the bytes on the wire, the ratio
//! compression reached, and the CPU it cost on each side.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use ferry_migrate::Compression;
use serde_json::json;

use super::precopy::{DestinationSetup, Scenario, migrate_into};

#[derive(Debug, Args)]
pub struct CompressionBenchArgs {
    /// Only the rows whose name contains this.
    #[arg(long)]
    scenario: Option<String>,
}

const GIB: u64 = 1 << 30;
/// The guest: 1 GiB written once, then 1 MB/s, heartbeats for the pause.
const MIXED: &str = "ws=1G fill=mixed rate=1 prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2";
const RANDOM: &str = "ws=1G fill=random rate=1 prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2";
/// 1 Gbit/s, as `--max-bandwidth 125M` writes it.
const GBIT: u64 = 125_000_000;

pub fn run(args: &CompressionBenchArgs) -> anyhow::Result<ExitCode> {
    let zstd = |level| Compression::Zstd { level };
    let auto = Compression::Auto { level: 1 };
    // (group, guest, limit, the modes: the first is the group's reference)
    let groups = [
        (
            "mixed, 125 MB/s",
            MIXED,
            Some(GBIT),
            vec![Compression::Off, zstd(1), zstd(3), auto],
        ),
        (
            "random, 125 MB/s",
            RANDOM,
            Some(GBIT),
            vec![Compression::Off, auto],
        ),
        (
            "mixed, unlimited",
            MIXED,
            None,
            vec![Compression::Off, zstd(1), auto],
        ),
    ];
    println!("2 GiB guest, 1 GiB written; 2 channels; each row against its group's 'off'");
    println!(
        "{:<18} {:<7} {:>9} {:>7} {:>9} {:>7} {:>8} {:>8} {:>7} {:>7}",
        "group",
        "mode",
        "total ms",
        "x off",
        "MB wire",
        "ratio",
        "src cpu",
        "dst cpu",
        "zstd s",
        "unzstd"
    );
    let mut rows = Vec::new();
    for (group, guest, limit, modes) in groups {
        let mut reference = None;
        for mode in modes {
            let name = format!("{group}, {mode}");
            if args.scenario.as_deref().is_some_and(|o| !name.contains(o)) {
                continue;
            }
            let s = Scenario {
                compression: mode,
                max_bandwidth: limit,
                ..Scenario::new(&name, 2 * GIB, guest, 2)
            };
            let m = migrate_into(&s, DestinationSetup::default())
                .with_context(|| format!("migration '{name}'"))?;
            let st = &m.stats;
            let c = st.compression.unwrap_or_default();
            let ratio = c.bytes_in as f64 / (c.bytes_out as f64).max(1.0);
            let x_off = match (mode, reference) {
                (Compression::Off, _) => {
                    reference = Some(st.total_ms);
                    1.0
                }
                (_, Some(off)) => st.total_ms / off,
                (_, None) => f64::NAN,
            };
            let unzstd = m.received.decompress_cpu_ns as f64 / 1e9;
            println!(
                "{:<18} {:<7} {:>9.0} {:>7.2} {:>9.1} {:>7.2} {:>8.2} {:>8.2} {:>7.2} {:>7.2}",
                group,
                mode.to_string(),
                st.total_ms,
                x_off,
                st.bytes_sent as f64 / 1e6,
                ratio,
                st.cpu_seconds_source,
                st.cpu_seconds_destination,
                c.cpu_seconds,
                unzstd
            );
            rows.push(json!({
                "bench": "compression", "group": group, "mode": mode.to_string(),
                "max_bandwidth": limit, "total_ms": st.total_ms, "x_off": x_off,
                "bytes_sent": st.bytes_sent, "compression": st.compression,
                "ratio": ratio, "cpu_s_source": st.cpu_seconds_source,
                "cpu_s_destination": st.cpu_seconds_destination,
                "decompress_cpu_s": unzstd, "downtime_ms": st.downtime.total_ms,
                "guest_pause_ms": m.pause_ms, "passes": st.passes,
            }));
        }
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}
