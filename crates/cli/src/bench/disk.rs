//! `ferry bench disk`: a VM with a disk migrated in one run without a disk (the reference),
//! with its image on shared storage, with the disk copied beside RAM (`--disk-copy`), and by
//! QEMU with its disk mirrored to an NBD export on the destination and then migrated, as
//! libvirt does (`qemu_disk.rs`), in rounds whose order alternates; the time each took
//! against the time raw loopback TCP takes for the same bytes (measured right after it), its
//! downtime against the reference's, the guest's disk write rate before and during the
//! migration, and what the destination's guest found when it read its blocks back. Medians
//! of the rounds, and ferry's disk copy's total time over QEMU's.
//!
//! The scenario is issue 50's: 4 GiB of RAM with a 1 GiB working set written at 50 MB/s, an
//! 8 GiB sparse image holding 2 GiB of data (1 MiB in every 4 MiB, written by the host before
//! boot), and the guest writing random 4 KiB blocks of it at 50 MB/s. The "flat out" rows
//! are the same with the guest writing its disk as fast as its device answers
//! (`disk-rate=max`): a guest that writes faster than the link must still be moved.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use ferry_vmm::devices::telemetry::GuestTelemetry;
use serde_json::json;

use super::precopy::{BenchDisk, DestinationSetup, GUEST, Migrated, Scenario, migrate_into};
use super::qemu_disk::{self, CopyMode, QemuDiskSetup};
use super::raw_tcp::raw_tcp_streams;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// How long ferry's guest runs before its migration starts, the window its disk write rate
/// before the migration is measured over (QEMU's rows wait as long, `qemu_disk.rs`).
const SETTLE: std::time::Duration = std::time::Duration::from_millis(1500);

#[derive(Debug, Args)]
pub struct DiskBenchArgs {
    /// Guest RAM.
    #[arg(long, default_value = "4G", value_parser = crate::sizes::parse_size)]
    memory: u64,
    /// The disk image's size.
    #[arg(long, default_value = "8G", value_parser = crate::sizes::parse_size)]
    image: u64,
    /// Data the host writes into the image before boot (1 MiB in every 4 MiB).
    #[arg(long, default_value = "2G", value_parser = crate::sizes::parse_size)]
    data: u64,
    /// MB/s of random 4 KiB blocks the guest writes to its disk (the flat-out rows: as fast
    /// as it can).
    #[arg(long, default_value_t = 50)]
    disk_rate: u64,
    /// Rounds; the order of the rows alternates between them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Where the images go (a directory on the file system to measure); a temporary
    /// directory in the working directory by default.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Where ferry's copied disk arrives, and the storage reference is measured: a directory
    /// on another file system, as a second host's storage would be (QEMU's rows keep theirs
    /// in `--dir`); `--dir` by default.
    #[arg(long)]
    copy_dir: Option<std::path::PathBuf>,
    /// The rows to run, comma-separated (all by default). The QEMU rows need
    /// qemu-system-x86_64 (6.0 or later; measured with 10.0) and are skipped, saying why,
    /// without it.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Way::ALL)]
    rows: Vec<Way>,
}

/// How a row moves its VM's disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Way {
    /// ferry, the VM without a disk (the reference).
    NoDisk,
    /// ferry, the image on storage both sides share.
    Shared,
    /// ferry, `--disk-copy`.
    Copy,
    /// QEMU: `blockdev-mirror` in the background (libvirt's default), then `migrate`.
    Qemu,
    /// QEMU: `blockdev-mirror` with `write-blocking` (libvirt's
    /// `--copy-storage-synchronous-writes`), then `migrate`.
    QemuBlocking,
    /// ferry, `--disk-copy`, the guest writing its disk flat out.
    FlatCopy,
    /// QEMU in the background mode, the guest writing its disk flat out.
    FlatQemu,
}

impl Way {
    const ALL: [Way; 7] = [
        Way::NoDisk,
        Way::Shared,
        Way::Copy,
        Way::Qemu,
        Way::QemuBlocking,
        Way::FlatCopy,
        Way::FlatQemu,
    ];

