//! `ferry bench state`: the device-state part of the downtime as the VM grows, in one run. An
//! idle guest (`rate=idle`: its 64 MiB written once, then only heartbeats) with 1, 8, 32 and
//! 64 vCPUs is migrated into a prepared destination (vCPUs
//! created and their threads parked before the switchover, the default) and into an
//! unprepared one (vCPUs created at the state load, threads started at resume), the
//! reference. Per row: state size, save time, load time split into its parts (all vCPUs, and
//! each one's time on average; devices; creating vCPUs; starting or waking their threads),
//! downtime and the pause the guest saw.

use std::process::ExitCode;

use clap::Args;
use ferry_migrate::{MigrationStats, StatePart};
use serde_json::json;

use super::precopy::{DestinationSetup, Scenario, migrate_into};

const GIB: u64 = 1 << 30;

#[derive(Debug, Args)]
pub struct StateBenchArgs {
    /// vCPU counts to measure, each 1 to 64: `--vcpus 1 8` or `--vcpus 1,8`.
    #[arg(
        long,
        num_args = 1..,
        value_delimiter = ',',
        value_parser = clap::value_parser!(u8).range(1..=i64::from(ferry_vmm::vm::MAX_VCPUS)),
        default_values_t = [1u8, 8, 32, 64]
    )]
    // pub(crate): the command line's test in main.rs reads it.
    pub(crate) vcpus: Vec<u8>,
}

/// A load's parts summed by kind: vCPUs (all, and how many), creating them, starting or waking
/// their threads, and everything else (clock, interrupt controller, devices).
#[derive(Debug, Default)]
struct Split {
    vcpus_ms: f64,
    vcpus: usize,
    create_ms: f64,
    threads_ms: f64,
    devices_ms: f64,
}

impl Split {
    fn of(parts: &[StatePart]) -> Split {
        let mut s = Split::default();
        for p in parts {
            match p.name.as_str() {
                n if n.starts_with("vcpu ") => {
                    s.vcpus_ms += p.ms;
                    s.vcpus += 1;
                }
                "create vCPUs" => s.create_ms += p.ms,
                n if n.ends_with("vCPU threads") => s.threads_ms += p.ms,
                _ => s.devices_ms += p.ms,
            }
        }
        s
    }

    fn per_vcpu_us(&self) -> f64 {
        1e3 * self.vcpus_ms / self.vcpus.max(1) as f64
    }
}

pub fn run(args: &StateBenchArgs) -> anyhow::Result<ExitCode> {
    println!(
        "{:>5} {:<10} {:>8} {:>8} {:>8} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "vCPUs",
        "dest",
        "state KB",
        "save ms",
        "load ms",
        "all vCPUs",
        "vCPU load µs",
        "devices",
        "create",
        "threads",
        "resume",
        "downtime",
        "guest ms"
    );
    let mut rows = Vec::new();
    for &n in &args.vcpus {
        let mut reference: Option<f64> = None;
        for unprepared in [true, false] {
            // Heartbeats from all vCPUs together about every 0.25 ms: the guest-observed
            // pause is measured that finely without the reports crowding 2 cores.
            let heartbeat_ms = (u32::from(n) / 4).max(2);
            let cmdline = format!(
                "ws=64M rate=idle prefill=1 verify-ms=0 log-ms=0 heartbeat-ms={heartbeat_ms}"
            );
            let s = Scenario {
                vcpus: n,
                ..Scenario::new(&format!("idle, {n} vCPUs"), GIB, &cmdline, 1)
            };
            let setup = DestinationSetup {
                unprepared,
                ..DestinationSetup::default()
            };
            let m = migrate_into(&s, setup)?;
            let st = &m.stats;
            let d = &st.downtime;
            let load = Split::of(&d.load_parts);
            let save = Split::of(&d.save_parts);
            let dest = if unprepared { "unprepared" } else { "prepared" };
            // The destination's share of the downtime: the load and the resume.
            let destination_ms = d.load_ms + d.resume_ms;
            println!(
                "{:>5} {:<10} {:>8.1} {:>8.2} {:>8.2} {:>9.2} {:>12.1} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.1} {:>9.1}",
                n,
                dest,
                d.state_bytes as f64 / 1024.0,
                d.state_save_ms,
                d.load_ms,
                load.vcpus_ms,
                load.per_vcpu_us(),
                load.devices_ms,
                load.create_ms,
                load.threads_ms,
                d.resume_ms,
                d.total_ms,
                m.pause_ms
            );
            let mut row = json!({
                "bench": "state", "vcpus": n, "destination": dest,
                "state_bytes": d.state_bytes, "save_ms": d.state_save_ms,
                "save_vcpu_us": save.per_vcpu_us(), "load_ms": d.load_ms,
                "load_vcpus_ms": load.vcpus_ms, "load_vcpu_us": load.per_vcpu_us(),
                "load_devices_ms": load.devices_ms,
                "create_vcpus_ms": load.create_ms, "vcpu_threads_ms": load.threads_ms,
                "resume_ms": d.resume_ms, "downtime_ms": d.total_ms,
                "guest_pause_ms": m.pause_ms, "stats": st,
            });
            match reference {
                None => reference = Some(destination_ms),
                Some(r) => {
                    let fraction = destination_ms / r.max(1e-6);
                    println!(
                        "{:>5} load + resume {destination_ms:.2} ms prepared, {r:.2} ms unprepared: {:.0}% of the reference",
                        "",
                        100.0 * fraction
                    );
                    row["fraction_of_unprepared"] = json!(fraction);
                }
            }
            rows.push(row);
            check_parts(st, n)?;
        }
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Both sides named a part for every vCPU: the breakdown is whole.
fn check_parts(st: &MigrationStats, n: u8) -> anyhow::Result<()> {
    let (save, load) = (
        Split::of(&st.downtime.save_parts),
        Split::of(&st.downtime.load_parts),
    );
    anyhow::ensure!(
        save.vcpus == usize::from(n) && load.vcpus == usize::from(n),
        "the downtime breakdown lists {} saved and {} loaded vCPUs of {n}",
        save.vcpus,
        load.vcpus
    );
    Ok(())
}
