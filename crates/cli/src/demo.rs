//! `ferry demo`: ferry's main job on the built-in guest, in one command. Boots a VM whose guest
//! dirties and verifies a working set, boots an empty second VM, migrates the first into the
//! second over loopback TCP while the guest writes, and prints the migration's statistics and
//! the guest's own verdict: its verify passes on the destination, and the pause it saw.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferry_migrate::{Phase, Policy, TimeoutAction};
use ferry_vmm::devices::telemetry::GuestTelemetry;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::{GuestKind, SerialOutput, StopReason, Vm, VmConfig, VmHandle};

use crate::report::{self, Live, PlainLines};

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Guest RAM of both VMs.
    #[arg(long, default_value = "2G", value_parser = crate::parse_size)]
    memory: u64,
    /// The guest's working set.
    #[arg(long, default_value = "512M", value_parser = crate::parse_size)]
    ws: u64,
    /// The guest's dirty rate in MB/s (`max` for flat out).
    #[arg(long, default_value = "200")]
    rate: String,
    /// seq, random or hotcold.
    #[arg(long, default_value = "random")]
    pattern: String,
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    downtime_limit: Duration,
    /// Cap on the send rate in bytes per second, e.g. 500M.
    #[arg(long, value_parser = crate::parse_size)]
    max_bandwidth: Option<u64>,
    /// Verify passes the guest must complete on the destination before the verdict.
    #[arg(long, default_value_t = 3)]
    verify_passes: u64,
    /// Data channels (QEMU: multifd-channels).
    #[arg(long, default_value_t = ferry_migrate::source::DEFAULT_CHANNELS)]
    channels: u16,
    /// Where zero pages are found: inline (sender threads), offload (a scanning thread), none.
    #[arg(long, value_enum, default_value = "inline")]
    zero_detection: crate::migrate::ZeroDetectionArg,
    /// Write the migration's statistics, with their timeline, as JSON here (for `ferry report`).
    #[arg(long, value_name = "FILE.json")]
    stats_out: Option<PathBuf>,
}

/// Longest the demo waits for any one stage.
const STAGE_TIMEOUT: Duration = Duration::from_secs(120);

pub fn demo(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    let cmdline = format!(
        "ws={}M rate={} pattern={} verify-ms=300 heartbeat-ms=5 log-ms=0",
        args.ws >> 20,
        args.rate,
        args.pattern
    );
    let config = VmConfig {
        memory_bytes: args.memory,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: cmdline.clone(),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::Discard,
        balloon: true,
        host_pages: Default::default(),
    };
    println!(
        "ferry demo: source VM, {} MiB RAM, guest `{cmdline}`",
        args.memory >> 20
    );
    let source = Vm::boot(config.clone())?;
    let src = source.handle();
    let before = wait(&src, "two verify passes on the source", |g| {
        g.verify_passes >= 2
    })?;
    println!(
        "ferry demo: guest running: writing {:.0} MB/s, {} verify passes, {} failed",
        before.write_rate_mb_s, before.verify_passes, before.verify_failures
    );

    let listener = TcpListener::bind("127.0.0.1:0").context("cannot listen on loopback")?;
    let to = listener.local_addr()?.to_string();
    let mut incoming = Vm::incoming(config)?;
    println!("ferry demo: destination VM waiting on {to}; migrating");
    let mut request = MigrationRequest::new(
        to,
        Policy {
            downtime_limit: args.downtime_limit,
            timeout: Some(Duration::from_secs(60)),
            timeout_action: TimeoutAction::Switchover,
            ..Policy::default()
        },
    );
    request.max_bandwidth = args.max_bandwidth;
    request.channels = args.channels;
    request.zero = args.zero_detection.into();
    let received = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let deadline = Instant::now() + STAGE_TIMEOUT;
            migration::receive(&mut incoming, &listener, &|| Instant::now() < deadline)
        });
        let started = src.start_migration(request).map_err(anyhow::Error::from);
        let progress = started.and_then(|_| follow(&src));
        (progress, receiver.join().expect("receiver thread"))
    });
    let (progress, received) = received;
    let progress = progress?;
    if let Some(stats) = &progress.stats {
        report::print_stats(stats);
        if let Some(path) = &args.stats_out {
            report::write_stats(path, stats)?;
        }
    }
    if progress.phase != Phase::Completed {
        bail!(
            "migration {:?}: {}",
            progress.phase,
            progress.error.unwrap_or_default()
        );
    }
    received.context("the destination failed")?;
    let destination = incoming
        .into_running()
        .context("the destination did not resume")?;
    let dst = destination.handle();
    let resumed = dst.telemetry();
    let after = wait(&dst, "verify passes on the destination", |g| {
        g.verify_passes >= resumed.verify_passes + args.verify_passes
    })?;
    src.stop(StopReason::Requested("demo done".into()));
    dst.stop(StopReason::Requested("demo done".into()));

    let clean = after.verify_failures == 0;
    println!(
        "guest verdict: {} — {} verify passes on the destination after the migration ({} in all), {} bad pages; heartbeats {} -> {}; pause the guest saw across the migration {:.1} ms",
        if clean { "CLEAN" } else { "PAGES LOST" },
        after.verify_passes - resumed.verify_passes,
        after.verify_passes,
        after.bad_pages_total,
        resumed.heartbeats,
        after.heartbeats,
        after.migration_pause_ns.unwrap_or(0) as f64 / 1e6,
    );
    Ok(if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn follow(src: &VmHandle) -> anyhow::Result<ferry_migrate::Progress> {
    let deadline = Instant::now() + STAGE_TIMEOUT;
    let mut live = Live::new(PlainLines::PerPassToStdout);
    loop {
        let p = src.migration().context("no migration")?;
        live.update(&p);
        if matches!(p.phase, Phase::Completed | Phase::Failed | Phase::Cancelled) {
            live.finish();
            return Ok(p);
        }
        if Instant::now() > deadline {
            bail!("the migration did not finish within {STAGE_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait(
    h: &VmHandle,
    what: &str,
    done: impl Fn(&GuestTelemetry) -> bool,
) -> anyhow::Result<GuestTelemetry> {
    let deadline = Instant::now() + STAGE_TIMEOUT;
    loop {
        let t = h.telemetry();
        if done(&t) {
            return Ok(t);
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}: {:?}", h.status().stop_reason);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
