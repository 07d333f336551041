//! `ferry migrate-set`: change a running migration's settings (`PATCH /migration`), as QEMU's
//! migrate-set-parameters and virsh's migrate-setmaxdowntime and migrate-setspeed do.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ferry_migrate::{Progress, Settings};
use ferry_vmm::api::client;
use serde_json::json;

use crate::migrate::OnOff;

/// Longest `ferry migrate-set` waits to see the settings in force: a migration takes them at
/// its next step, a batch of at most 2 MiB.
const IN_FORCE_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("setting").required(true).multiple(true))]
pub struct SetArgs {
    /// The source VM's API socket.
    #[arg(long)]
    api_socket: PathBuf,
    /// The longest pause the switchover may cause, e.g. 500ms (QEMU: downtime-limit).
    #[arg(long, group = "setting", value_parser = humantime::parse_duration)]
    downtime_limit: Option<Duration>,
    /// Cap on the send rate in bytes per second, e.g. 100M, or `unlimited`; the new cap is an
    /// average from now on (QEMU: max-bandwidth).
    #[arg(long, group = "setting", value_parser = parse_bandwidth, value_name = "SIZE|unlimited")]
    max_bandwidth: Option<Bandwidth>,
    /// Give up converging this long after the migration started (with the action it was
    /// started with), e.g. 10m, or `none`.
    #[arg(long, group = "setting", value_parser = parse_timeout, value_name = "DURATION|none")]
    timeout: Option<Timeout>,
    /// Throttle the guest when precopy stalls; `off` also lifts a throttle in force.
    #[arg(long, group = "setting", value_enum, value_name = "on|off")]
    auto_converge: Option<OnOff>,
    /// Auto-converge's highest throttle, percent (1 to 99); a throttle above it is lowered.
    #[arg(long, group = "setting", value_parser = clap::value_parser!(u8).range(1..=99), value_name = "PERCENT", conflicts_with = "auto_converge")]
    max_throttle: Option<u8>,
}

/// `--max-bandwidth`: bytes per second, `None` for `unlimited`.
#[derive(Clone, Copy, Debug)]
struct Bandwidth(Option<u64>);

/// `--timeout`: `None` for `none`.
#[derive(Clone, Copy, Debug)]
struct Timeout(Option<Duration>);

fn parse_bandwidth(s: &str) -> Result<Bandwidth, String> {
    match s {
        "unlimited" => Ok(Bandwidth(None)),
        s => match crate::sizes::parse_size(s)? {
            0 => Err(
                "a limit of 0 would never send a page; give a positive size, or `unlimited`".into(),
            ),
            n => Ok(Bandwidth(Some(n))),
        },
    }
}

fn parse_timeout(s: &str) -> Result<Timeout, String> {
    match s {
        "none" => Ok(Timeout(None)),
        s => humantime::parse_duration(s)
            .map(|t| Timeout(Some(t)))
            .map_err(|e| format!("{e}; write a duration such as 90s or 10m, or `none`")),
    }
}

/// `ferry migrate-set`: asks for the settings, then waits until the migration shows them in
/// force and prints them.
pub fn set(args: &SetArgs) -> anyhow::Result<ExitCode> {
    let mut body = serde_json::Map::new();
    if let Some(d) = args.downtime_limit {
        body.insert("downtime_limit_ms".into(), json!(d.as_millis() as u64));
    }
    if let Some(Bandwidth(b)) = args.max_bandwidth {
        body.insert("max_bandwidth".into(), json!(b));
    }
    if let Some(Timeout(t)) = args.timeout {
        body.insert("timeout_ms".into(), json!(t.map(|t| t.as_millis() as u64)));
    }
    if let Some(on) = args.auto_converge {
        body.insert("auto_converge".into(), json!(on == OnOff::On));
    }
    if let Some(max) = args.max_throttle {
        body.insert("max_throttle".into(), json!(max));
    }
    let body = serde_json::Value::Object(body);
    client::request_with_body(&args.api_socket, "PATCH", "/migration", &body.to_string())?;
    let deadline = Instant::now() + IN_FORCE_WAIT;
    loop {
        let p: Progress =
            serde_json::from_value(client::request(&args.api_socket, "GET", "/migration")?)
                .context("the VMM's answer to GET /migration")?;
        if in_force(&body, &p.settings) {
            println!("ferry: settings in force: {}", describe(&p.settings));
            return Ok(ExitCode::SUCCESS);
        }
        if !p.phase.is_active() || Instant::now() > deadline {
            anyhow::bail!(
                "the migration ({}) did not take the settings; in force: {}",
                crate::report::phase_name(p.phase),
                describe(&p.settings)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `settings` hold what `asked` (a `PATCH /migration` body) asked for.
fn in_force(asked: &serde_json::Value, settings: &Settings) -> bool {
    let asked = |field: &str, now: serde_json::Value| asked.get(field).is_none_or(|a| *a == now);
    asked("downtime_limit_ms", json!(settings.downtime_limit_ms))
        && asked("max_bandwidth", json!(settings.max_bandwidth))
        && asked("timeout_ms", json!(settings.timeout_ms))
        && asked("auto_converge", json!(settings.max_throttle.is_some()))
        && asked("max_throttle", json!(settings.max_throttle))
}

/// Settings for a person: "downtime limit 500 ms, bandwidth unlimited, timeout none,
/// auto-converge up to 99%".
pub fn describe(s: &Settings) -> String {
    format!(
        "downtime limit {} ms, bandwidth {}, timeout {}, auto-converge {}",
        s.downtime_limit_ms,
        s.max_bandwidth.map_or("unlimited".into(), |b| format!(
            "{:.1} MB/s",
            b as f64 / 1e6
        )),
        s.timeout_ms
            .map_or("none".into(), |t| format!("{:.1} s", t as f64 / 1e3)),
        s.max_throttle
            .map_or("off".into(), |m| format!("up to {m}%")),
    )
}
