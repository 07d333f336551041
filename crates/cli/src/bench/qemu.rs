//! QEMU as the peer of `ferry bench snapshot`: the same built-in guest, with the same command
//! line and RAM, booted under `qemu-system-x86_64`, saved stopped into a file in the same
//! directory and restored from it, driven through QMP. With `mapped-ram` (QEMU 9 and later) it
//! saves and restores as issue 36 measured QEMU 10 (`file:` with `mapped-ram` and 2 multifd
//! channels); without it (Debian 12's QEMU 7.2) through `exec:cat`, QEMU's way to a file before
//! `file:` existed.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::qmp::{Kill, Qmp, RemoveDir};

/// What QEMU did with the guest.
pub(super) struct QemuRun {
    pub version: String,
    pub mapped_ram: bool,
    /// From `stop` to the file synced.
    pub save_ms: f64,
    /// From `migrate-incoming` to the migration completed.
    pub restore_ms: f64,
    /// The file's allocated bytes.
    pub allocated: u64,
}

/// Saves and restores a guest of `memory` bytes booted with `cmdline` once its prefill line
/// is on the serial port; `None` when QEMU is not installed.
pub(super) fn save_and_restore(
    memory: u64,
    cmdline: &str,
    dir: &Path,
) -> anyhow::Result<Option<QemuRun>> {
    let Ok(version) = super::qmp::installed() else {
        return Ok(None);
    };
    let version = version.text;
    let work = dir.join(format!("ferry-bench-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let _cleanup = RemoveDir(work.clone());
    let elf = work.join("guest.elf");
    std::fs::write(&elf, ferry_guest_image::ELF)?;
    let file = work.join("vm.qemu");
    let serial = work.join("serial.log");
    let qemu =
        |sock: &Path, extra: &[&str]| super::qmp::boot(memory, &elf, cmdline, &serial, sock, extra);
    // Save.
    let sock = work.join("save.qmp");
    let child = Kill(qemu(&sock, &[])?);
    let mut q = Qmp::connect(&sock)?;
    super::qmp::wait_prefilled(&serial)?;
    let caps = q.execute("query-migrate-capabilities", json!({}))?;
    let mapped_ram = caps
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["capability"] == "mapped-ram"));
    let uri = if mapped_ram {
        q.prepare_mapped_ram()?;
        format!("file:{}", file.display())
    } else {
        format!("exec:cat > {}", file.display())
    };
    let t = Instant::now();
    q.execute("stop", json!({}))?;
    q.execute("migrate", json!({ "uri": uri }))?;
    q.wait_completed(Duration::from_secs(600))?;
    std::fs::File::open(&file)?.sync_all()?;
    let save_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(q);
    drop(child);
    let allocated = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&file)?.blocks() * 512
    };
    // Restore.
    let sock = work.join("restore.qmp");
    let _child = Kill(qemu(&sock, &["-incoming", "defer"])?);
    let mut q = Qmp::connect(&sock)?;
    let uri = if mapped_ram {
        q.prepare_mapped_ram()?;
        format!("file:{}", file.display())
    } else {
        format!("exec:cat {}", file.display())
    };
    let t = Instant::now();
    q.execute("migrate-incoming", json!({ "uri": uri }))?;
    q.wait_completed(Duration::from_secs(600))?;
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(Some(QemuRun {
        version,
        mapped_ram,
        save_ms,
        restore_ms,
        allocated,
    }))
}
