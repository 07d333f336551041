//! `ferry run`: boot a VM and stay with it until it stops.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use ferry_vmm::api::server::ApiServer;
use ferry_vmm::{GuestKind, SerialOutput, StopReason, Vm, VmConfig};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Guest RAM, e.g. 512M, 2G, 64G (RAM is sparse: untouched memory costs nothing).
    #[arg(long, default_value = "2G", value_parser = crate::parse_size)]
    memory: u64,
    /// vCPUs (the PVH boot path starts one).
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// `builtin` for ferry's test guest, or a path to a PVH ELF kernel.
    #[arg(long, default_value = "builtin")]
    guest: String,
    /// Guest command line; for the built-in guest see `ferry guest --params`.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Where the guest's serial port goes: `stdout`, `none`, or a file path.
    #[arg(long, default_value = "stdout")]
    serial: String,
    /// Serve the control API (JSON over HTTP) on this Unix socket.
    #[arg(long)]
    api_socket: Option<PathBuf>,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let (kernel, guest): (Arc<[u8]>, GuestKind) = if args.guest == "builtin" {
        (Arc::from(ferry_guest_image::ELF), GuestKind::FerryGuest)
    } else {
        let bytes = std::fs::read(&args.guest).with_context(|| {
            format!(
                "cannot read guest kernel {}; give a PVH ELF or `builtin`",
                args.guest
            )
        })?;
        (Arc::from(bytes), GuestKind::Foreign)
    };
    let serial = match args.serial.as_str() {
        "stdout" => SerialOutput::Stdout,
        "none" => SerialOutput::Discard,
        path => SerialOutput::File(path.into()),
    };
    let vm = Vm::boot(VmConfig {
        memory_bytes: args.memory,
        vcpus: args.vcpus,
        kernel,
        cmdline: args.cmdline,
        guest,
        serial,
    })?;
    let handle = vm.handle();
    let _api = match &args.api_socket {
        Some(path) => Some(ApiServer::start(path, handle.clone()).inspect_err(|_| {
            handle.stop(StopReason::Requested("API socket unavailable".into()));
        })?),
        None => None,
    };
    let on_signal = handle.clone();
    ctrlc::set_handler(move || on_signal.stop(StopReason::Requested("Ctrl-C".into())))
        .context("cannot install the Ctrl-C handler")?;

    let reason = vm.wait();
    let t = handle.telemetry();
    eprintln!(
        "ferry: VM stopped after {:.1} s: {reason}\nferry: guest wrote {} pages; {} verify passes, {} failed",
        handle.status().uptime_ms as f64 / 1000.0,
        t.pages_written,
        t.verify_passes,
        t.verify_failures,
    );
    Ok(match reason {
        StopReason::Failed(_) => ExitCode::FAILURE,
        StopReason::GuestHalted(_) | StopReason::Requested(_) => ExitCode::SUCCESS,
    })
}
