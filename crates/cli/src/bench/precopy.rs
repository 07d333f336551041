//! `ferry bench precopy`: precopy on the built-in guest, scenario by scenario, against a raw
//! single-stream loopback TCP transfer of the same byte count measured in the same run.
//!
//! Scenarios (issue 3's list): an idle 8 GiB guest with 256 MiB touched; 2 GiB of random data
//! with the guest idle; a 1 GiB working set dirtied at 100, 400 and 1000 MB/s with downtime
//! limits of 300 and 50 ms. Each migrates between two VMs of this process over loopback with a
//! 30 s timeout that forces the switchover, so every row has a downtime; `converged` says
//! whether the limit or the timeout ended precopy. One data channel, to match the one
//! reference stream (`ferry bench channels` measures more).
//!
//! Then an idle 8 GiB guest that never touched its RAM, five times with free page hints and once
//! without (`--untouched-only` runs only these).
//!
//! Then the cases precopy alone does not finish, across a link capped at 1 GB/s (see
//! `link.rs`): a 1 GiB working set dirtied at 1000 MB/s and flat out, migrated with precopy
//! alone, with the default policy, and with postcopy on a stall; each row says how it finished,
//! in how long, what the guest saw (pause, longest stall, throttle) and the bytes sent.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferry_migrate::source::PostcopyOrder;
use ferry_migrate::source::Preempt;
use ferry_migrate::transport::Listener;
use ferry_migrate::transport::tls::pki::Ca;
use ferry_migrate::transport::tls::{DestinationTls, Side, SourceTls, TlsFiles};
use ferry_migrate::{MigrationStats, PageLanding, Phase, TimeoutAction};
use ferry_vmm::devices::telemetry::GuestTelemetry;
use ferry_vmm::memory::HostPages;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::request::{Checksum, MigrationMode, PostcopyRequest};
use ferry_vmm::{GuestKind, Preparation, SerialOutput, StopReason, Vm, VmConfig, VmHandle};
use serde_json::json;

use super::link::{CappedLink, Queue};

#[derive(Debug, Args)]
pub struct PrecopyBenchArgs {
    /// Only the first N scenarios (for a quick look).
    #[arg(long)]
    only: Option<usize>,
    /// Draw each scenario's migration into `DIR/<scenario>.svg` (see `ferry report`).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// Only the capped-link cases that precopy alone does not finish.
    #[arg(long)]
    capped_only: bool,
    /// Only the idle 8 GiB guest that never touched its RAM, five runs and the reference.
    #[arg(long, conflicts_with = "capped_only")]
    untouched_only: bool,
}

/// One migration to measure.
pub(super) struct Scenario {
    pub name: String,
    pub memory: u64,
    pub cmdline: String,
    pub downtime: Duration,
    pub channels: u16,
    /// Switch to postcopy after pass 1 (with the preempt connection if `true`); `None`:
    /// precopy only.
    pub postcopy: Option<bool>,
    /// Guest RAM on both sides on these host pages.
    pub host_pages: HostPages,
    /// With postcopy's preempt connection: mark it urgent (the default).
    pub preempt_priority: bool,
    /// How precopy is brought to an end.
    pub finish: Finish,
    /// Skip the pages the guest's balloon hints free (the default).
    pub free_page_hints: bool,
    /// vCPUs of both VMs.
    pub vcpus: u8,
    /// Every connection over mutual TLS, with a PKI made for the run.
    pub tls: bool,
    /// Page data checksummed too (`--checksum pages`).
    pub checksum_pages: bool,
    /// With postcopy: the background push's order.
    pub postcopy_order: PostcopyOrder,
    /// How precopy's pages are compressed (`--compression`).
    pub compression: ferry_migrate::Compression,
    /// The bandwidth limit, bytes per second (`--max-bandwidth`).
    pub max_bandwidth: Option<u64>,
    /// Both VMs track dirty pages with a dirty ring of this many entries (`--dirty-ring`).
    pub dirty_ring: Option<u32>,
    /// How auto-converge slows the guest (with [`Finish::Careful`]).
    pub converge_by: ferry_migrate::ConvergeBy,
    /// How long the guest runs after its prefill before the migration starts, measured
    /// ([`Migrated::settled`]).
    pub settle: Duration,
    /// A disk: the source's image, the destination's (the same path for shared storage), and
    /// whether the migration copies it (`disk_copy`).
    pub disk: Option<BenchDisk>,
}

