//! The API client subcommands: `ferry status`, `pause`, `resume`, `shutdown`.

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
