//! `ferry guest`: the built-in guest as a file, and its parameters.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;

#[derive(Debug, Args)]
#[command(arg_required_else_help = true)]
pub struct GuestArgs {
    /// Write the built-in guest ELF here (it boots under ferry and under QEMU's -kernel).
    #[arg(long)]
    write: Option<PathBuf>,
    /// List the guest's command-line parameters.
    #[arg(long)]
    params: bool,
}

pub fn guest(args: &GuestArgs) -> anyhow::Result<ExitCode> {
    if args.params {
        println!("{:<16} {:<24} {:<26} meaning", "key", "value", "default");
        for (key, value, default, meaning) in ferry_guest_abi::params::HELP {
            println!("{key:<16} {value:<24} {default:<26} {meaning}");
        }
    }
    if let Some(path) = &args.write {
        std::fs::write(path, ferry_guest_image::ELF)
            .with_context(|| format!("cannot write the guest to {}", path.display()))?;
        eprintln!(
            "ferry: wrote the built-in guest ({} bytes) to {p}\n\
             ferry: boot it under QEMU with: qemu-system-x86_64 -M pc -enable-kvm -cpu host,-arch-capabilities \
             -m 1G -display none -serial stdio -kernel {p} -append \"ws=64M\"",
            ferry_guest_image::ELF.len(),
            p = path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
