//! `ferry`: run a VM on ferry's reference VMM, control it through its API socket, write out the
//! built-in test guest, and measure. The CLI is thin: every subcommand parses its flags and
//! calls the VMM crate; errors below this crate are typed, and here they get context.

#![forbid(unsafe_code)]

mod bench;
mod control;
mod demo;
pub mod exit;
mod guest;
mod migrate;
mod peers;
mod report;
mod restore;
mod run;
mod sizes;
mod snapshot;
mod tls;
mod tune;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
pub use exit::UsageError;

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Live migration for KVM virtual machines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a VM, migrate it live to a second VM while its guest writes, print the report.
    Demo(demo::DemoArgs),
    /// Boot a VM (by default the built-in test guest), or receive one (--incoming), and run it
    /// until it halts or is stopped.
    Run(run::RunArgs),
    /// Migrate a running VM to a `ferry run --incoming` destination, showing progress.
    #[command(after_help = EXIT_STATUS_HELP)]
    Migrate(migrate::MigrateArgs),
    /// Write a running VM to a file while it runs (a live snapshot); restore it with `ferry
    /// run --restore FILE`.
    Snapshot(snapshot::SnapshotArgs),
    /// Cancel a running VM's migration or snapshot (it keeps running).
    Cancel(migrate::CancelArgs),
    /// Change a running migration's downtime limit, bandwidth cap, timeout or auto-converge
    /// (QEMU: migrate-set-parameters); waits until the migration shows them in force.
    MigrateSet(tune::SetArgs),
    /// Switch a running migration started with --postcopy to postcopy now (at the end of the
    /// pass it is sending).
    MigratePostcopy(migrate::CancelArgs),
    /// Break a postcopy migration's connections as a network failure would (on the source or
    /// the destination): both sides pause until a recovery (QEMU: migrate-pause).
    MigratePause(migrate::CancelArgs),
    /// On a destination in postcopy-paused: listen for the source's recovery (then run `ferry
    /// migrate --resume` on the source). Prints the address it listens on.
    MigrateRecover(migrate::RecoverArgs),
    /// Announce the guest's MAC from its NIC again, as after a move (QEMU:
    /// announce-self): rounds of RARP frames so that switches learn where it is.
    MigrateAnnounce(control::AnnounceArgs),
    /// Print a running VM's state and the guest's counters as JSON.
    Status(control::ControlArgs),
    /// Ask the guest to give memory back (inflate the balloon) or take it back (deflate), or
    /// print the balloon's state.
    Balloon(control::BalloonArgs),
    /// Pause a running VM's vCPUs.
    Pause(control::ControlArgs),
    /// Resume a paused VM (refused for a guest a migration handed over, unless
    /// --risk-running-twice).
    Resume(control::ResumeArgs),
    /// Stop a VM; returns once its `ferry run` has let go of the API socket (a new one may
    /// start on the same path at once).
    Shutdown(control::ControlArgs),
    /// Write out the built-in guest (for QEMU's -kernel) or list its parameters.
    Guest(guest::GuestArgs),
    /// Draw migration statistics (from `--stats-out`) as SVG or HTML charts; several runs are
    /// drawn side by side.
    Report(report::ReportArgs),
    /// TLS for migrations: `ferry tls generate DIR` writes a CA and certificates to try it.
    #[command(subcommand)]
    Tls(tls::TlsCommand),
    /// Benchmarks that print a table and JSON lines.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

const EXIT_STATUS_HELP: &str = "Exit status:
  0  the migration completed; the guest runs on the destination, the source VM is paused
  1  the migration failed
  2  usage error: a bad flag or value, refused before anything was done
  3  the migration was cancelled (ferry cancel, or Ctrl-C); the source VM keeps running
     (a --timeout with --timeout-action cancel is a failure: 1)
  4  Ctrl-C or SIGTERM while the migration could not be cancelled any more (postcopy): ferry
     stopped following it, and it goes on in the VMM (ferry status, GET /migration)";

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::demo(&args),
        Command::Run(args) => run::run(args),
        Command::Migrate(args) => migrate::migrate(&args),
        Command::Snapshot(args) => snapshot::snapshot(&args),
        Command::Cancel(args) => migrate::cancel(&args),
        Command::MigrateSet(args) => tune::set(&args),
        Command::MigratePostcopy(args) => migrate::start_postcopy(&args),
        Command::MigratePause(args) => migrate::pause(&args),
        Command::MigrateRecover(args) => migrate::recover(&args),
        Command::MigrateAnnounce(args) => control::announce(&args),
        Command::Status(args) => control::status(&args),
        Command::Balloon(args) => control::balloon(&args),
        Command::Pause(args) => control::put(&args, "/vm/pause"),
        Command::Resume(args) => control::resume(&args),
        Command::Shutdown(args) => control::shutdown(&args),
        Command::Guest(args) => guest::guest(&args),
        Command::Report(args) => report::report(&args),
        Command::Tls(cmd) => tls::tls(&cmd),
        Command::Bench(cmd) => bench::bench(cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferry: error: {}", exit::error_text(&e));
            if exit::is_usage(&e) {
                ExitCode::from(exit::USAGE)
            } else {
                ExitCode::from(exit::FAILED)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The command line as a whole, parsed through [`Cli`] as `ferry` parses it: the tests of a
    //! command's flags that need the root's grammar live here, below which every command sits.

    use clap::Parser;

    use crate::bench::BenchCommand;
    use crate::{Cli, Command};

    /// Every bench that takes a list takes it as its help shows a default (space separated)
    /// or comma separated; `bench state` has its own test of the values.
    #[test]
    fn regression_list_flags_take_spaces_and_commas() {
        for args in [
            &["bench", "vcpus", "--vcpus", "1", "16"][..],
            &["bench", "vcpus", "--vcpus", "1,16"],
            &["bench", "guest", "--ws", "256M", "1G"],
            &["bench", "guest", "--ws", "256M,1G"],
            &["bench", "scale", "--sizes-gib", "8", "64"],
            &["bench", "scale", "--sizes-gib", "8,64"],
        ] {
            let parsed = Cli::try_parse_from(std::iter::once("ferry").chain(args.iter().copied()));
            assert!(parsed.is_ok(), "{args:?}: {}", parsed.unwrap_err());
        }
        let too_many = Cli::try_parse_from(["ferry", "bench", "vcpus", "--vcpus", "1", "65"]);
        assert!(too_many.is_err(), "65 vCPUs accepted");
    }

    fn vcpus(args: &[&str]) -> Result<Vec<u8>, clap::Error> {
        let cli = Cli::try_parse_from(["ferry", "bench", "state"].iter().chain(args))?;
        match cli.command {
            Command::Bench(BenchCommand::State(a)) => Ok(a.vcpus),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn regression_vcpus_takes_the_list_its_help_shows() {
        // `--vcpus 1 8`, as the help prints the default, was refused: "unexpected argument '8'".
        for (args, want) in [
            (&["--vcpus", "1", "8"][..], vec![1, 8]),
            (&["--vcpus", "1,8"], vec![1, 8]),
            (&["--vcpus", "64"], vec![64]),
            (&["--vcpus", "1", "8", "--vcpus", "32"], vec![1, 8, 32]),
            (&[], vec![1, 8, 32, 64]),
        ] {
            assert_eq!(vcpus(args).unwrap(), want, "{args:?}");
        }
        for refused in [&["--vcpus", "1", "0"][..], &["--vcpus", "65"], &["--vcpus"]] {
            assert!(vcpus(refused).is_err(), "{refused:?} was accepted");
        }
    }
}
