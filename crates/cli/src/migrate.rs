//! `ferry migrate` and `ferry cancel`: start a migration of a running VM through its API
//! socket, follow it (`follow.rs`), print the result.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use ferry_migrate::scan::ZeroDetection;
use ferry_migrate::source::Preempt;
use ferry_migrate::transport::tls::Side;
use ferry_migrate::{Phase, TimeoutAction};
use ferry_vmm::api::client;
use ferry_vmm::request::{Checksum, MigrationMode, MigrationRequest, PostcopyRequest, TlsRequest};
use serde_json::json;

use crate::report;
use crate::{UsageError, exit};

mod follow;
pub(crate) use follow::{Ended, OutputArg, Until, follow, print_stats};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TimeoutActionArg {
    Cancel,
    Switchover,
    Postcopy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// `--auto-converge`: off, on (the throttle), or by per-vCPU dirty limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AutoConvergeArg {
    On,
    Off,
    DirtyLimit,
}

/// `--checksum`: what the checksums cover beyond what they always do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ChecksumArg {
    State,
    Pages,
}

/// `--postcopy-order`: the background push's order after the switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PostcopyOrderArg {
    /// The 2 MiB the guest dirtied most recently and most often first.
    Hot,
    /// Lowest address first, each request moving the push to just after it.
    Address,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ZeroDetectionArg {
    Inline,
    Offload,
    None,
}

impl From<TimeoutActionArg> for TimeoutAction {
    fn from(a: TimeoutActionArg) -> TimeoutAction {
        match a {
            TimeoutActionArg::Cancel => TimeoutAction::Cancel,
            TimeoutActionArg::Switchover => TimeoutAction::Switchover,
            TimeoutActionArg::Postcopy => TimeoutAction::Postcopy,
        }
    }
}

impl From<ZeroDetectionArg> for ZeroDetection {
    fn from(z: ZeroDetectionArg) -> ZeroDetection {
        match z {
            ZeroDetectionArg::Inline => ZeroDetection::Inline,
            ZeroDetectionArg::Offload => ZeroDetection::Offload,
            ZeroDetectionArg::None => ZeroDetection::None,
        }
    }
}

/// The API's defaults ([`MigrationRequest`]'s, written once there), which the flags show.
fn defaults() -> MigrationRequest {
    MigrationRequest::default()
}

/// Postcopy's defaults, as a request gets them.
fn postcopy_defaults() -> PostcopyRequest {
    PostcopyRequest::default()
}

