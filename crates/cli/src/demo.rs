//! `ferry demo`: ferry's main job on the built-in guest, in one command. Boots a VM whose guest
//! dirties and verifies a working set, boots an empty second VM, migrates the first into the
//! second over loopback TCP while the guest writes, and prints the migration's statistics and
//! the guest's own verdict: its verify passes on the destination, and the pause it saw. Beside
//! the rate it asked the guest for, it prints the rate the guest wrote, before the migration and
//! during it, so a guest that could not keep up (a host too busy, a dirty log that makes writes
//! slow) is seen, not assumed.
//!
//! The VM has a disk too: a sparse image in a temporary directory that the guest writes and
//! reads back. By default both VMs name that image (shared storage); with `--disk-copy` the
//! destination gets a file of its own and the disk goes beside RAM. The verdict counts the
//! blocks the guest found stale or lost, as it counts pages.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferry_guest::rate::WriteRate;
use ferry_migrate::{Phase, TimeoutAction};
use ferry_vmm::devices::telemetry::GuestTelemetry;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::{GuestKind, SerialOutput, StopReason, Vm, VmConfig, VmHandle};

use crate::report::{self, Live, PlainLines};

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Guest RAM of both VMs.
    #[arg(long, default_value = "2G", value_parser = crate::sizes::parse_size)]
    memory: u64,
    /// The guest's working set.
    #[arg(long, default_value = "512M", value_parser = crate::sizes::parse_size)]
    ws: u64,
    /// MB/s the guest writes (10^6 bytes of whole pages, verify passes included; `max` for
    /// flat out): the guest's `rate=`.
    #[arg(long, default_value = "200")]
    rate: String,
    /// seq, random or hotcold.
    #[arg(long, default_value = "random")]
    pattern: String,
    /// Longest pause the switchover may cause at the measured bandwidth.
    #[arg(long, default_value_t = crate::migrate::ms(MigrationRequest::default().downtime_limit_ms))]
    downtime_limit: humantime::Duration,
    /// Cap on the send rate in bytes per second, e.g. 500M.
    #[arg(long, value_parser = crate::sizes::parse_size)]
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
    /// The part of the disk the guest writes and reads back (its `disk=`); 0: no disk.
    #[arg(long, default_value = "32M", value_parser = crate::sizes::parse_size)]
    disk: u64,
    /// MB/s the guest writes its disk (its `disk-rate=`).
    #[arg(long, default_value_t = 10)]
    disk_rate: u64,
    /// Copy the disk to a file of the destination's own beside RAM, instead of both VMs
    /// naming one image.
    #[arg(long)]
    disk_copy: bool,
}

/// The demo's disk image: four times what the guest writes, sparse.
const IMAGE_FACTOR: u64 = 4;

/// Longest the demo waits for any one stage.
const STAGE_TIMEOUT: Duration = Duration::from_secs(120);

/// Verify cycles (a pass and the writing after it) the rate before the migration is measured
/// over: the guest keeps its rate over a whole cycle, not within one (it writes nothing while it
/// verifies, and makes that up while it writes), and two take about a second with the demo's
/// 300 ms interval.
const STEADY_CYCLES: u64 = 2;

/// `--rate` as the guest reads it.
fn asked(rate: &str) -> String {
    match rate.parse::<u32>() {
        Ok(mb) => format!("{mb} MB/s"),
        Err(_) => format!("rate={rate}"),
    }
}

/// The guest's pages written as of its last report, and when the host received it.
#[derive(Debug, Clone, Copy)]
struct Written {
    pages: u64,
    host_ns: u64,
}

impl Written {
    fn of(t: &GuestTelemetry) -> Written {
        Written {
            pages: t.pages_written,
            host_ns: t.last_report_host_ns.unwrap_or(0),
        }
    }

    /// As [`Written::of`], with the clock moved back by the last verify pass: the writing
    /// after a pass makes up for it, so a cycle is the pass and the writing after it, and a
    /// window of whole cycles starts where a pass did (from where it ended, a longer pass at
    /// its start than at its end read as a rate above the asked one).
    fn at_cycle(t: &GuestTelemetry) -> Written {
        let pass_ns = t.last_verify.as_ref().map_or(0, |v| v.duration_ns);
        let now = Written::of(t);
        Written {
            host_ns: now.host_ns.saturating_sub(pass_ns),
            ..now
        }
    }

    /// The rate from `self` to `later`, in the guest's unit and shape (`398.2 MB/s`).
    fn rate_until(&self, later: &Written) -> WriteRate {
        WriteRate {
            pages: later.pages.saturating_sub(self.pages),
            ns: later.host_ns.saturating_sub(self.host_ns),
        }
    }
}