/// A bench VM's disk ([`Scenario::disk`]).
#[derive(Clone, Debug)]
pub(super) struct BenchDisk {
    pub source: std::path::PathBuf,
    pub destination: std::path::PathBuf,
    pub copy: bool,
}

/// How a bench migration's precopy ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Finish {
    /// Precopy alone: no auto-converge, the switchover forced after 30 s, so every row has a
    /// downtime and `converged` says whether the limit or the timeout ended it; with postcopy,
    /// the switch comes after pass 1.
    Forced,
    /// The default policy (auto-converge), with a 60 s forced switchover as a backstop.
    Careful,
    /// Postcopy (with its preempt connection) when precopy stalls; else the default policy.
    PostcopyOnStall,
    /// Postcopy allowed, the prediction choosing (`--postcopy-auto`); else the default policy.
    PostcopyAuto,
}

impl Scenario {
    /// A scenario with a 300 ms downtime limit.
    pub fn new(name: &str, memory: u64, cmdline: &str, channels: u16) -> Scenario {
        Scenario {
            name: name.into(),
            memory,
            cmdline: cmdline.into(),
            downtime: Duration::from_millis(300),
            channels,
            postcopy: None,
            host_pages: HostPages::Small,
            preempt_priority: true,
            finish: Finish::Forced,
            free_page_hints: true,
            vcpus: 1,
            tls: false,
            checksum_pages: false,
            postcopy_order: PostcopyOrder::default(),
            compression: ferry_migrate::Compression::Off,
            max_bandwidth: None,
            dirty_ring: None,
            converge_by: ferry_migrate::ConvergeBy::Throttle,
            settle: Duration::ZERO,
            disk: None,
        }
    }
}

const GIB: u64 = 1 << 30;
/// Blocks a destination's guest with a disk reads back before a bench takes its figures.
const DISK_READS_AFTER: u64 = 1000;
/// Heartbeats every 2 ms: the guest-observed pause is measured to that resolution.
pub(super) const GUEST: &str = "prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2";

fn scenarios() -> Vec<Scenario> {
    let mut v = vec![
        Scenario::new(
            "idle 8G, 256M touched",
            8 * GIB,
            &format!("ws=256M rate=1 {GUEST}"),
            1,
        ),
        Scenario::new(
            "2G random data, idle",
            3 * GIB,
            &format!("ws=2G fill=random rate=1 {GUEST}"),
            1,
        ),
    ];
    for rate in [100, 400, 1000] {
        for limit in [300, 50] {
            v.push(Scenario {
                downtime: Duration::from_millis(limit),
                ..Scenario::new(
                    &format!("1G ws @ {rate} MB/s, {limit} ms"),
                    2 * GIB,
                    &format!("ws=1G pattern=random rate={rate} {GUEST}"),
                    1,
                )
            });
        }
    }
    v
}

