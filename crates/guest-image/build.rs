//! Builds the guest kernel (`crates/guest`, feature `kernel`) with a nested `cargo build` and
//! copies the ELF into OUT_DIR for `include_bytes!`.
//!
//! The guest targets the host triple with `#![no_std]`: the only toolchain a fresh machine has.
//! What makes it a kernel rather than a Linux program is passed here, for the guest alone:
//! `panic=abort` (no unwinder), the static relocation model (the image runs at the addresses
//! it was linked for, identity mapped), and the link arguments of `crates/guest/build.rs`.
//! It always builds optimised: its workload must write tens of millions of pages a second.
//! A separate target directory keeps the nested cargo off the outer build's lock.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let crates = manifest.parent().unwrap();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
    let target_dir = out.join("guest-target");
    for watched in [
        "guest/src",
        "guest/Cargo.toml",
        "guest/guest.ld",
        "guest/build.rs",
        "guest-abi/src",
    ] {
        println!("cargo:rerun-if-changed={}", crates.join(watched).display());
    }

    let rustflags = [
        "-Crelocation-model=static",
        "-Cpanic=abort",
        "-Cforce-frame-pointers=no",
    ];
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--offline",
        "--bin",
        "ferry-guest",
        "--features",
        "kernel",
    ])
    .arg("--manifest-path")
    .arg(crates.join("guest/Cargo.toml"))
    .arg("--target-dir")
    .arg(&target_dir)
    .env("CARGO_ENCODED_RUSTFLAGS", rustflags.join("\x1f"))
    .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
    .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
    .env("CARGO_PROFILE_RELEASE_LTO", "false");
    // The outer build's wrappers (clippy, coverage) and target settings are not the guest's.
    for var in [
        "RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_LLVM_COV",
        "CARGO_INCREMENTAL",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd
        .status()
        .expect("could not run cargo to build the guest kernel");
    assert!(
        status.success(),
        "building the guest kernel (crates/guest, feature `kernel`) failed"
    );
    std::fs::copy(
        target_dir.join("release/ferry-guest"),
        out.join("ferry-guest.elf"),
    )
    .expect("the guest build produced no ferry-guest binary");
}