/// Milliseconds as a duration flag shows and reads them (`300ms`, `30s`).
pub fn ms(ms: u64) -> humantime::Duration {
    Duration::from_millis(ms).into()
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// The source VM's API socket.
    #[arg(long)]
    api_socket: PathBuf,
    /// The destination, started with `ferry run --incoming tcp:HOST:PORT` (or `unix:PATH`
    /// for a destination on the same host).
    #[arg(long, value_name = "tcp:HOST:PORT|unix:PATH")]
    to: String,
    /// Longest pause the switchover may cause at the measured bandwidth (QEMU: downtime-limit).
    #[arg(help_heading = "Convergence", long, default_value_t = ms(defaults().downtime_limit_ms))]
    downtime_limit: humantime::Duration,
    /// Cap on the send rate in bytes per second, e.g. 1G (QEMU: max-bandwidth). Default: none.
    #[arg(help_heading = "Convergence", long, value_parser = crate::sizes::parse_size)]
    max_bandwidth: Option<u64>,
    /// Cap each vCPU's dirty rate at this many bytes per second for the whole migration,
    /// e.g. 50M: a vCPU that dirties faster sleeps in proportion, the others run freely
    /// (QEMU: set-vcpu-dirty-limit). Needs the VM's dirty ring (`ferry run --dirty-ring`).
    #[arg(help_heading = "Convergence", long, value_parser = crate::sizes::parse_size, value_name = "BYTES_PER_S")]
    dirty_limit: Option<u64>,
    /// Give up converging after this long, e.g. 60s. Default: no timeout.
    #[arg(help_heading = "Convergence", long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// What to do at the timeout: cancel (the source keeps running), force the switchover,
    /// or switch to postcopy (needs --postcopy).
    #[arg(
        help_heading = "Convergence",
        long,
        value_enum,
        default_value = "cancel"
    )]
    timeout_action: TimeoutActionArg,
    /// Throttle the guest's vCPUs when precopy stalls (the guest dirties more than half of
    /// what each pass sends, two passes in a row): 20% of their time asleep, 10 points more
    /// per further stalled pass, up to --max-throttle (QEMU: auto-converge). On by default:
    /// it needs nothing from the destination and cannot lose the VM.
    /// `dirty-limit` slows only the vCPUs that dirty memory fast: each vCPU may dirty at most
    /// half of what the link carries, halved per further stalled pass down to 1 MB/s, and
    /// vCPUs that only compute run freely (QEMU: dirty-limit). It needs the VM's dirty ring
    /// (`ferry run --dirty-ring`); without it auto-converge throttles.
    #[arg(help_heading = "Convergence", long, value_enum, default_value = "on", num_args = 0..=1, default_missing_value = "on", value_name = "on|off|dirty-limit")]
    auto_converge: AutoConvergeArg,
    /// Auto-converge's highest throttle, percent of vCPU time asleep (1 to 99).
    #[arg(help_heading = "Convergence", long, default_value_t = defaults().max_throttle, value_parser = clap::value_parser!(u8).range(1..=99), value_name = "PERCENT")]
    max_throttle: u8,
    /// Data channels, each a TCP connection with a sender and a receiver thread (QEMU:
    /// multifd-channels).
    #[arg(help_heading = "Data channels", long, default_value_t = defaults().channels)]
    channels: u16,
    /// Bytes of pages per batch on a data channel, a multiple of 4K up to 2M.
    #[arg(help_heading = "Data channels", long, default_value_t = defaults().packet_size, value_parser = crate::sizes::parse_size)]
    packet_size: u64,
    /// Where zero pages are found: inline (sender threads), offload (a scanning thread per
    /// channel), none (every page sent as data, for measurements).
    #[arg(
        help_heading = "Data channels",
        long,
        value_enum,
        default_value = "inline"
    )]
    zero_detection: ZeroDetectionArg,
    /// Write the statistics, with their timeline, as JSON here (for `ferry report`), whether
    /// the migration completed or not.
    #[arg(long, value_name = "FILE.json")]
    stats_out: Option<PathBuf>,
    /// Start the migration and return at once, without following it (QEMU: migrate -d);
    /// watch it with GET /migration (`curl --unix-socket`), tune it with ferry migrate-set,
    /// cancel it with ferry cancel.
    #[arg(long, conflicts_with = "stats_out")]
    detach: bool,
    /// How the final statistics are printed on stdout: a table for a person, or one JSON
    /// line (without the timeline) for a script. Live progress goes to stderr either way.
    #[arg(long, value_enum, default_value = "table")]
    output: OutputArg,
    /// Allow switching to postcopy: the guest moves to the destination early and its
    /// remaining pages follow, those it touches first (QEMU: postcopy-ram). The switch comes
    /// after --postcopy-after-passes passes, on a stall with --postcopy-on-stall, or on `ferry
    /// migrate-postcopy`. Once the guest ran on the destination the migration cannot be
    /// cancelled.
    #[arg(help_heading = "Postcopy", long)]
    postcopy: bool,
    /// With --postcopy: switch after this many precopy passes (1 = right after the first).
    #[arg(
        help_heading = "Postcopy",
        long,
        value_name = "N",
        requires = "postcopy"
    )]
    postcopy_after_passes: Option<u32>,
    /// With --postcopy: send the pages the destination's guest waits for on a connection of
    /// their own, never behind the background stream (QEMU: postcopy-preempt).
    #[arg(help_heading = "Postcopy", long, requires = "postcopy")]
    postcopy_preempt: bool,
    /// With --postcopy: switch to postcopy when precopy stalls, before throttling the guest.
    #[arg(help_heading = "Postcopy", long, requires = "postcopy")]
    postcopy_on_stall: bool,
    /// With --postcopy: let the prediction choose. After each pass ferry predicts each way to
    /// finish and switches to postcopy when it pauses least among the ways within 1.1x of the
    /// fastest (a guest writing faster than the link); otherwise precopy goes on as set.
    #[arg(help_heading = "Postcopy", long, requires = "postcopy")]
    postcopy_auto: bool,
    /// With --postcopy: for this long after the guest resumed on the destination, send only the
    /// pages it asks for, before the background stream starts sharing the cores with its
    /// first faults (0s: start at once).
    #[arg(help_heading = "Postcopy", long, value_name = "DURATION", requires = "postcopy", default_value_t = ms(postcopy_defaults().quiet_start_ms))]
    postcopy_quiet_start: humantime::Duration,
    /// With --postcopy: the background push's order after the switch: `hot` sends the memory
    /// the guest dirtied most recently and most often first (from the dirty syncs' history,
    /// per 2 MiB) and follows a vCPU that faults in order; `address` goes from the lowest
    /// address, each request moving it to just after the page asked for.
    #[arg(
        help_heading = "Postcopy",
        long,
        value_enum,
        default_value = "hot",
        value_name = "hot|address",
        requires = "postcopy"
    )]
    postcopy_order: PostcopyOrderArg,
    /// With --postcopy: the most pages (4 KiB) a vCPU faulting in order pulls forward after
    /// the page it asked for; the window starts at 16 and doubles with each fault in order.
    /// 0 sends only the pages asked for.
    #[arg(help_heading = "Postcopy", long, value_name = "PAGES", requires = "postcopy", default_value_t = postcopy_defaults().prefetch_pages)]
    postcopy_prefetch: u64,
    /// With --postcopy: cap the send rate from the switch on, in bytes per second, e.g. 200M
    /// (QEMU: max-postcopy-bandwidth); it paces the background push only, never the pages the
    /// destination's guest waits for. Default: --max-bandwidth carries on.
    #[arg(help_heading = "Postcopy", long, value_parser = crate::sizes::parse_size, value_name = "BYTES_PER_S", requires = "postcopy")]
    postcopy_max_bandwidth: Option<u64>,
    /// With --postcopy: when a connection breaks in postcopy, both sides pause instead of
    /// failing (the guest keeps running on the destination and waits for missing pages)
    /// until `ferry migrate-recover` on the destination and `ferry migrate --resume` here
    /// (QEMU: postcopy recovery). On by default: without it a broken connection loses the VM.
    #[arg(help_heading = "Postcopy", long, value_enum, default_value = "on", num_args = 0..=1, default_missing_value = "on", value_name = "on|off")]
    postcopy_recover: OnOff,
    /// Ask the guest's balloon for free page hints and skip the memory it reports free (virtio
    /// free page hinting): memory a guest used once and freed is not sent. On by default; a VM
    /// without a balloon, or a guest without its driver, sends every page.
    #[arg(help_heading = "Convergence", long, value_enum, default_value = "on", num_args = 0..=1, default_missing_value = "on", value_name = "on|off")]
    free_page_hints: OnOff,
    /// Copy the VM's disk to the destination beside RAM, for a disk no host shares: its
    /// allocated ranges go while the guest runs, then what it wrote since, and the rest in
    /// the pause. Start the destination with --disk and a new (missing or empty) file; it
    /// becomes the image only when the migration completes. Without it the destination opens
    /// the same image (shared storage).
    #[arg(help_heading = "Data channels", long)]
    disk_copy: bool,
    /// What the CRC32C checksums cover: device state, control records, record headers and page
    /// addresses always (`state`); `pages` checksums page data too, at a cost `ferry bench
    /// channels` measures.
    #[arg(
        help_heading = "Data channels",
        long,
        value_enum,
        default_value = "state",
        value_name = "state|pages"
    )]
    checksum: ChecksumArg,
    /// Compress the pages of precopy's passes with zstd (at LEVEL, 1-19, default 1), batch by
    /// batch, after the zero scan; a batch that compresses poorly goes raw. `auto` compresses
    /// only while the link is slower than what compression frees (measured per channel as it
    /// goes, the --max-bandwidth share included). Off by default: on a fast link it only
    /// costs CPU. With it on, --max-bandwidth counts a page at what data pages lately cost on
    /// the wire.
    #[arg(
        help_heading = "Data channels",
        long,
        default_value = "off",
        value_name = "off|zstd[:LEVEL]|auto[:LEVEL]"
    )]
    compression: ferry_migrate::Compression,
    /// Longest a write to the destination may wait: a destination that takes nothing for
    /// this long (stopped, overloaded, unreachable) fails the migration like a broken
    /// connection; before the switchover the guest runs on here.
    #[arg(long, default_value_t = ms(defaults().peer_timeout_ms))]
    peer_timeout: humantime::Duration,
    /// How long to keep trying a destination that refuses the connection (nothing listens
    /// there yet: a destination still starting up, registering its memory or preallocating);
    /// `0s` tries once.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// Resume a migration in postcopy-paused: reconnect to the destination, which listens at
    /// --to after `ferry migrate-recover`, and follow the migration to its end. Only
    /// --api-socket, --to and --stats-out count with it: the rest was set at the start.
    #[arg(long)]
    resume: bool,
    /// Hand the guest over to a destination on this host (--to unix:PATH) instead of copying
    /// it: guest RAM's memfd goes over the socket, no page is sent, and the guest pauses only
    /// for its device state (a live update of the VMM under a running guest).
    #[arg(long, conflicts_with = "postcopy")]
    local: bool,
    #[command(flatten, next_help_heading = "Security (TLS, local peers)")]
    allow: crate::peers::AllowUidArgs,
    /// TLS on every connection (see --tls-dir); with --resume the migration's own TLS is
    /// used again and these are ignored.
    #[command(flatten, next_help_heading = "Security (TLS, local peers)")]
    tls: crate::tls::TlsArgs,
    /// With TLS: the name the destination's certificate must carry, when it is not the host
    /// in --to (always needed for unix:PATH).
    #[arg(
        help_heading = "Security (TLS, local peers)",
        long,
        value_name = "NAME"
    )]
    tls_name: Option<String>,
}

