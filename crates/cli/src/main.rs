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
mod report;
mod run;
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
    /// Cancel a running VM's migration (it keeps running).
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
        Command::Cancel(args) => migrate::cancel(&args),
        Command::MigrateSet(args) => tune::set(&args),
        Command::MigratePostcopy(args) => migrate::start_postcopy(&args),
        Command::MigratePause(args) => migrate::pause(&args),
        Command::MigrateRecover(args) => migrate::recover(&args),
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
            eprintln!("ferry: error: {}", error_text(&e));
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(exit::USAGE)
            } else {
                ExitCode::from(exit::FAILED)
            }
        }
    }
}

/// An error and its causes in one line, each cause once: most of ferry's errors already say
/// their cause's words (`cannot listen on ...: Address in use`), which anyhow's `{:#}` would
/// print a second time.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if out.contains(&said) {
            continue;
        }
        if !out.is_empty() {
            out += ": ";
        }
        out += &said;
    }
    out
}

/// A guest's RAM size: a size, or `max` for the most this host and guest allow (resolved by
/// [`memory_size`] once the guest is known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemorySize {
    Bytes(u64),
    Max,
}

fn parse_memory(s: &str) -> Result<MemorySize, String> {
    match s {
        "max" => Ok(MemorySize::Max),
        s => parse_size(s).map(MemorySize::Bytes),
    }
}

/// The bytes of RAM `size` asks for a guest of kind `guest`: `max` is the limit of this host
/// and guest, said on standard error with why.
pub fn memory_size(size: MemorySize, guest: ferry_vmm::GuestKind) -> anyhow::Result<u64> {
    match size {
        MemorySize::Bytes(b) => Ok(b),
        MemorySize::Max => {
            let limit = ferry_vmm::limit::MemoryLimit::of_host(&ferry_vmm::kvm::open()?, guest);
            eprintln!(
                "ferry: --memory max: {} ({})",
                ferry_vmm::memory::Size(limit.bytes),
                limit.why
            );
            Ok(limit.bytes)
        }
    }
}

/// Parses a byte size such as `2G`, `512M` or `64GiB` (binary units).
fn parse_size(s: &str) -> Result<u64, String> {
    ferry_guest_abi::params::parse_size(s).ok_or_else(|| {
        format!("'{s}' is not a size; write a number, a fraction allowed, with an optional K, M, G or T suffix (either case), e.g. 2G or 3.5g")
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_says_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let said = io.to_string();
        let e = anyhow::Error::new(ferry_vmm::api::client::ApiClientError::Connect {
            path: "x.sock".into(),
            source: io,
        })
        .context("could not start");
        let text = super::error_text(&e);
        assert_eq!(text.matches(&said).count(), 1, "{text}");
        assert!(
            text.starts_with("could not start: no ferry VM is listening on x.sock"),
            "{text}"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(super::error_text(&plain), "outer: inner");
    }
}