pub fn run(args: &PrecopyBenchArgs) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    if !args.capped_only && !args.untouched_only {
        rows.extend(loopback_rows(args)?);
    }
    if !args.capped_only {
        rows.extend(untouched_rows()?);
    }
    if !args.untouched_only {
        rows.extend(capped_rows(args)?);
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The scenarios over loopback, each against the raw TCP reference.
fn loopback_rows(args: &PrecopyBenchArgs) -> anyhow::Result<Vec<serde_json::Value>> {
    println!(
        "{:<26} {:>5} {:>9} {:>9} {:>9} {:>6} {:>9} {:>8} {:>8} {:>6}",
        "scenario",
        "conv",
        "total ms",
        "down ms",
        "pause ms",
        "passes",
        "MB sent",
        "MB/s",
        "raw MB/s",
        "ratio"
    );
    let mut rows = Vec::new();
    for s in scenarios()
        .into_iter()
        .take(args.only.unwrap_or(usize::MAX))
    {
        let (stats, pause_ms) =
            migrate_once(&s).with_context(|| format!("scenario '{}'", s.name))?;
        if let Some(dir) = &args.report {
            crate::report::write_scenario_svg(dir, &s.name, &stats)?;
        }
        let sending_ms: f64 = stats.passes.iter().map(|p| p.duration_ms).sum();
        let data_mb_s = stats.bytes_sent as f64 / 1e3 / sending_ms.max(1e-3);
        let raw_mb_s = super::raw_tcp::raw_tcp(stats.bytes_sent.max(1 << 20))? / 1e6;
        println!(
            "{:<26} {:>5} {:>9.0} {:>9.1} {:>9.1} {:>6} {:>9.1} {:>8.0} {:>8.0} {:>6.2}",
            s.name,
            if stats.converged { "yes" } else { "no" },
            stats.total_ms,
            stats.downtime.total_ms,
            pause_ms,
            stats.passes.len(),
            stats.bytes_sent as f64 / 1e6,
            data_mb_s,
            raw_mb_s,
            data_mb_s / raw_mb_s
        );
        rows.push(json!({
            "bench": "precopy", "scenario": s.name, "downtime_limit_ms": s.downtime.as_millis() as u64,
            "converged": stats.converged, "total_ms": stats.total_ms, "downtime_ms": stats.downtime.total_ms,
            "guest_pause_ms": pause_ms, "passes": stats.passes.len(), "bytes_sent": stats.bytes_sent,
            "data_mb_s": data_mb_s, "raw_tcp_mb_s": raw_mb_s, "ratio": data_mb_s / raw_mb_s,
            "stats": stats,
        }));
    }
    Ok(rows)
}

/// Runs of [`untouched_rows`] with hints on.
const UNTOUCHED_RUNS: usize = 5;

/// An idle 8 GiB guest that never touched its RAM, with the default policy, [`UNTOUCHED_RUNS`]
/// times with free page hints on (the default) and once with them off, the reference in the
/// same run: every round of hints writes the balloon driver's few pages, so no pass of this
/// guest is ever clean, and the hinted runs should cost what the reference costs (an earlier
/// build measured the send rate over the idle time too, and took ~2 s here).
fn untouched_rows() -> anyhow::Result<Vec<serde_json::Value>> {
    println!();
    println!("an idle 8 GiB guest that never touched its RAM (default policy, 300 ms limit)");
    println!(
        "{:<12} {:>9} {:>9} {:>8} {:>6} {:>7} {:>8}",
        "hints", "total ms", "setup ms", "down ms", "passes", "rounds", "drain ms"
    );
    let mut rows = Vec::new();
    let runs = std::iter::repeat_n(true, UNTOUCHED_RUNS).chain([false]);
    for (run, hints) in runs.enumerate() {
        let s = Scenario {
            finish: Finish::Careful,
            free_page_hints: hints,
            ..Scenario::new(
                "idle 8G, untouched",
                8 * GIB,
                &format!("ws=4K rate=1 {GUEST}"),
                ferry_migrate::source::DEFAULT_CHANNELS,
            )
        };
        let (st, pause_ms) = migrate_once(&s).with_context(|| format!("idle run {}", run + 1))?;
        let label = match hints {
            true => format!("on, run {}", run + 1),
            false => "off".into(),
        };
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>8.1} {:>6} {:>7} {:>8.1}",
            label,
            st.total_ms,
            st.setup_ms,
            st.downtime.total_ms,
            st.passes.len(),
            st.hint_rounds,
            st.drain_ms
        );
        rows.push(json!({
            "bench": "precopy", "scenario": "idle 8G, untouched", "free_page_hints": hints,
            "total_ms": st.total_ms, "setup_ms": st.setup_ms, "downtime_ms": st.downtime.total_ms,
            "guest_pause_ms": pause_ms, "passes": st.passes.len(), "hint_rounds": st.hint_rounds,
            "drain_ms": st.drain_ms, "stats": st,
        }));
    }
    Ok(rows)
}

/// The cases precopy alone may not finish: a 1 GiB working set dirtied in sequence (every
/// page of it once per sweep, the most unique pages per write) at 1000 MB/s and flat out,
/// across a link capped at 1 GB/s and at 250 MB/s, with precopy alone (forced at 30 s), the
/// default policy (auto-converge), and postcopy on a stall.
fn capped_rows(args: &PrecopyBenchArgs) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    for (link_name, rate) in [("1 GB/s", "8gbit"), ("250 MB/s", "2gbit")] {
        let link = match CappedLink::with_rate(rate, Queue::Fifo) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "ferry bench precopy: NO CAPPED LINK, its rows are skipped: {e:#} (run as root with iproute2's ip and tc)"
                );
                return Ok(rows);
            }
        };
        rows.extend(capped_link_rows(args, link_name, &link)?);
    }
    Ok(rows)
}

