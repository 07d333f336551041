//! Following a migration (or a snapshot) from `ferry migrate`'s side: polling `GET /migration`
//! to its end with live progress, and showing how it ended, its statistics with a copied
//! disk's figures beside them (`--stats-out` writes both, for `ferry report`).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::ValueEnum;
use ferry_migrate::{Phase, Progress};
use ferry_vmm::api::client;
use ferry_vmm::disk_copy::DiskCopyStatus;

use crate::report::{self, Live, PlainLines};

/// How often a follower polls the source for progress.
const POLL: Duration = Duration::from_millis(200);

/// `ferry migrate --output`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum OutputArg {
    Table,
    Json,
}

/// How long a follower follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Until {
    /// The migration's end.
    End,
    /// Its end, or the failure of a resume (`ferry migrate --resume`): more recovery attempts
    /// failed than the given count, and the migration is postcopy-paused again.
    EndOrFailedResume(u32),
}

/// Prints how a migration (or a snapshot) that ended went: a table for a person, or one JSON
/// line; writes its statistics, with a copied `disk`'s figures, to `stats_out` if given.
pub(crate) fn print_stats(
    progress: &Progress,
    disk: Option<&DiskCopyStatus>,
    output: OutputArg,
    stats_out: Option<&Path>,
) -> anyhow::Result<()> {
    let Some(stats) = &progress.stats else {
        return Ok(());
    };
    match output {
        OutputArg::Table if progress.phase == Phase::Completed && progress.local => {
            report::print_local_table(stats)
        }
        OutputArg::Table if progress.phase == Phase::Completed => report::print_table(stats),
        // A migration that ended early has no downtime or final pass to show: one line.
        OutputArg::Table => report::print_partial(stats, progress.phase),
        OutputArg::Json => report::print_json(stats, disk),
    }
    if let Some(path) = stats_out {
        report::write_stats(path, stats, disk)?;
    }
    Ok(())
}

/// Looks at `GET /migration` that fail in a row before the source counts as gone: a VMM that
/// goes on to its next VM (`--then-incoming`) answers again within milliseconds, and one that
/// hands its guest over locally stays until the end was read; ten looks, two seconds at
/// [`POLL`], only keep a follower from calling a blink the source's end.
const UNANSWERED: u32 = 10;

/// How a followed migration ended: its last progress, whether the VMM went on to wait for
/// another migration (`ferry run --then-incoming`), and a copied disk's last figures.
pub(crate) struct Ended {
    pub progress: Progress,
    pub moved_on: bool,
    pub disk: Option<DiskCopyStatus>,
}

/// Polls `GET /migration` until the migration ends, showing progress. `None` once `detach`
/// is set.
pub(crate) fn follow(
    socket: &Path,
    detach: &AtomicBool,
    until: Until,
) -> anyhow::Result<Option<Ended>> {
    let mut live = Live::new(PlainLines::EveryUpdateToStderr);
    let mut last: Option<Phase> = None;
    let mut unanswered = 0;
    loop {
        if detach.load(Ordering::Acquire) {
            live.finish();
            return Ok(None);
        }
        let mut value = match (client::request(socket, "GET", "/migration"), last) {
            (Ok(v), _) => v,
            (Err(e), None) => return Err(e.into()),
            // A VMM that hands its guest over and waits for the next migration
            // (--then-incoming) answers for its next VM a moment later: look again.
            (Err(_), Some(_)) if unanswered < UNANSWERED => {
                unanswered += 1;
                std::thread::sleep(POLL);
                continue;
            }
            // The VMM went away under us: say what was last seen, not only that the socket
            // is missing.
            (Err(e), Some(phase)) => {
                live.finish();
                anyhow::bail!(
                    "the source VMM stopped while the migration was in phase {} (its API answers no more: {e}); a VMM interrupted in precopy cancels the migration first and its guest is gone with it, see its own output",
                    report::phase_name(phase)
                );
            }
        };
        unanswered = 0;
        // A VMM started with --then-incoming went on to wait for the guest's return once
        // this migration completed; it tells how that ended.
        let moved_on = value["role"] == "destination" || value["then_incoming"].is_string();
        if value["role"] == "destination" {
            value = value["previous"].take();
        }
        let disk: Option<DiskCopyStatus> = match value.get_mut("disk") {
            Some(d) => Some(serde_json::from_value(d.take()).context("unreadable disk figures")?),
            None => None,
        };
        let p: Progress = serde_json::from_value(value).context("unreadable progress")?;
        live.update(&p);
        last = Some(p.phase);
        let resume_failed = match until {
            Until::End => false,
            Until::EndOrFailedResume(before) => {
                p.phase == Phase::PostcopyPaused && p.recovery_failures > before
            }
        };
        if !p.phase.is_active() || resume_failed {
            live.finish();
            if let Some(disk) = &disk {
                eprintln!("{}", report::disk_copy_line(disk));
            }
            return Ok(Some(Ended {
                progress: p,
                moved_on,
                disk,
            }));
        }
        std::thread::sleep(POLL);
    }
}
