//! `ferry snapshot`: a live snapshot of a running VM into a file, through its API socket,
//! followed and reported as a migration is.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use ferry_migrate::Phase;
use ferry_migrate::snapshot::Replace;
use ferry_vmm::api::client;
use ferry_vmm::snapshot::SnapshotRequest;

use crate::migrate::{OnOff, OutputArg, Until, follow, ms, print_stats};
use crate::{exit, report};

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// The VM's API socket.
    #[arg(long)]
    api_socket: PathBuf,
    /// The file to write (`FILE.XXXXXX.partial` until it is complete; a failed snapshot leaves
    /// neither). Restore it with `ferry run --restore FILE`.
    #[arg(long, value_name = "FILE")]
    to: PathBuf,
    /// Leave the guest paused once the snapshot is complete (a save before shutdown); by
    /// default it runs on.
    #[arg(long)]
    stop: bool,
    /// Threads writing pages into the file at once.
    #[arg(long, default_value_t = SnapshotRequest::default().writers)]
    writers: u16,
    /// Longest pause the snapshot may cause, at the rate the file takes pages.
    #[arg(long, default_value_t = ms(SnapshotRequest::default().downtime_limit_ms))]
    downtime_limit: humantime::Duration,
    /// Throttle the guest when it dirties memory faster than the file takes it.
    #[arg(long, value_enum, default_value = "on", value_name = "on|off")]
    auto_converge: OnOff,
    /// Stop iterating after this long and pause the guest to write the rest.
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Write the pages with direct I/O (O_DIRECT), past the page cache, so that a snapshot of a
    /// large guest does not fill it (the file system must allow it).
    #[arg(long)]
    direct_io: bool,
    /// The file's permission bits, in octal: by default only the VMM's user may read the
    /// guest's RAM in it.
    #[arg(long, value_name = "OCTAL", default_value_t = SnapshotRequest::default().mode)]
    mode: String,
    /// Replace whatever file is at FILE (by default only an earlier ferry snapshot is
    /// replaced, and anything else refused and kept).
    #[arg(long)]
    replace: bool,
    /// Most memory the final pass is staged in before it is written (it is written during
    /// the pause past that): what a snapshot adds to the VMM's memory.
    #[arg(long, value_name = "SIZE", value_parser = crate::sizes::parse_size,
          default_value_t = SnapshotRequest::default().staging_limit)]
    staging_limit: u64,
    /// Write the statistics as JSON here (for `ferry report`).
    #[arg(long, value_name = "FILE.json")]
    stats_out: Option<PathBuf>,
}

pub fn snapshot(args: &SnapshotArgs) -> anyhow::Result<ExitCode> {
    // The VMM may run elsewhere in the file system: it gets an absolute path.
    let to = std::path::absolute(&args.to)
        .with_context(|| format!("cannot resolve {}", args.to.display()))?;
    let body = SnapshotRequest {
        to: to.clone(),
        stop: args.stop,
        writers: args.writers,
        downtime_limit_ms: args.downtime_limit.as_millis() as u64,
        auto_converge: args.auto_converge == OnOff::On,
        timeout_ms: args.timeout.map(|t| t.as_millis() as u64),
        direct_io: args.direct_io,
        mode: args.mode.clone(),
        staging_limit: args.staging_limit,
        replace: match args.replace {
            true => Replace::Any,
            false => Replace::Snapshot,
        },
    };
    let body = serde_json::to_string(&body).context("encoding the snapshot request")?;
    client::request_with_body(&args.api_socket, "PUT", "/snapshot", &body)
        .context("could not start the snapshot")?;
    let socket = args.api_socket.clone();
    ctrlc::set_handler(move || {
        let _ = client::request(&socket, "PUT", "/migration/cancel");
    })
    .context("cannot install the Ctrl-C handler")?;
    let Some(ended) = follow(
        &args.api_socket,
        &Arc::new(AtomicBool::new(false)),
        Until::End,
    )?
    else {
        unreachable!("nothing detaches a snapshot's follower")
    };
    print_stats(
        &ended.progress,
        ended.disk.as_ref(),
        OutputArg::Table,
        args.stats_out.as_deref(),
    )?;
    let progress = ended.progress;
    let error = progress.error.unwrap_or_default();
    match progress.phase {
        Phase::Completed => {
            eprintln!(
                "ferry: snapshot written to {}; {}",
                to.display(),
                match args.stop {
                    true => "the VM is paused (--stop)",
                    false => "the guest runs on",
                }
            );
            Ok(ExitCode::from(exit::COMPLETED))
        }
        Phase::Cancelled => {
            eprintln!("ferry: snapshot cancelled; the guest runs on and no file was left");
            Ok(ExitCode::from(exit::CANCELLED))
        }
        phase => anyhow::bail!(
            "snapshot {}: {error}; the guest runs on and no file was left",
            report::phase_name(phase)
        ),
    }
}