/// [`capped_rows`] on one link.
fn capped_link_rows(
    args: &PrecopyBenchArgs,
    link_name: &str,
    link: &CappedLink,
) -> anyhow::Result<Vec<serde_json::Value>> {
    println!();
    println!(
        "finishing on a link capped at {link_name} (2 GiB guest, 1 GiB working set, 300 ms limit)"
    );
    println!(
        "{:<22} {:<17} {:<22} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "guest",
        "policy",
        "how it finished",
        "total ms",
        "down ms",
        "pause ms",
        "stall ms",
        "throttle",
        "MB sent"
    );
    let mut rows = Vec::new();
    for rate in ["1000", "max"] {
        for (finish, name) in [
            (Finish::Forced, "precopy alone"),
            (Finish::Careful, "default"),
            (Finish::PostcopyOnStall, "postcopy on stall"),
        ] {
            let guest = match rate {
                "max" => "1G ws flat out".to_string(),
                r => format!("1G ws @ {r} MB/s"),
            };
            let s = Scenario {
                postcopy: (finish == Finish::PostcopyOnStall).then_some(true),
                finish,
                ..Scenario::new(
                    &format!("{guest}, capped {link_name}, {name}"),
                    2 * GIB,
                    &format!("ws=1G rate={rate} {GUEST}"),
                    2,
                )
            };
            let m = migrate_over(&s, DestinationSetup::default(), link.listener()?)
                .with_context(|| format!("scenario '{}'", s.name))?;
            if let Some(dir) = &args.report {
                crate::report::write_scenario_svg(dir, &s.name, &m.stats)?;
            }
            let st = &m.stats;
            let how = match &st.postcopy {
                Some(pc) => format!("postcopy after pass {}", pc.after_passes),
                None if st.converged && st.throttle_max_percent > 0 => {
                    format!("throttled to {}%", st.throttle_max_percent)
                }
                None if st.converged => "converged".into(),
                None => "forced at the timeout".into(),
            };
            let stall_ms = m.guest.max_batch_ns as f64 / 1e6;
            println!(
                "{:<22} {:<17} {:<22} {:>9.0} {:>8.1} {:>9.1} {:>9.1} {:>8}% {:>9.0}",
                guest,
                name,
                how,
                st.total_ms,
                st.downtime.total_ms,
                m.pause_ms,
                stall_ms,
                st.throttle_max_percent,
                st.bytes_sent as f64 / 1e6
            );
            rows.push(json!({
                "bench": "precopy", "scenario": s.name, "link": format!("capped {link_name}"), "policy": name,
                "finished_by": how, "total_ms": st.total_ms, "downtime_ms": st.downtime.total_ms,
                "guest_pause_ms": m.pause_ms, "guest_stall_ms": stall_ms,
                "throttle_max_percent": st.throttle_max_percent, "bytes_sent": st.bytes_sent,
                "stats": st,
            }));
        }
    }
    Ok(rows)
}

/// How the destination VM is readied before the source connects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum DestinationRam {
    /// Left sparse: pages are allocated as they arrive.
    #[default]
    Sparse,
    /// Every page populated first with `GuestRam::prealloc` on one thread per core (what
    /// `ferry run --incoming --prealloc` does), timed apart from the migration.
    Prealloc,
    /// Left sparse, but the ranges the source holds data in are populated by one thread while
    /// the migration runs: what a source announcing its populated extents at setup would let a
    /// destination do (measured in `ferry bench ingest`; not a protocol feature).
    Alongside,
}

/// The destination of one measured migration.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DestinationSetup {
    pub ram: DestinationRam,
    /// How pages land; `None` lets the VMM choose (by whether RAM was preallocated).
    pub landing: Option<PageLanding>,
    /// Whether vCPUs and their threads are made before the switchover (the default).
    pub unprepared: bool,
}