    fn name(self) -> &'static str {
        match self {
            Way::NoDisk => "no disk",
            Way::Shared => "shared image",
            Way::Copy => "disk copy",
            Way::Qemu => "qemu mirror",
            Way::QemuBlocking => "qemu blocking",
            Way::FlatCopy => "flat: copy",
            Way::FlatQemu => "flat: qemu",
        }
    }

    /// QEMU's copy mode, for a QEMU row.
    fn qemu(self) -> Option<CopyMode> {
        match self {
            Way::Qemu | Way::FlatQemu => Some(CopyMode::Background),
            Way::QemuBlocking => Some(CopyMode::WriteBlocking),
            Way::NoDisk | Way::Shared | Way::Copy | Way::FlatCopy => None,
        }
    }

    /// Whether the guest writes its disk flat out.
    fn flat_out(self) -> bool {
        matches!(self, Way::FlatCopy | Way::FlatQemu)
    }
}

/// One row of one round: what it measured, or why it did not finish.
struct Row {
    way: Way,
    outcome: Result<Figures, String>,
}

/// What a finished row measured.
struct Figures {
    total_ms: f64,
    /// The raw TCP time for the row's bytes (ferry's rows).
    link_ms: Option<f64>,
    downtime_ms: f64,
    pause_ms: f64,
    mb_sent: f64,
    disk_mb: f64,
    /// The guest's disk writes before and during the migration, MB/s.
    write_mb_s: [Option<f64>; 2],
    blocks_read_after: u64,
    bad_blocks: u64,
    /// Printed under the row.
    note: Option<String>,
}