#[derive(Debug, Args)]
pub struct RecoverArgs {
    /// The destination VM's API socket.
    #[arg(long)]
    api_socket: PathBuf,
    /// Where to listen for the source's recovery (`tcp:HOST:PORT`, port 0 for any; or
    /// `unix:PATH`); then run `ferry migrate --resume --to` this address on the source.
    #[arg(long, value_name = "tcp:HOST:PORT|unix:PATH")]
    listen: String,
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The source VM's API socket.
    #[arg(long)]
    api_socket: PathBuf,
}

/// Refuses flag values the source would refuse, before asking it anything.
fn check(args: &MigrateArgs) -> Result<&str, UsageError> {
    let to = args.to.as_str();
    to.parse::<ferry_migrate::transport::Address>()
        .map_err(|e| UsageError(format!("--to {e}")))?;
    if !args.allow.allow_uid.is_empty() && !to.starts_with("unix:") {
        return Err(UsageError(
            "--allow-uid names who may take guest RAM over a Unix socket (its uid is read from the socket); a TCP destination cannot be judged so: use TLS".into(),
        ));
    }
    if matches!(args.timeout_action, TimeoutActionArg::Postcopy) && !args.postcopy {
        return Err(UsageError(
            "--timeout-action postcopy needs --postcopy".into(),
        ));
    }
    let max = ferry_migrate::wire::MAX_CHANNELS;
    if args.channels == 0 || args.channels > max {
        return Err(UsageError(format!(
            "--channels {}: use 1 to {max}",
            args.channels
        )));
    }
    let page = ferry_migrate::wire::PAGE_SIZE;
    let most = u64::from(ferry_migrate::wire::MAX_PAGES_PER_RECORD) * page;
    if args.packet_size == 0 || !args.packet_size.is_multiple_of(page) || args.packet_size > most {
        return Err(UsageError(format!(
            "--packet-size {}: use a multiple of 4K from 4K to 2M, e.g. 512K",
            args.packet_size
        )));
    }
    Ok(to)
}

