//! The API client subcommands: `ferry status`, `pause`, `resume`, `shutdown`, `balloon`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ferry_vmm::api::client;

#[derive(Debug, Args)]
pub struct ControlArgs {
    /// The running VM's API socket (`ferry run --api-socket PATH`).
    #[arg(long)]
    api_socket: PathBuf,
}

pub fn status(args: &ControlArgs) -> anyhow::Result<ExitCode> {
    let body = client::request(&args.api_socket, "GET", "/vm")?;
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(ExitCode::SUCCESS)
}

pub fn put(args: &ControlArgs, path: &str) -> anyhow::Result<ExitCode> {
    let body = client::request(&args.api_socket, "PUT", path)?;
    println!("{body}");
    Ok(ExitCode::SUCCESS)
}

/// Longest `ferry shutdown` waits for the VMM to let go of its API socket.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// `ferry shutdown`: asks the VMM to stop, then waits until its API socket no longer answers
/// (the process has dropped it on its way out), so that a script may start another VMM on the
/// same path right after.
pub fn shutdown(args: &ControlArgs) -> anyhow::Result<ExitCode> {
    let body = client::request(&args.api_socket, "PUT", "/vm/shutdown")?;
    let deadline = std::time::Instant::now() + SHUTDOWN_WAIT;
    while std::os::unix::net::UnixStream::connect(&args.api_socket).is_ok() {
        if std::time::Instant::now() > deadline {
            anyhow::bail!(
                "the VMM accepted the shutdown but still answers on {} after {SHUTDOWN_WAIT:?}",
                args.api_socket.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    println!("{body}");
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The VM's API socket (`ferry run --api-socket PATH`).
    #[arg(long)]
    api_socket: PathBuf,
    /// Resume a guest that a migration handed over to its destination, where it may already
    /// run: only when you know it does not (the destination process is gone, or never loaded
    /// the guest). Two copies of one guest corrupt whatever it writes outside its RAM. A
    /// migration waiting in postcopy-paused is given up.
    #[arg(long)]
    risk_running_twice: bool,
}

/// `ferry resume`.
pub fn resume(args: &ResumeArgs) -> anyhow::Result<ExitCode> {
    let body = match args.risk_running_twice {
        true => r#"{"force": true}"#,
        false => "",
    };
    let answer = client::request_with_body(&args.api_socket, "PUT", "/vm/resume", body)?;
    println!("{answer}");
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct BalloonArgs {
    /// The running VM's API socket (`ferry run --api-socket PATH`).
    #[arg(long)]
    api_socket: PathBuf,
    /// How much memory the guest should give back (e.g. 1G; 0 deflates it all). Without it,
    /// the balloon's state is printed.
    #[arg(long, value_parser = crate::sizes::parse_size)]
    target: Option<u64>,
}

/// `ferry balloon`: sets the balloon's target (`PUT /balloon`) or prints its state.
pub fn balloon(args: &BalloonArgs) -> anyhow::Result<ExitCode> {
    let body = match args.target {
        Some(bytes) => client::request_with_body(
            &args.api_socket,
            "PUT",
            "/balloon",
            &serde_json::json!({ "target_bytes": bytes }).to_string(),
        )?,
        None => client::request(&args.api_socket, "GET", "/balloon")?,
    };
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct AnnounceArgs {
    /// The VM's API socket (`ferry run --api-socket PATH`).
    #[arg(long)]
    api_socket: PathBuf,
    /// Rounds of frames (RARP for the guest's MAC, as QEMU's self-announce).
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Milliseconds between the first round and the second.
    #[arg(long, default_value_t = 50)]
    initial_ms: u64,
    /// Milliseconds each later wait adds to the one before.
    #[arg(long, default_value_t = 100)]
    step_ms: u64,
}

/// `ferry migrate-announce`: the guest's NIC announces its MAC again (`PUT /vm/announce`).
pub fn announce(args: &AnnounceArgs) -> anyhow::Result<ExitCode> {
    let body = serde_json::json!({
        "rounds": args.rounds,
        "initial_ms": args.initial_ms,
        "step_ms": args.step_ms,
    });
    let answer =
        client::request_with_body(&args.api_socket, "PUT", "/vm/announce", &body.to_string())?;
    println!("{answer}");
    Ok(ExitCode::SUCCESS)
}