pub fn run(args: &DiskBenchArgs) -> anyhow::Result<ExitCode> {
    let base = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::current_dir()?,
    };
    let dir = tempfile::tempdir_in(&base).with_context(|| {
        format!(
            "cannot make a directory for the images in {}",
            base.display()
        )
    })?;
    let image = dir.path().join("source.img");
    let arrive = match &args.copy_dir {
        Some(d) => tempfile::tempdir_in(d)
            .with_context(|| format!("cannot make a directory in {}", d.display()))?,
        None => tempfile::tempdir_in(dir.path())?,
    };
    let copy = arrive.path().join("copy.img");
    fill_image(&image, args.image, args.data)?;
    println!(
        "ferry bench disk: {} GiB RAM (1 GiB written at 50 MB/s), {} GiB image with {} GiB of data, guest writing random 4 KiB blocks at {} MB/s (flat rows: as fast as it can); {} rounds",
        args.memory / GIB,
        args.image / GIB,
        args.data / GIB,
        args.disk_rate,
        args.rounds
    );
    let mut ways: Vec<Way> = Way::ALL
        .into_iter()
        .filter(|w| args.rows.contains(w))
        .collect();
    if ways.iter().any(|w| w.qemu().is_some()) {
        let qemu = super::qmp::installed().and_then(|v| qemu_disk::usable(&v).map(|()| v));
        match qemu {
            Ok(v) => println!("QEMU: {}, machine microvm", v.text),
            Err(why) => {
                println!("QEMU ROWS SKIPPED: {why}");
                ways.retain(|w| w.qemu().is_none());
            }
        }
    }
    println!(
        "{:<14} {:>9} {:>8} {:>6} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7} {:>5}",
        "way",
        "total ms",
        "link ms",
        "ratio",
        "downtime",
        "guest ms",
        "MB sent",
        "disk MB",
        "wr pre",
        "wr mig",
        "bad"
    );
    let mut rows = Vec::new();
    let mut storage = Vec::new();
    for round in 0..args.rounds {
        let ms = storage_ms(arrive.path(), args.data)?;
        println!(
            "storage: {} GiB written and synced every 50 ms, as a copy's destination does: {ms:.0} ms ({:.0} MB/s)",
            args.data / GIB,
            args.data as f64 / ms / 1e3
        );
        storage.push(ms);
        let order: Vec<Way> = match round % 2 {
            0 => ways.clone(),
            _ => ways.iter().rev().copied().collect(),
        };
        for way in order {
            let _ = std::fs::remove_file(&copy);
            let outcome = match way.qemu() {
                None => measure(args, way, &image, &copy),
                Some(mode) => measure_qemu(args, way, mode, &image, dir.path()),
            };
            let row = Row {
                way,
                outcome: outcome.map_err(|e| format!("{e:#}")),
            };
            print_row(&row);
            rows.push(row);
        }
    }
    print_medians(&ways, &rows);
    print_storage_bound(&rows, median(storage));
    let bad: u64 = rows
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok())
        .map(|f| f.bad_blocks)
        .sum();
    // A flat-out row that does not finish is a finding the table shows; any other row that
    // does not, or any bad block, fails the bench.
    let unfinished = rows.iter().any(|r| r.outcome.is_err() && !r.way.flat_out());
    Ok(if bad == 0 && !unfinished {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The medians of each way over its finished rounds, and ferry's disk copy against QEMU's.
fn print_medians(ways: &[Way], rows: &[Row]) {
    let finished = |way: Way| -> Vec<&Figures> {
        rows.iter()
            .filter(|r| r.way == way)
            .filter_map(|r| r.outcome.as_ref().ok())
            .collect()
    };
    let reference = median(
        finished(Way::NoDisk)
            .iter()
            .map(|f| f.downtime_ms)
            .collect(),
    );
    println!("medians:");
    for &way in ways {
        let of = finished(way);
        let rounds = rows.iter().filter(|r| r.way == way).count();
        let m = |f: fn(&Figures) -> f64| median(of.iter().map(|r| f(r)).collect());
        let rate = |i: usize| median(of.iter().filter_map(|r| r.write_mb_s[i]).collect());
        let against = match reference.is_finite() {
            true => format!(
                " ({:+.1} ms against no disk)",
                m(|r| r.downtime_ms) - reference
            ),
            false => String::new(),
        };
        let link = match way.qemu() {
            None => format!(" = {:.2}x the link's time for its bytes", m(link_ratio)),
            Some(_) => String::new(),
        };
        let writes = match way {
            Way::NoDisk => String::new(),
            _ => format!(
                " guest disk writes {:.1} MB/s before, {:.1} MB/s during;",
                rate(0),
                rate(1)
            ),
        };
        println!(
            "{:<14} finished {}/{rounds}; total {:.0} ms{link}; downtime {:.1} ms{against}; guest pause {:.1} ms;{writes} bad blocks {}",
            way.name(),
            of.len(),
            m(|r| r.total_ms),
            m(|r| r.downtime_ms),
            m(|r| r.pause_ms),
            of.iter().map(|r| r.bad_blocks).sum::<u64>()
        );
        println!(
            "{}",
            json!({
                "bench": "disk", "way": way.name(), "rounds": rounds, "finished": of.len(),
                "total_ms": m(|r| r.total_ms), "link_ratio": m(link_ratio),
                "downtime_ms": m(|r| r.downtime_ms), "guest_pause_ms": m(|r| r.pause_ms),
                "mb_sent": m(|r| r.mb_sent), "disk_mb": m(|r| r.disk_mb),
                "write_mb_s_before": rate(0), "write_mb_s_during": rate(1),
                "blocks_read_after": of.iter().map(|r| r.blocks_read_after).sum::<u64>(),
                "bad_blocks": of.iter().map(|r| r.bad_blocks).sum::<u64>(),
            })
        );
    }
    let total = |way: Way| median(finished(way).iter().map(|f| f.total_ms).collect());
    for (ferry, qemu) in [
        (Way::Copy, Way::Qemu),
        (Way::Copy, Way::QemuBlocking),
        (Way::FlatCopy, Way::FlatQemu),
    ] {
        let (a, b) = (total(ferry), total(qemu));
        if ways.contains(&ferry) && ways.contains(&qemu) && a.is_finite() && b.is_finite() {
            println!(
                "{} / {}: total {a:.0} / {b:.0} ms = {:.2} (issue 50's goal: 0.5 or less)",
                ferry.name(),
                qemu.name(),
                a / b
            );
            println!(
                "{}",
                json!({"bench": "disk", "ratio": format!("{} / {}", ferry.name(), qemu.name()),
                       "ferry_total_ms": a, "qemu_total_ms": b, "ratio_total": a / b})
            );
        }
    }
}

/// What the disk copy added to the migration without a disk, against the time the storage
/// takes to hold the disk's data (measured in the same run): the destination says it is ready
/// only once the copy is nearly all on storage, so that time bounds the copy's.
fn print_storage_bound(rows: &[Row], storage_ms: f64) {
    let total = |way: Way| {
        median(
            rows.iter()
                .filter(|r| r.way == way)
                .filter_map(|r| r.outcome.as_ref().ok())
                .map(|f| f.total_ms)
                .collect(),
        )
    };
    let added = total(Way::Copy) - total(Way::NoDisk);
    if added.is_finite() {
        println!(
            "disk copy added {added:.0} ms to the migration without a disk = {:.2}x the storage's time for the disk's data ({storage_ms:.0} ms)",
            added / storage_ms
        );
        println!(
            "{}",
            json!({"bench": "disk", "copy_added_ms": added, "storage_ms": storage_ms,
                   "storage_ratio": added / storage_ms})
        );
    }
}

/// Writes `bytes` of random data into a new file in `dir`, 1 MiB at a time, syncing every
/// 50 ms and at the end as a disk copy's destination does; returns the time taken, ms.
fn storage_ms(dir: &Path, bytes: u64) -> anyhow::Result<f64> {
    use std::io::Write;
    let path = dir.join("storage-reference");
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("cannot make {}", path.display()))?;
    let block = random_mib(0x2545_f491_4f6c_dd1d);
    let started = Instant::now();
    let mut synced = started;
    for _ in 0..bytes / MIB {
        f.write_all(&block)?;
        if synced.elapsed() >= Duration::from_millis(50) {
            f.sync_data()?;
            synced = Instant::now();
        }
    }
    f.sync_data()?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(ms)
}

fn link_ratio(f: &Figures) -> f64 {
    f.link_ms.map_or(f64::NAN, |l| f.total_ms / l)
}

/// The guest's command line for `way`.
fn cmdline(args: &DiskBenchArgs, way: Way) -> String {
    let mut cmdline = format!("ws=1G rate=50 pattern=random {GUEST}");
    if way != Way::NoDisk {
        let rate = match way.flat_out() {
            true => "max".to_string(),
            false => args.disk_rate.to_string(),
        };
        cmdline += &format!(
            " disk={}M disk-rate={rate} disk-pattern=random disk-read=20",
            args.image / MIB
        );
    }
    cmdline
}

/// One migration of `way` by ferry, and the link's time for the bytes it sent.
fn measure(args: &DiskBenchArgs, way: Way, image: &Path, copy: &Path) -> anyhow::Result<Figures> {
    let disk = match way {
        Way::NoDisk => None,
        _ => Some(BenchDisk {
            source: image.into(),
            destination: match way {
                Way::Shared => image.into(),
                _ => copy.into(),
            },
            copy: way != Way::Shared,
        }),
    };
    let s = Scenario {
        disk,
        settle: SETTLE,
        ..Scenario::new(way.name(), args.memory, &cmdline(args, way), 2)
    };
    let m: Migrated = migrate_into(&s, DestinationSetup::default())?;
    let st = &m.stats;
    let rate = raw_tcp_streams(st.bytes_sent, 2)?;
    let (read_after, bad) = m.guest.disk.as_ref().map_or((0, 0), |d| {
        (d.blocks_read, d.verify_failures + d.request_errors)
    });
    Ok(Figures {
        total_ms: st.total_ms,
        link_ms: Some(st.bytes_sent as f64 / rate * 1e3),
        downtime_ms: st.downtime.total_ms,
        pause_ms: m.pause_ms,
        mb_sent: st.bytes_sent as f64 / 1e6,
        disk_mb: st.state_chunk_bytes as f64 / 1e6,
        write_mb_s: [
            disk_write_rate(&m.settled[0], &m.settled[1]),
            disk_write_rate(&m.source_guest[0], &m.source_guest[1]),
        ],
        blocks_read_after: read_after,
        bad_blocks: bad,
        note: Some(format!(
            "  (downtime ms: {}; final pages include the last chunks)",
            crate::report::downtime_parts(&st.downtime)
        )),
    })
}

/// One migration of `way` by QEMU.
fn measure_qemu(
    args: &DiskBenchArgs,
    way: Way,
    copy_mode: CopyMode,
    image: &Path,
    dir: &Path,
) -> anyhow::Result<Figures> {
    let run = qemu_disk::migrate(&QemuDiskSetup {
        memory: args.memory,
        cmdline: &cmdline(args, way),
        image,
        dir,
        copy_mode,
    })?;
    let mut note = format!(
        "  (the mirror was ready after {:.0} ms, RAM migrated in the {:.0} ms after)",
        run.mirror_ms,
        run.total_ms - run.mirror_ms
    );
    for line in &run.failures {
        note += &format!("\n  the guest under QEMU said: {line}");
    }
    Ok(Figures {
        total_ms: run.total_ms,
        link_ms: None,
        downtime_ms: run.downtime_ms,
        pause_ms: run.pause_ms,
        mb_sent: run.ram_mb,
        disk_mb: run.mirror_mb,
        write_mb_s: run.write_mb_s,
        blocks_read_after: run.reads_after,
        bad_blocks: run.bad,
        note: Some(note),
    })
}

/// MB/s of disk blocks the guest wrote between two telemetry readings (by the host's clock).
fn disk_write_rate(from: &GuestTelemetry, to: &GuestTelemetry) -> Option<f64> {
    let blocks = to.disk?.blocks_written - from.disk?.blocks_written;
    let ns = to.last_report_host_ns? - from.last_report_host_ns?;
    (ns > 0).then(|| blocks as f64 * 4096.0 / 1e6 / (ns as f64 / 1e9))
}

fn print_row(r: &Row) {
    let f = match &r.outcome {
        Ok(f) => f,
        Err(why) => {
            println!("{:<14} did not finish: {why}", r.way.name());
            return;
        }
    };
    let opt = |v: Option<f64>, digits: usize| match v {
        Some(v) => format!("{v:.digits$}"),
        None => "-".into(),
    };
    println!(
        "{:<14} {:>9.0} {:>8} {:>6} {:>9.1} {:>9.1} {:>8.1} {:>8.1} {:>7} {:>7} {:>5}",
        r.way.name(),
        f.total_ms,
        opt(f.link_ms, 0),
        opt(f.link_ms.map(|l| f.total_ms / l), 2),
        f.downtime_ms,
        f.pause_ms,
        f.mb_sent,
        f.disk_mb,
        opt(f.write_mb_s[0], 1),
        opt(f.write_mb_s[1], 1),
        f.bad_blocks
    );
    if let Some(note) = &f.note {
        println!("{note}");
    }
}

/// A sparse image of `size` bytes holding `data` bytes: 1 MiB of non-zero bytes at the start
/// of every 4 MiB.
fn fill_image(path: &Path, size: u64, data: u64) -> anyhow::Result<()> {
    let f = std::fs::File::create(path)
        .with_context(|| format!("cannot make the image {}", path.display()))?;
    f.set_len(size)?;
    let block = random_mib(0x9e37_79b9_7f4a_7c15);
    for i in 0..(data / MIB).min(size / (4 * MIB)) {
        f.write_all_at(&block, i * 4 * MIB)?;
    }
    f.sync_all()?;
    Ok(())
}

/// 1 MiB that no file system compresses or dedups: xorshift from `seed`.
fn random_mib(seed: u64) -> Vec<u8> {
    let mut block = vec![0u8; MIB as usize];
    let mut x = seed;
    for b in block.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes());
    }
    block
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[n / 2],
    }
}