pub fn migrate(args: &MigrateArgs) -> anyhow::Result<ExitCode> {
    let to = check(args)?;
    if args.resume {
        // The attempts that failed so far: a follower of this one ends when it fails too.
        let failed_before = client::request(&args.api_socket, "GET", "/migration")
            .ok()
            .and_then(|m| m["recovery_failures"].as_u64())
            .unwrap_or(0) as u32;
        let body = json!({ "to": to });
        client::request_with_body(
            &args.api_socket,
            "PUT",
            "/migration/resume",
            &body.to_string(),
        )
        .context("could not resume the migration")?;
        eprintln!("ferry: reconnecting to {to}");
        return follow_unless_detached(args, to, Until::EndOrFailedResume(failed_before));
    }
    let body = MigrationRequest {
        to: to.to_string(),
        downtime_limit_ms: args.downtime_limit.as_millis() as u64,
        max_bandwidth: args.max_bandwidth,
        timeout_ms: args.timeout.map(|t| t.as_millis() as u64),
        timeout_action: args.timeout_action.into(),
        auto_converge: args.auto_converge != AutoConvergeArg::Off,
        max_throttle: args.max_throttle,
        auto_converge_by: match args.auto_converge {
            AutoConvergeArg::DirtyLimit => ferry_migrate::ConvergeBy::DirtyLimit,
            _ => ferry_migrate::ConvergeBy::Throttle,
        },
        dirty_limit: args.dirty_limit,
        channels: args.channels,
        packet_size: args.packet_size,
        zero_detection: args.zero_detection.into(),
        mode: mode(args),
        free_page_hints: args.free_page_hints == OnOff::On,
        disk_copy: args.disk_copy,
        peer_timeout_ms: args.peer_timeout.as_millis() as u64,
        compression: args.compression,
        checksum: match args.checksum {
            ChecksumArg::State => Checksum::State,
            ChecksumArg::Pages => Checksum::Pages,
        },
        tls: tls_request(args)?,
        allow_uids: args.allow.allow_uid.clone(),
        ..MigrationRequest::default()
    };
    // What the VMM would refuse, refused before it is asked (the request's own checks and the
    // engine's, once).
    body.source_params([0; 16])
        .map_err(|e| UsageError(e.to_string()))?;
    let body = serde_json::to_string(&body).context("encoding the migration request")?;
    start(args, to, &body)?;
    follow_unless_detached(args, to, Until::End)
}