pub fn demo(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    let mut cmdline = format!(
        "ws={}M rate={} pattern={} verify-ms=300 heartbeat-ms=5 log-ms=0",
        args.ws >> 20,
        args.rate,
        args.pattern
    );
    let images = tempfile::tempdir().context("cannot make a directory for the disk images")?;
    let source_image = images.path().join("disk.img");
    if args.disk > 0 {
        cmdline += &format!(" disk={}K disk-rate={}", args.disk >> 10, args.disk_rate);
        std::fs::File::create(&source_image)
            .and_then(|f| f.set_len(args.disk * IMAGE_FACTOR))
            .with_context(|| format!("cannot make the disk image {}", source_image.display()))?;
    }
    let disk_at = |path: &std::path::Path| -> anyhow::Result<Option<ferry_vmm::DiskOptions>> {
        Ok(match args.disk {
            0 => None,
            _ => Some(path.to_string_lossy().parse()?),
        })
    };
    let config = VmConfig {
        memory_bytes: args.memory,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: cmdline.clone(),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::Discard,
        balloon: true,
        disk: disk_at(&source_image)?,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout: false,
    };
    println!(
        "ferry demo: source VM, {} MiB RAM, guest `{cmdline}`",
        args.memory >> 20
    );
    let source = Vm::boot(config.clone())?;
    let src = source.handle();
    // The rate over whole verify cycles, from the end of the second pass: the first reads
    // memory the host has not mapped yet (2.6 s for 1 GiB on a nested host), a setup cost.
    let steady = wait(&src, "two verify passes on the source", |g| {
        g.verify_passes >= 2
    })?;
    let before = wait(&src, "two more verify passes on the source", |g| {
        g.verify_passes >= steady.verify_passes + STEADY_CYCLES
    })?;
    let written_before = Written::at_cycle(&steady).rate_until(&Written::at_cycle(&before));
    println!(
        "ferry demo: guest running: asked {}, writing {written_before} over its last {STEADY_CYCLES} verify cycles; {} verify passes, {} failed",
        asked(&args.rate),
        before.verify_passes,
        before.verify_failures
    );

    let listener = TcpListener::bind("127.0.0.1:0").context("cannot listen on loopback")?;
    let to = listener.local_addr()?.to_string();
    let destination_image = match args.disk_copy {
        true => images.path().join("copy.img"),
        false => source_image.clone(),
    };
    let mut incoming = Vm::incoming(VmConfig {
        disk: disk_at(&destination_image)?,
        net: None,
        ..config
    })?;
    println!("ferry demo: destination VM waiting on {to}; migrating");
    let request = MigrationRequest {
        downtime_limit_ms: args.downtime_limit.as_millis() as u64,
        timeout_ms: Some(60_000),
        timeout_action: TimeoutAction::Switchover,
        max_bandwidth: args.max_bandwidth,
        channels: args.channels,
        zero_detection: args.zero_detection.into(),
        disk_copy: args.disk_copy && args.disk > 0,
        ..MigrationRequest::to(to)
    };
    let migrating = Written::of(&src.telemetry());
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
        // The table only: the same figures as JSON go to --stats-out.
        report::print_table(stats);
        if let Some(path) = &args.stats_out {
            report::write_stats(path, stats, None)?;
        }
    }
    // The source's last report came just before the switchover paused the guest.
    let during = migrating.rate_until(&Written::of(&src.telemetry()));
    println!(
        "guest writes          asked {}: wrote {written_before} before the migration, {during} during it ({} pages in {:.1} s)",
        asked(&args.rate),
        during.pages,
        during.ns as f64 / 1e9,
    );
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
    // With a disk, also two whole sweeps of it begun after the resume: every block the guest
    // wrote, read back on the destination.
    let sweeps = |g: &GuestTelemetry| g.disk.as_ref().map_or(0, |d| d.sweeps);
    let after = wait(&dst, "verify passes on the destination", |g| {
        g.verify_passes >= resumed.verify_passes + args.verify_passes
            && (args.disk == 0 || sweeps(g) >= sweeps(&resumed) + 2)
    })?;
    src.stop(StopReason::Requested("demo done".into()));
    dst.stop(StopReason::Requested("demo done".into()));

    let disk_clean = match &after.disk {
        Some(d) => {
            println!(
                "guest disk            {} blocks written, {} read back ({} whole sweeps on the destination), {} bad, {} request errors{}",
                d.blocks_written,
                d.blocks_read,
                d.sweeps - sweeps(&resumed),
                d.verify_failures,
                d.request_errors,
                match args.disk_copy {
                    true => "; the disk was copied beside RAM",
                    false => "; both VMs named one image (shared storage)",
                }
            );
            d.verify_failures == 0 && d.request_errors == 0
        }
        None if args.disk > 0 => bail!("the guest reported nothing about its disk"),
        None => true,
    };
    let clean = after.verify_failures == 0 && disk_clean;
    println!(
        "guest verdict: {} — {} verify passes on the destination after the migration ({} in all), {} bad pages; heartbeats {} -> {}; pause the guest saw across the migration {:.1} ms, its clocks {}",
        match (clean, after.verify_failures) {
            (true, _) => "CLEAN",
            (false, 0) => "BLOCKS LOST",
            (false, _) => "PAGES LOST",
        },
        after.verify_passes - resumed.verify_passes,
        after.verify_passes,
        after.bad_pages_total,
        resumed.heartbeats,
        after.heartbeats,
        after.migration_pause_ns.unwrap_or(0) as f64 / 1e6,
        clocks_across(&after),
    );
    Ok(if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The guest's clocks across the migration, as its destination saw them: the clock jump
/// against the host's clock (0 when they advanced by the pause and no more) and the gap the
/// guest itself saw on kvmclock and on its TSC.
fn clocks_across(g: &GuestTelemetry) -> String {
    let Some(m) = g.migration_clocks else {
        return "not measured".into();
    };
    let jump = m
        .clock_jump_ns
        .map_or("unknown".into(), |j| format!("{:+.3} ms", j as f64 / 1e6));
    let gap = match m.guest_gap {
        Some(gap) => format!(
            "; its own gap {:.1} ms on kvmclock, {} on its TSC",
            gap.kvmclock_ns as f64 / 1e6,
            gap.tsc_ns
                .map_or("unknown".into(), |ns| format!("{:.1} ms", ns as f64 / 1e6))
        ),
        None => String::new(),
    };
    format!("jumped {jump} against the host's{gap}")
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
