//! QEMU as the peer of `ferry bench net`: the same built-in guest, RAM and workload, on
//! `microvm` with a `virtio-net-device` over the bench's taps (`-netdev tap,ifname=..,
//! script=no,downscript=no`), each process inside the bench's namespace (`ip netns exec`), and
//! migrated across the two taps over the namespace's loopback as ferry's `migrate` row: a fresh
//! destination (`-incoming defer`) for each move, the old source killed once the guest runs
//! there. QEMU announces the guest by itself after an incoming migration, with its defaults
//! (`announce-initial` 50 ms, `announce-step` 100 ms, 5 rounds), as ferry does. The migration's
//! parameters are `qemu_disk.rs`'s: no bandwidth cap (libvirt sets none; QEMU's own default is
//! 128 MiB/s) and a 300 ms downtime limit, as ferry's. The guest has no telemetry port under
//! QEMU, so its pause is the source's `STOP` event to the destination's `RESUME` (both stamped
//! with the host's wall clock), and a probe echo says when it answers.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use super::net_measure::{Marks, from_epoch_seconds};
use super::net_segment::{
    Announces, BRIDGE, GUEST, RowRun, SETTLE, Segment, TAPS, WARM, parse_mac, sleep_until, streamed,
};
use super::qmp::{Kill, Qmp, RemoveDir};

/// The guest's MAC under QEMU: a locally administered address of QEMU's prefix.
const MAC: &str = "52:54:00:fe:77:01";
/// How long a step (the guest answering after boot, a migration, the resume) may take.
const STEP: Duration = Duration::from_secs(60);

/// What the row runs.
pub(super) struct QemuRow<'a> {
    pub memory: u64,
    /// The guest's command line, `net=` included.
    pub cmdline: &'a str,
    pub moves: u32,
    pub rate: u32,
}

/// Whether QEMU is installed and new enough; why not, with how to install it.
pub(super) fn usable() -> Result<(), String> {
    let v = super::qmp::installed().map_err(|why| {
        format!("{why}; install QEMU (e.g. `apt-get install qemu-system-x86`) for this row")
    })?;
    super::qemu_disk::usable(&v)
}

pub(super) fn row(
    segment: &Segment,
    announces: &Announces,
    spec: &QemuRow<'_>,
) -> anyhow::Result<RowRun> {
    let work = std::env::temp_dir().join(format!("ferry-bench-net-qemu-{}", std::process::id()));
    // Its user's alone (0700): it holds the QMP sockets.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(&work)?;
    let _cleanup = RemoveDir(work.clone());
    let elf = work.join("guest.elf");
    std::fs::write(&elf, ferry_guest_image::ELF)?;
    let qemu = Qemus {
        segment,
        work: &work,
        elf: &elf,
        spec,
    };
    let mut src = qemu.start(0, TAPS[0], false)?;
    segment.ns.neighbour(GUEST, MAC, BRIDGE);
    segment
        .wait_answering(STEP)
        .map_err(|e| e.context(qemu.said(0)))?;
    let mac = parse_mac(MAC)?;
    streamed(
        segment,
        spec.rate,
        |_, _, _| {},
        || {
            std::thread::sleep(WARM);
            let mut marks = Vec::new();
            for i in 1..=spec.moves {
                let mut dst = qemu.start(i, TAPS[i as usize % 2], true)?;
                let uri = format!("tcp:127.0.0.1:{}", 5000 + i);
                for q in [&mut src.1, &mut dst.1] {
                    q.execute(
                        "migrate-set-parameters",
                        json!({ "max-bandwidth": 1u64 << 40, "downtime-limit": 300 }),
                    )?;
                }
                dst.1.execute("migrate-incoming", json!({ "uri": uri }))?;
                let begun = Instant::now();
                src.1.execute("migrate", json!({ "uri": uri }))?;
                let status = src
                    .1
                    .wait_completed(STEP)
                    .map_err(|e| e.context(qemu.said(i)))?;
                dst.1
                    .wait_for("query-status", Duration::from_millis(1), STEP, |s| {
                        s["running"] == true
                    })?;
                let (Some(stop), Some(resume)) =
                    (src.1.event_seconds("STOP"), dst.1.event_seconds("RESUME"))
                else {
                    anyhow::bail!("move {i}: QEMU sent no STOP or RESUME event");
                };
                let (paused, resumed) = (from_epoch_seconds(stop), from_epoch_seconds(resume));
                sleep_until(resumed + SETTLE);
                marks.push(Marks {
                    begun,
                    paused,
                    resumed,
                    announce: announces.first_after(mac, paused),
                    downtime_ms: status["downtime"].as_f64().unwrap_or(f64::NAN),
                    steps: Vec::new(),
                    rx_on: None,
                    counters: serde_json::Value::Null,
                });
                src = dst;
            }
            Ok(marks)
        },
    )
}

/// How the row starts its QEMUs.
struct Qemus<'a> {
    segment: &'a Segment,
    work: &'a Path,
    elf: &'a Path,
    spec: &'a QemuRow<'a>,
}

impl Qemus<'_> {
    /// The `i`th QEMU on `tap`, waiting for a migration when `incoming`, and its QMP.
    fn start(&self, i: u32, tap: &str, incoming: bool) -> anyhow::Result<(Kill, Qmp)> {
        let file = |ext: &str| self.work.join(format!("q{i}.{ext}"));
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.segment.name(), "qemu-system-x86_64"])
            .args(["-M", "microvm,acpi=off,x-option-roms=off", "-enable-kvm"])
            .args(["-cpu", "host,-arch-capabilities", "-nodefaults"])
            .args(["-m", &format!("{}M", self.spec.memory >> 20)])
            .args(["-display", "none"])
            .args(["-global", "virtio-mmio.force-legacy=false"])
            .args(["-serial", "none", "-kernel"])
            .arg(self.elf)
            .args(["-append", self.spec.cmdline])
            .arg("-netdev")
            .arg(format!("tap,id=n0,ifname={tap},script=no,downscript=no"))
            .arg("-device")
            .arg(format!("virtio-net-device,netdev=n0,mac={MAC}"))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", file("qmp").display()));
        if incoming {
            c.args(["-incoming", "defer"]);
        }
        let child = c
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(file("err"))?)
            .spawn()
            .context("starting qemu-system-x86_64")?;
        let child = Kill(child);
        let qmp = Qmp::connect(&file("qmp")).map_err(|e| e.context(self.said(i)))?;
        Ok((child, qmp))
    }

    /// What the `i`th QEMU (and the one before it) wrote on its standard error.
    fn said(&self, i: u32) -> String {
        let read = |k: u32| {
            std::fs::read_to_string(self.work.join(format!("q{k}.err"))).unwrap_or_default()
        };
        format!(
            "QEMU's own messages: {:?}, {:?}",
            read(i.saturating_sub(1)).trim(),
            read(i).trim()
        )
    }
}