/// The kind of migration the flags ask for (clap keeps `--local` and `--postcopy` apart,
/// and postcopy's flags with `--postcopy`).
fn mode(args: &MigrateArgs) -> MigrationMode {
    if args.local {
        return MigrationMode::Local;
    }
    if !args.postcopy {
        return MigrationMode::Precopy;
    }
    MigrationMode::Postcopy(PostcopyRequest {
        after_passes: args.postcopy_after_passes,
        preempt: Preempt::urgent_when(args.postcopy_preempt),
        quiet_start_ms: args.postcopy_quiet_start.as_millis() as u64,
        order: match args.postcopy_order {
            PostcopyOrderArg::Hot => ferry_migrate::source::PostcopyOrder::Hot,
            PostcopyOrderArg::Address => ferry_migrate::source::PostcopyOrder::Address,
        },
        prefetch_pages: args.postcopy_prefetch,
        max_bandwidth: args.postcopy_max_bandwidth,
        on_stall: args.postcopy_on_stall,
        auto: args.postcopy_auto,
        recover: args.postcopy_recover == OnOff::On,
    })
}

/// Follows the migration to its end, or with --detach says where to watch it and returns.
fn follow_unless_detached(args: &MigrateArgs, to: &str, until: Until) -> anyhow::Result<ExitCode> {
    if args.detach {
        eprintln!(
            "ferry: migrating to {to} in the background; watch it with GET /migration on {}, cancel it with ferry cancel",
            args.api_socket.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    follow_to_the_end(args, to, until)
}

/// How often a refused connection is tried again: a destination that starts listening is
/// found within this, and the tries cost nothing to speak of.
const CONNECT_RETRY: Duration = Duration::from_millis(100);

/// Starts the migration (`PUT /migration`), trying again while nothing listens at `to` yet
/// (the VMM answers 503), for `--connect-timeout`, with a line that says so.
fn start(args: &MigrateArgs, to: &str, body: &str) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        match client::request_with_body(&args.api_socket, "PUT", "/migration", body) {
            Ok(_) => return Ok(()),
            Err(client::ApiClientError::Status { status: 503, .. })
                if started.elapsed() + CONNECT_RETRY <= args.connect_timeout =>
            {
                if tries == 1 {
                    eprintln!(
                        "ferry: nothing listens at {to} yet (a destination starting up?); trying again for up to {} (--connect-timeout)",
                        humantime::format_duration(args.connect_timeout)
                    );
                }
                std::thread::sleep(CONNECT_RETRY);
            }
            Err(client::ApiClientError::Status {
                status: 503,
                message,
            }) => {
                anyhow::bail!(
                    "could not start the migration: nothing listened at {to} in {tries} tries over {:.1} s (--connect-timeout {}): {message}",
                    started.elapsed().as_secs_f64(),
                    humantime::format_duration(args.connect_timeout)
                );
            }
            Err(e) => return Err(e).context("could not start the migration"),
        }
    }
}

/// The `tls` of a migration request: absolute paths, for a VMM started elsewhere.
fn tls_request(args: &MigrateArgs) -> Result<Option<TlsRequest>, UsageError> {
    let Some(files) = args.tls.files(Side::Source)? else {
        if args.tls_name.is_some() {
            return Err(UsageError(
                "--tls-name is for TLS; give --tls-dir (or --tls-ca, --tls-cert and --tls-key) too"
                    .into(),
            ));
        }
        return Ok(None);
    };
    let files = crate::tls::absolute(files);
    Ok(Some(TlsRequest {
        ca: files.ca,
        cert: files.cert,
        key: files.key,
        name: args.tls_name.clone(),
    }))
}

