//! `ferry bench disk`: a VM with a disk migrated in one run without a disk (the reference),
//! with its image on shared storage, and with the disk copied beside RAM (`--disk-copy`), in
//! rounds whose order alternates; the time each took against the time raw loopback TCP takes
//! for the same bytes (measured right after it), its downtime against the reference's, and
//! what the destination's guest found when it read its blocks back. Medians of the rounds.
//!
//! The scenario is issue 50's: 4 GiB of RAM with a 1 GiB working set written at 50 MB/s, an
//! 8 GiB sparse image holding 2 GiB of data (1 MiB in every 4 MiB, written by the host before
//! boot), and the guest writing random 4 KiB blocks of it at 50 MB/s.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use serde_json::json;

use super::precopy::{BenchDisk, DestinationSetup, GUEST, Migrated, Scenario, migrate_into};
use super::raw_tcp::raw_tcp_streams;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

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
    /// MB/s of random 4 KiB blocks the guest writes to its disk.
    #[arg(long, default_value_t = 50)]
    disk_rate: u64,
    /// Rounds; the order of the rows alternates between them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Where the images go (a directory on the file system to measure); a temporary
    /// directory in the working directory by default.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

/// How a row's VM has its disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    NoDisk,
    Shared,
    Copy,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::NoDisk => "no disk",
            Way::Shared => "shared image",
            Way::Copy => "disk copy",
        }
    }
}

/// One row of one round.
struct Row {
    way: Way,
    total_ms: f64,
    link_ms: f64,
    downtime_ms: f64,
    pause_ms: f64,
    mb_sent: f64,
    disk_mb: f64,
    blocks_read_after: u64,
    bad_blocks: u64,
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
    let copy = dir.path().join("copy.img");
    fill_image(&image, args.image, args.data)?;
    println!(
        "ferry bench disk: {} GiB RAM (1 GiB written at 50 MB/s), {} GiB image with {} GiB of data, guest writing random 4 KiB blocks at {} MB/s; {} rounds",
        args.memory / GIB,
        args.image / GIB,
        args.data / GIB,
        args.disk_rate,
        args.rounds
    );
    println!(
        "{:<14} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>6}",
        "way", "total ms", "link ms", "ratio", "downtime", "guest ms", "MB sent", "disk MB", "bad"
    );
    let ways = [Way::NoDisk, Way::Shared, Way::Copy];
    let mut rows = Vec::new();
    for round in 0..args.rounds {
        let order: Vec<Way> = match round % 2 {
            0 => ways.to_vec(),
            _ => ways.iter().rev().copied().collect(),
        };
        for way in order {
            let _ = std::fs::remove_file(&copy);
            let row = measure(args, way, &image, &copy)?;
            print_row(&row);
            rows.push(row);
        }
    }
    println!("medians:");
    for way in ways {
        let of: Vec<&Row> = rows.iter().filter(|r| r.way == way).collect();
        let m = |f: fn(&Row) -> f64| median(of.iter().map(|r| f(r)).collect());
        let reference = median(
            rows.iter()
                .filter(|r| r.way == Way::NoDisk)
                .map(|r| r.downtime_ms)
                .collect(),
        );
        println!(
            "{:<14} total {:.0} ms = {:.2}x the link's time for its bytes; downtime {:.1} ms ({:+.1} ms against no disk); guest pause {:.1} ms; bad blocks {}",
            way.name(),
            m(|r| r.total_ms),
            m(|r| r.total_ms / r.link_ms),
            m(|r| r.downtime_ms),
            m(|r| r.downtime_ms) - reference,
            m(|r| r.pause_ms),
            of.iter().map(|r| r.bad_blocks).sum::<u64>()
        );
        println!(
            "{}",
            json!({
                "bench": "disk", "way": way.name(), "rounds": of.len(),
                "total_ms": m(|r| r.total_ms), "link_ratio": m(|r| r.total_ms / r.link_ms),
                "downtime_ms": m(|r| r.downtime_ms), "guest_pause_ms": m(|r| r.pause_ms),
                "mb_sent": m(|r| r.mb_sent), "disk_mb": m(|r| r.disk_mb),
                "blocks_read_after": of.iter().map(|r| r.blocks_read_after).sum::<u64>(),
                "bad_blocks": of.iter().map(|r| r.bad_blocks).sum::<u64>(),
            })
        );
    }
    let bad: u64 = rows.iter().map(|r| r.bad_blocks).sum();
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One migration of `way`, and the link's time for the bytes it sent.
fn measure(args: &DiskBenchArgs, way: Way, image: &Path, copy: &Path) -> anyhow::Result<Row> {
    let mut cmdline = format!("ws=1G rate=50 pattern=random {GUEST}");
    let disk = match way {
        Way::NoDisk => None,
        Way::Shared | Way::Copy => {
            cmdline += &format!(
                " disk={}M disk-rate={} disk-pattern=random disk-read=20",
                args.image / MIB,
                args.disk_rate
            );
            Some(BenchDisk {
                source: image.into(),
                destination: match way {
                    Way::Copy => copy.into(),
                    _ => image.into(),
                },
                copy: way == Way::Copy,
            })
        }
    };
    let s = Scenario {
        disk,
        ..Scenario::new(way.name(), args.memory, &cmdline, 2)
    };
    let m: Migrated = migrate_into(&s, DestinationSetup::default())?;
    let st = &m.stats;
    let rate = raw_tcp_streams(st.bytes_sent, 2)?;
    let (read_after, bad) = m.guest.disk.as_ref().map_or((0, 0), |d| {
        (d.blocks_read, d.verify_failures + d.request_errors)
    });
    Ok(Row {
        way,
        total_ms: st.total_ms,
        link_ms: st.bytes_sent as f64 / rate * 1e3,
        downtime_ms: st.downtime.total_ms,
        pause_ms: m.pause_ms,
        mb_sent: st.bytes_sent as f64 / 1e6,
        disk_mb: st.state_chunk_bytes as f64 / 1e6,
        blocks_read_after: read_after,
        bad_blocks: bad,
    })
}

fn print_row(r: &Row) {
    println!(
        "{:<14} {:>9.0} {:>9.0} {:>7.2} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6}",
        r.way.name(),
        r.total_ms,
        r.link_ms,
        r.total_ms / r.link_ms,
        r.downtime_ms,
        r.pause_ms,
        r.mb_sent,
        r.disk_mb,
        r.bad_blocks
    );
}

/// A sparse image of `size` bytes holding `data` bytes: 1 MiB of non-zero bytes at the start
/// of every 4 MiB.
fn fill_image(path: &Path, size: u64, data: u64) -> anyhow::Result<()> {
    let f = std::fs::File::create(path)
        .with_context(|| format!("cannot make the image {}", path.display()))?;
    f.set_len(size)?;
    let mut block = vec![0u8; MIB as usize];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in block.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes());
    }
    for i in 0..(data / MIB).min(size / (4 * MIB)) {
        f.write_all_at(&block, i * 4 * MIB)?;
    }
    f.sync_all()?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[n / 2],
    }
}
