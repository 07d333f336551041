//! The blocktime section's peer: QEMU 10 migrating the same guest (8 GiB, a 1 GiB working set
//! written flat out in the same pattern, prefilled) over loopback, switched to postcopy after
//! its pass 1 (`migrate-start-postcopy` once `dirty-sync-count` shows the second sync), with
//! and without its preempt channel. Its destination measures the vCPU blocktime itself
//! (capability `postcopy-blocktime`: `postcopy-blocktime` in `query-migrate`, ms); the source
//! counts the page requests (`ram.postcopy-requests`). QEMU's postcopy runs on one channel
//! (it does not take multifd with postcopy before 10.1), ferry's on two.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use super::qmp::{Kill, Qmp, RemoveDir};

/// One QEMU postcopy migration's figures.
pub(super) struct QemuPostcopy {
    pub blocktime_ms: f64,
    pub requests: f64,
    /// From `migrate-start-postcopy` to the source's `completed`.
    pub post_ms: f64,
}

/// Why there is no QEMU row, or `None` where QEMU can run one.
pub(super) fn missing() -> Option<String> {
    match super::qmp::installed() {
        Err(why) => Some(why),
        Ok(v) if v.major < 10 => Some(format!("{}: not QEMU 10", v.text)),
        Ok(_) => None,
    }
}

/// Migrates a QEMU guest of `memory` bytes booted with `cmdline` to a second QEMU, switching to
/// postcopy after pass 1.
pub(super) fn migrate(memory: u64, cmdline: &str, preempt: bool) -> anyhow::Result<QemuPostcopy> {
    let work =
        std::env::temp_dir().join(format!("ferry-bench-qemu-postcopy-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let _cleanup = RemoveDir(work.clone());
    let elf = work.join("guest.elf");
    std::fs::write(&elf, ferry_guest_image::ELF)?;
    let serial = work.join("serial.log");
    let qemu =
        |sock: &Path, extra: &[&str]| super::qmp::boot(memory, &elf, cmdline, &serial, sock, extra);
    let mut caps = vec!["postcopy-ram", "postcopy-blocktime"];
    if preempt {
        caps.push("postcopy-preempt");
    }
    let src_sock = work.join("source.qmp");
    let _source = Kill(qemu(&src_sock, &[])?);
    let mut src = Qmp::connect(&src_sock)?;
    super::qmp::wait_prefilled(&serial)?;
    let dst_sock = work.join("destination.qmp");
    let _destination = Kill(qemu(&dst_sock, &["-incoming", "defer"])?);
    let mut dst = Qmp::connect(&dst_sock)?;
    src.capabilities_on(&caps)?;
    dst.capabilities_on(&caps)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let uri = format!("tcp:127.0.0.1:{port}");
    dst.execute("migrate-incoming", json!({ "uri": uri }))?;
    src.execute("migrate", json!({ "uri": uri }))?;
    // Pass 1 ends with the second sync of the dirty log (the first is at the setup).
    src.wait_for(
        "query-migrate",
        Duration::from_millis(5),
        Duration::from_secs(600),
        |m| m["ram"]["dirty-sync-count"].as_u64() >= Some(2) || m["status"] == "failed",
    )?;
    src.execute("migrate-start-postcopy", json!({}))?;
    let switched = Instant::now();
    let done = src.wait_completed(Duration::from_secs(600))?;
    let post_ms = switched.elapsed().as_secs_f64() * 1e3;
    let arrived = dst.wait_completed(Duration::from_secs(60))?;
    Ok(QemuPostcopy {
        blocktime_ms: number(&arrived, "postcopy-blocktime")?,
        requests: done["ram"]["postcopy-requests"].as_f64().unwrap_or(0.0),
        post_ms,
    })
}

fn number(answer: &Value, field: &str) -> anyhow::Result<f64> {
    answer[field]
        .as_f64()
        .with_context(|| format!("QEMU's destination shows no {field}: {answer}"))
}