/// Follows the migration until it ends (Ctrl-C cancels it while it can be), prints its
/// statistics and says how it ended.
fn follow_to_the_end(args: &MigrateArgs, to: &str, until: Until) -> anyhow::Result<ExitCode> {
    let socket = args.api_socket.clone();
    let detach = Arc::new(AtomicBool::new(false));
    let detaching = detach.clone();
    ctrlc::set_handler(move || {
        // Refused once the guest may run on the destination: then stop following instead.
        if client::request(&socket, "PUT", "/migration/cancel").is_err() {
            detaching.store(true, Ordering::Release);
        }
    })
    .context("cannot install the Ctrl-C handler")?;
    let Some(Ended {
        progress,
        moved_on,
        disk,
    }) = follow(&args.api_socket, &detach, until)?
    else {
        eprintln!(
            "ferry: stopped following; the migration cannot be cancelled any more (the guest may run on the destination) and goes on in the VMM: watch it with ferry status --api-socket {} or GET /migration",
            args.api_socket.display()
        );
        return Ok(ExitCode::from(exit::DETACHED));
    };
    print_stats(
        &progress,
        disk.as_ref(),
        args.output,
        args.stats_out.as_deref(),
    )?;
    let error = progress.error.unwrap_or_default();
    match progress.phase {
        Phase::Completed => {
            eprintln!(
                "ferry: migration completed; the guest runs on {to}, {}",
                match (moved_on, progress.local) {
                    (true, _) =>
                        "and the source VMM waits for the next migration (--then-incoming)",
                    (false, true) => "and the old VMM process, which handed it over, exits",
                    (false, false) => "the source VM is paused",
                }
            );
            Ok(ExitCode::from(exit::COMPLETED))
        }
        Phase::Cancelled => {
            eprintln!("ferry: {error}");
            Ok(ExitCode::from(exit::CANCELLED))
        }
        Phase::PostcopyPaused => anyhow::bail!(
            "the resume failed: {error}; the migration is postcopy-paused again (the guest runs on the destination and waits for its pages): run ferry migrate-recover on the destination again, then ferry migrate --resume here"
        ),
        phase => anyhow::bail!("migration {}: {error}", report::phase_name(phase)),
    }
}

/// `ferry migrate-pause`: break a postcopy migration's connections, as a failure would.
pub fn pause(args: &CancelArgs) -> anyhow::Result<ExitCode> {
    client::request(&args.api_socket, "PUT", "/migration/pause")?;
    eprintln!(
        "ferry: the migration is postcopy-paused; recover it with ferry migrate-recover on the destination, then ferry migrate --resume on the source"
    );
    Ok(ExitCode::SUCCESS)
}

/// `ferry migrate-recover`: a destination in postcopy-paused listens for its source again.
pub fn recover(args: &RecoverArgs) -> anyhow::Result<ExitCode> {
    args.listen
        .parse::<ferry_migrate::transport::Address>()
        .map_err(|e| UsageError(format!("--listen {e}")))?;
    let body = json!({ "listen": args.listen });
    let answer = client::request_with_body(
        &args.api_socket,
        "PUT",
        "/migration/recover",
        &body.to_string(),
    )?;
    let at = answer["listening_on"].as_str().unwrap_or(&args.listen);
    println!("{at}");
    eprintln!(
        "ferry: waiting for the source's recovery on {at}; run ferry migrate --resume --to {at} on the source"
    );
    Ok(ExitCode::SUCCESS)
}

/// `ferry migrate-postcopy`: switch a running migration to postcopy now.
pub fn start_postcopy(args: &CancelArgs) -> anyhow::Result<ExitCode> {
    client::request(&args.api_socket, "PUT", "/migration/postcopy")?;
    eprintln!("ferry: the migration switches to postcopy at the end of its current pass");
    Ok(ExitCode::SUCCESS)
}

pub fn cancel(args: &CancelArgs) -> anyhow::Result<ExitCode> {
    client::request(&args.api_socket, "PUT", "/migration/cancel")?;
    eprintln!("ferry: cancel requested; the source VM keeps running");
    Ok(ExitCode::SUCCESS)
}