/// One measured migration.
pub(super) struct Migrated {
    pub stats: MigrationStats,
    /// The pause the guest saw (ms), from its heartbeats.
    pub pause_ms: f64,
    /// How long preallocating the destination took, before the migration started.
    pub prealloc: Option<Duration>,
    /// The destination guest's telemetry once the migration completed (its longest write
    /// batch includes the pause and any postcopy stall).
    pub guest: GuestTelemetry,
    /// The source guest's telemetry when the migration started and when it ended: what the
    /// guest got done meanwhile.
    pub source_guest: [GuestTelemetry; 2],
    /// What the destination measured.
    pub received: ferry_migrate::destination::ReceiveStats,
    /// The source guest's telemetry at the start and end of [`Scenario::settle`]: what it
    /// got done before the migration.
    pub settled: [GuestTelemetry; 2],
}

/// Both sides' TLS from a CA made for this run (its files live only while they are read).
fn run_pki() -> anyhow::Result<(Arc<SourceTls>, Arc<DestinationTls>)> {
    let dir = std::env::temp_dir().join(format!("ferry-bench-pki-{}", std::process::id()));
    let made = (|| -> anyhow::Result<_> {
        Ca::new("ferry bench CA")?.write_dir(
            &dir,
            &["127.0.0.1".to_string()],
            &["ferry-bench".to_string()],
        )?;
        Ok((
            Arc::new(SourceTls::new(&TlsFiles::in_dir(&dir, Side::Source), None)?),
            Arc::new(DestinationTls::new(
                &TlsFiles::in_dir(&dir, Side::Destination),
                &[],
            )?),
        ))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    made
}

/// Boots the scenario's guest, waits for its prefill, migrates it, and returns the statistics
/// and the pause the guest saw (ms).
pub(super) fn migrate_once(s: &Scenario) -> anyhow::Result<(MigrationStats, f64)> {
    let m = migrate_into(s, DestinationSetup::default())?;
    Ok((m.stats, m.pause_ms))
}

/// [`migrate_once`] into a destination readied as `setup` says.
pub(super) fn migrate_into(s: &Scenario, setup: DestinationSetup) -> anyhow::Result<Migrated> {
    migrate_over(s, setup, TcpListener::bind("127.0.0.1:0")?)
}

/// [`migrate_into`] a destination that listens on `listener` (e.g. across a capped link).
pub(super) fn migrate_over(
    s: &Scenario,
    setup: DestinationSetup,
    listener: TcpListener,
) -> anyhow::Result<Migrated> {
    let config = VmConfig {
        memory_bytes: s.memory,
        vcpus: s.vcpus,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: s.cmdline.clone(),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::Discard,
        balloon: true,
        disk: s
            .disk
            .as_ref()
            .map(|d| d.source.to_string_lossy().parse())
            .transpose()?,
        net: None,
        dirty_ring: s.dirty_ring,
        host_pages: s.host_pages,
        next_layout: false,
    };
    let source = Vm::boot(config.clone())?;
    let src = source.handle();
    wait(&src, Duration::from_secs(120), |h| {
        let t = h.telemetry();
        t.config
            .as_ref()
            .is_some_and(|c| t.pages_written >= c.working_set_pages)
            && t.heartbeats > 100
    })
    .context("the guest did not finish its prefill")?;
    let settle_start = src.telemetry();
    std::thread::sleep(s.settle);
    let settled = [settle_start, src.telemetry()];
    let preparation = match setup.unprepared {
        false => Preparation::Prepared,
        true => Preparation::Unprepared,
    };
    let destination_disk = s
        .disk
        .as_ref()
        .map(|d| d.destination.to_string_lossy().parse())
        .transpose()?;
    let mut incoming = Vm::incoming_with(
        VmConfig {
            disk: destination_disk,
            net: None,
            ..config
        },
        preparation,
    )?;
    if let Some(landing) = setup.landing {
        incoming.land_pages(landing);
    }
    let extents = match setup.ram {
        DestinationRam::Alongside => src.ram().data_extents()?,
        _ => Vec::new(),
    };
    let prealloc = match setup.ram {
        DestinationRam::Sparse | DestinationRam::Alongside => None,
        DestinationRam::Prealloc => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            Some(incoming.handle().ram().prealloc(threads)?)
        }
    };
    let source_before = src.telemetry();
    let mut request = request(s, listener.local_addr()?.to_string());
    let listener: Box<dyn Listener> = if s.tls {
        let (source, destination) = run_pki()?;
        request.tls_config = Some(source);
        destination.listener(Box::new(listener))
    } else {
        Box::new(listener)
    };
    request.channels = s.channels;
    request.free_page_hints = s.free_page_hints;
    request.compression = s.compression;
    request.max_bandwidth = s.max_bandwidth;
    request.auto_converge_by = s.converge_by;
    request.disk_copy = s.disk.as_ref().is_some_and(|d| d.copy);
    if s.checksum_pages {
        request.checksum = Checksum::Pages;
    }
    if let Some(preempt) = s.postcopy {
        request.mode = MigrationMode::Postcopy(PostcopyRequest {
            after_passes: (s.finish == Finish::Forced).then_some(1),
            preempt: match (preempt, s.preempt_priority) {
                (false, _) => Preempt::Off,
                (true, true) => Preempt::Urgent,
                (true, false) => Preempt::Unmarked,
            },
            order: s.postcopy_order,
            on_stall: s.finish == Finish::PostcopyOnStall,
            auto: s.finish == Finish::PostcopyAuto,
            ..PostcopyRequest::default()
        });
    }
    let received = std::thread::scope(|scope| {
        let (incoming, listener) = (&mut incoming, listener.as_ref());
        let deadline = Instant::now() + Duration::from_secs(120);
        if !extents.is_empty() {
            let ram = incoming.handle();
            let extents = &extents;
            scope.spawn(move || ram.ram().populate_ranges(extents, 1));
        }
        let r = scope
            .spawn(move || migration::receive(incoming, listener, &|| Instant::now() < deadline));
        let started = src.start_migration(request).map(|_| ());
        (started, r.join().expect("receiver"))
    });
    received.0?;
    let received = received.1.context("destination")?;
    wait(&src, Duration::from_secs(120), |h| {
        h.migration().is_some_and(|p| !p.phase.is_active())
    })?;
    let progress = src.migration().context("no migration")?;
    let source_after = src.telemetry();
    if progress.phase != Phase::Completed {
        bail!(
            "migration {:?}: {}",
            progress.phase,
            progress.error.unwrap_or_default()
        );
    }
    let destination = incoming
        .into_running()
        .context("the destination did not resume")?;
    let dst = destination.handle();
    wait(&dst, Duration::from_secs(10), |h| {
        h.telemetry().migration_pause_ns.is_some()
    })?;
    if s.disk.is_some() {
        // The destination's guest reads back blocks it wrote on the source: a lost or stale
        // one shows in its disk's verify failures.
        let read = |h: &VmHandle| h.telemetry().disk.map_or(0, |d| d.blocks_read);
        let at = read(&dst);
        wait(&dst, Duration::from_secs(60), |h| {
            read(h) >= at + DISK_READS_AFTER
        })?;
    }
    let guest = dst.telemetry();
    let pause_ms = guest.migration_pause_ns.unwrap_or(0) as f64 / 1e6;
    src.stop(StopReason::Requested("benchmark done".into()));
    dst.stop(StopReason::Requested("benchmark done".into()));
    Ok(Migrated {
        stats: progress.stats.context("no statistics")?,
        pause_ms,
        prealloc,
        guest,
        source_guest: [source_before, source_after],
        received,
        settled,
    })
}

/// The policy a scenario migrates with.
/// The scenario's request to `to`: forced by a timeout (sooner without auto-converge), or
/// careful, or switching to postcopy on a stall.
fn request(s: &Scenario, to: String) -> MigrationRequest {
    let forced = |after: u64| MigrationRequest {
        downtime_limit_ms: s.downtime.as_millis() as u64,
        timeout_ms: Some(after * 1000),
        timeout_action: TimeoutAction::Switchover,
        ..MigrationRequest::to(to.clone())
    };
    match s.finish {
        Finish::Forced => MigrationRequest {
            auto_converge: false,
            ..forced(30)
        },
        Finish::Careful => forced(60),
        // Postcopy on the stall itself is asked for with the rest of postcopy's settings.
        Finish::PostcopyOnStall | Finish::PostcopyAuto => forced(60),
    }
}

pub(super) fn wait(
    h: &VmHandle,
    timeout: Duration,
    done: impl Fn(&VmHandle) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done(h) {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?}: {:?}", h.status().stop_reason);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}
