//! `ferry run`: boot a VM and stay with it until it stops.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::Args;
use ferry_vmm::api::server::ApiServer;
use ferry_vmm::{GuestKind, SerialOutput, StopReason, Vm, VmConfig, VmHandle};

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
    /// Boot nothing: wait for a migration on `tcp:HOST:PORT`, then run the guest it brings.
    #[arg(long, value_name = "tcp:HOST:PORT")]
    incoming: Option<String>,
}

/// Parses `tcp:HOST:PORT` into `HOST:PORT`.
pub fn tcp_address(spec: &str) -> anyhow::Result<&str> {
    spec.strip_prefix("tcp:")
        .filter(|a| a.contains(':'))
        .with_context(|| {
            format!(
                "'{spec}' is not a migration address; write tcp:HOST:PORT, e.g. tcp:127.0.0.1:4444"
            )
        })
}

/// What Ctrl-C acts on: the wait for an incoming migration, then the VM.
#[derive(Debug, Default)]
struct Interrupt {
    requested: AtomicBool,
    vm: Mutex<Option<VmHandle>>,
}

impl Interrupt {
    fn install() -> anyhow::Result<Arc<Interrupt>> {
        let me = Arc::new(Interrupt::default());
        let handler = me.clone();
        ctrlc::set_handler(move || {
            handler.requested.store(true, Ordering::Relaxed);
            if let Some(vm) = handler.vm.lock().unwrap().as_ref() {
                vm.stop(StopReason::Requested("Ctrl-C".into()));
            }
        })
        .context("cannot install the Ctrl-C handler")?;
        Ok(me)
    }

    fn requested(&self) -> bool {
        self.requested.load(Ordering::Relaxed)
    }
}

/// Waits for a migration on `spec` and returns the VM running the guest it brought.
fn receive(config: VmConfig, spec: &str, interrupt: &Interrupt) -> anyhow::Result<Vm> {
    let addr = tcp_address(spec)?;
    let listener = TcpListener::bind(addr)
        .with_context(|| format!("cannot listen on {addr} for the migration"))?;
    let mut incoming = Vm::incoming(config)?;
    eprintln!(
        "ferry: waiting for a migration on {}",
        listener.local_addr()?
    );
    let stats = ferry_vmm::migration::receive(&mut incoming, &listener, &|| !interrupt.requested())
        .context("the incoming migration failed; no guest runs here")?;
    eprintln!(
        "ferry: migration received: {} pages, {} zero pages in {} passes; state loaded in {:.1} ms, guest resumed in {:.1} ms",
        stats.pages,
        stats.zero_pages,
        stats.passes,
        stats.load.as_secs_f64() * 1e3,
        stats.resume.as_secs_f64() * 1e3
    );
    incoming
        .into_running()
        .context("the migration ended without resuming the guest")
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
    let config = VmConfig {
        memory_bytes: args.memory,
        vcpus: args.vcpus,
        kernel,
        cmdline: args.cmdline,
        guest,
        serial,
    };
    let interrupt = Interrupt::install()?;
    let vm = match &args.incoming {
        None => Vm::boot(config)?,
        Some(addr) => receive(config, addr, &interrupt)?,
    };
    let handle = vm.handle();
    *interrupt.vm.lock().unwrap() = Some(handle.clone());
    if interrupt.requested() {
        handle.stop(StopReason::Requested("Ctrl-C".into()));
    }
    let _api = match &args.api_socket {
        Some(path) => Some(ApiServer::start(path, handle.clone()).inspect_err(|_| {
            handle.stop(StopReason::Requested("API socket unavailable".into()));
        })?),
        None => None,
    };
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
