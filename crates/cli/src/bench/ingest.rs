//! `ferry bench ingest`: how fast a destination takes in guest memory (issue 9, item 3), each
//! migration set against the references that bound it, all measured in the same run.
//!
//! References:
//! - raw loopback TCP over 1, 2 and 4 streams (the network a migration shares);
//! - landing 1 GiB of pages in fresh memory: copied through the `MAP_SHARED` memfd mapping (the
//!   readv path's cost), and `pwrite` into the memfd (the file path's); the better of the two
//!   is "the best fresh-memory reference";
//! - preallocating (`GuestRam::prealloc`, `MADV_POPULATE_WRITE` on one thread per core), then
//!   the same two writes into the populated memory;
//! - 1, 2 and 4 loopback TCP streams landing 1 GiB in fresh memory as a file-landing receiver
//!   does (each stream read into a buffer, then `pwrite` into one memfd, one writer at a time):
//!   the intake a receiver of this design reaches with no protocol at all ("TCP into fresh
//!   memory", the `/pipe` column).
//!
//! Migrations: an idle 8 GiB guest holding 4 GiB of random data, over 1, 2 and 4 channels, into
//! a sparse destination and into a preallocated one (each landing pages the way the VMM picks
//! for it), and at 2 channels each with the other landing, to show what the pick is worth. The
//! preallocation is timed apart: a migration's figures start when the source connects. At 2
//! channels a sparse destination also has the ranges the source holds data in populated by one
//! thread while the migration runs ("extents ahead"): what a source announcing its populated
//! extents at setup would buy, measured before building it into the protocol.
//!
//! On a shared 2-core machine absolute figures drift from run to run; compare a migration with
//! the references of its own run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use ferry_migrate::PageLanding;
use ferry_vmm::memory::GuestRam;
use serde_json::json;

use super::channels::random_data;
use super::precopy::{DestinationRam, DestinationSetup, migrate_into};
use super::raw_tcp::raw_tcp_streams;

#[derive(Debug, Args)]
pub struct IngestBenchArgs {
    /// Only the migrations whose name contains this (the references always run).
    #[arg(long)]
    scenario: Option<String>,
}

const GIB: u64 = 1 << 30;
const PAGE: u64 = 4096;
/// Bytes each memory reference writes: 1 GiB is 262,144 pages, far beyond any cache, and takes
/// about a second into fresh memory at the 3–4 µs a first touch costs here.
const REF_BYTES: u64 = GIB;
/// A write of the memory references: one record's worth of pages (the wire's cap of 512).
const REF_CHUNK: usize = 2 << 20;
/// Bytes of each raw TCP reference: about a second at the 2–4 GB/s loopback moves here.
const RAW_BYTES: u64 = 2 * GIB;
/// The migrated guest: 8 GiB of RAM, 4 GiB of it random data (`random_data`'s working set).
const GUEST_MEMORY: u64 = 8 * GIB;
const CHANNELS: [u16; 3] = [1, 2, 4];
/// Where the landing that the VMM does not pick is also measured.
const SWAPPED_AT: u16 = 2;

pub fn run(args: &IngestBenchArgs) -> anyhow::Result<ExitCode> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();

    println!("references (same run):");
    let mut raw = Vec::new();
    for n in CHANNELS {
        let mb_s = raw_tcp_streams(RAW_BYTES, n)? / 1e6;
        println!("  raw loopback TCP, {n} stream(s): {mb_s:>8.0} MB/s");
        rows.push(
            json!({"bench": "ingest_ref", "reference": "raw_tcp", "streams": n, "mb_s": mb_s}),
        );
        raw.push((n, mb_s));
    }
    let memory = memory_references(threads)?;
    for r in &memory {
        println!(
            "  {:<44} {:>8.0} MB/s {:>7.2} µs/page",
            r.name, r.mb_s, r.us_per_page
        );
        rows.push(
            json!({"bench": "ingest_ref", "reference": r.key, "mb_s": r.mb_s,
            "us_per_page": r.us_per_page}),
        );
    }
    let mut pipe = Vec::new();
    for n in CHANNELS {
        let mb_s = tcp_into_fresh_memory(REF_BYTES, n)? / 1e6;
        println!("  TCP into fresh memory, {n} stream(s):   {mb_s:>8.0} MB/s");
        rows.push(
            json!({"bench": "ingest_ref", "reference": "tcp_into_fresh", "streams": n, "mb_s": mb_s}),
        );
        pipe.push((n, mb_s));
    }
    let best_fresh = memory
        .iter()
        .filter(|r| r.fresh)
        .map(|r| r.mb_s)
        .fold(0.0, f64::max);

    println!(
        "\n8 GiB idle guest, 4 GiB random data; CPU per GiB of data sent; prealloc not in the figures"
    );
    println!(
        "{:<32} {:>8} {:>7} {:>6} {:>6} {:>6} {:>9} {:>9} {:>6} {:>7} {:>8}",
        "migration",
        "total ms",
        "MB/s",
        "/raw",
        "/fresh",
        "/pipe",
        "src s/GiB",
        "dst s/GiB",
        "down",
        "pause",
        "prealloc"
    );
    for (name, channels, setup) in migrations() {
        if args.scenario.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let scenario = random_data(&name, GUEST_MEMORY, channels);
        let m = migrate_into(&scenario, setup).with_context(|| format!("migration '{name}'"))?;
        let s = &m.stats;
        let sending_ms: f64 = s.passes.iter().map(|p| p.duration_ms).sum();
        let mb_s = s.bytes_sent as f64 / 1e3 / sending_ms.max(1e-3);
        let raw_mb_s = raw
            .iter()
            .find(|(n, _)| *n == channels)
            .map_or(f64::NAN, |r| r.1);
        let pipe_mb_s = pipe
            .iter()
            .find(|(n, _)| *n == channels)
            .map_or(f64::NAN, |r| r.1);
        let gib = s.bytes_sent as f64 / GIB as f64;
        let prealloc_ms = m.prealloc.map(|d| d.as_secs_f64() * 1e3);
        println!(
            "{:<32} {:>8.0} {:>7.0} {:>6.2} {:>6.2} {:>6.2} {:>9.3} {:>9.3} {:>6.1} {:>7.1} {:>8}",
            name,
            s.total_ms,
            mb_s,
            mb_s / raw_mb_s,
            mb_s / best_fresh,
            mb_s / pipe_mb_s,
            s.cpu_seconds_source / gib,
            s.cpu_seconds_destination / gib,
            s.downtime.total_ms,
            m.pause_ms,
            prealloc_ms.map_or("-".into(), |ms| format!("{ms:.0}"))
        );
        rows.push(
            json!({"bench": "ingest", "migration": name, "channels": channels,
            "prealloc": setup.ram == DestinationRam::Prealloc,
            "landing": setup.landing.map(|l| format!("{l:?}")), "total_ms": s.total_ms,
            "bytes_sent": s.bytes_sent, "data_mb_s": mb_s, "raw_tcp_mb_s": raw_mb_s,
            "ratio_raw": mb_s / raw_mb_s, "best_fresh_mb_s": best_fresh,
            "ratio_fresh": mb_s / best_fresh, "tcp_into_fresh_mb_s": pipe_mb_s,
            "ratio_pipe": mb_s / pipe_mb_s,
            "cpu_s_per_gib_source": s.cpu_seconds_source / gib,
            "cpu_s_per_gib_destination": s.cpu_seconds_destination / gib,
            "downtime_ms": s.downtime.total_ms, "guest_pause_ms": m.pause_ms,
            "prealloc_ms": prealloc_ms, "passes": s.passes}),
        );
    }
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The migrations to measure: (name, channels, destination).
fn migrations() -> Vec<(String, u16, DestinationSetup)> {
    let mut v = Vec::new();
    for channels in CHANNELS {
        for (ram, what) in [
            (DestinationRam::Sparse, "sparse"),
            (DestinationRam::Prealloc, "prealloc"),
        ] {
            v.push((
                format!("{channels} ch, {what}"),
                channels,
                DestinationSetup {
                    ram,
                    ..DestinationSetup::default()
                },
            ));
            // The landing the VMM does not pick here (`page_landing`'s rule), where it is
            // close: sparse RAM at 1 and 2 channels, populated RAM at 2.
            let picked = if ram == DestinationRam::Prealloc || channels > 1 {
                PageLanding::Mapping
            } else {
                PageLanding::File
            };
            let other = match picked {
                PageLanding::Mapping => PageLanding::File,
                PageLanding::File => PageLanding::Mapping,
            };
            if channels == SWAPPED_AT || (ram == DestinationRam::Sparse && channels == 1) {
                v.push((
                    format!("{channels} ch, {what}, forced {other:?}"),
                    channels,
                    DestinationSetup {
                        ram,
                        landing: Some(other),
                        ..DestinationSetup::default()
                    },
                ));
            }
            if channels == SWAPPED_AT && ram == DestinationRam::Sparse {
                v.push((
                    format!("{channels} ch, sparse, extents ahead"),
                    channels,
                    DestinationSetup {
                        ram: DestinationRam::Alongside,
                        ..DestinationSetup::default()
                    },
                ));
            }
        }
    }
    v
}

/// One memory reference.
struct Reference {
    key: &'static str,
    name: &'static str,
    /// Into never-touched memory (a candidate for the best fresh-memory reference).
    fresh: bool,
    mb_s: f64,
    us_per_page: f64,
}

impl Reference {
    fn new(key: &'static str, name: &'static str, fresh: bool, secs: f64) -> Reference {
        Reference {
            key,
            name,
            fresh,
            mb_s: REF_BYTES as f64 / secs / 1e6,
            us_per_page: secs * 1e6 / (REF_BYTES / PAGE) as f64,
        }
    }
}

/// Landing [`REF_BYTES`] in guest RAM, fresh and populated, through the mapping and through
/// the memfd, each into RAM of its own.
fn memory_references(threads: usize) -> anyhow::Result<Vec<Reference>> {
    let chunk = vec![0x5au8; REF_CHUNK];
    let through_mapping = |ram: &GuestRam| -> anyhow::Result<f64> {
        let t = Instant::now();
        for off in (0..REF_BYTES).step_by(REF_CHUNK) {
            ram.write(off, &chunk)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    // RAM below 3 GiB is at file offset = guest address (memory.rs), so `off` is both.
    let through_file = |ram: &GuestRam| -> anyhow::Result<f64> {
        let t = Instant::now();
        for off in (0..REF_BYTES).step_by(REF_CHUNK) {
            ram.memfd().write_all_at(&chunk, off)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let mut v = Vec::new();
    v.push(Reference::new(
        "fresh_mapping",
        "copy into fresh memory through the mapping",
        true,
        through_mapping(&GuestRam::new(REF_BYTES)?)?,
    ));
    v.push(Reference::new(
        "fresh_pwrite",
        "pwrite into a fresh memfd",
        true,
        through_file(&GuestRam::new(REF_BYTES)?)?,
    ));
    let ram = GuestRam::new(REF_BYTES)?;
    let took = ram.prealloc(threads)?.as_secs_f64();
    let mut prealloc = Reference::new("prealloc", "prealloc (MADV_POPULATE_WRITE)", false, took);
    prealloc.name = if threads == 1 {
        "prealloc (MADV_POPULATE_WRITE), 1 thread"
    } else {
        "prealloc (MADV_POPULATE_WRITE), all cores"
    };
    v.push(prealloc);
    v.push(Reference::new(
        "populated_mapping",
        "copy into populated memory (mapping)",
        false,
        through_mapping(&ram)?,
    ));
    drop(ram);
    let ram = GuestRam::new(REF_BYTES)?;
    ram.prealloc(threads)?;
    v.push(Reference::new(
        "populated_pwrite",
        "pwrite into a populated memfd",
        false,
        through_file(&ram)?,
    ));
    Ok(v)
}

/// `bytes` over `n` loopback TCP streams, each read 512 KiB at a time into its receiver's
/// buffer and written with `pwrite` into one fresh memfd under a lock (the file landing's way,
/// `sink.rs`): bytes per second, from the first connect to the last write.
fn tcp_into_fresh_memory(bytes: u64, n: u16) -> anyhow::Result<f64> {
    const CHUNK: usize = 512 << 10;
    let ram = Arc::new(GuestRam::new(bytes)?);
    let writing = Arc::new(Mutex::new(()));
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let per = bytes / u64::from(n);
    let start = Instant::now();
    let senders: Vec<_> = (0..n)
        .map(|_| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = TcpStream::connect(addr)?;
                let chunk = vec![0x5au8; CHUNK];
                for _ in 0..per / CHUNK as u64 {
                    s.write_all(&chunk)?;
                }
                Ok(())
            })
        })
        .collect();
    let mut receivers = Vec::new();
    for i in 0..u64::from(n) {
        let (mut s, _) = listener.accept()?;
        let (ram, writing) = (ram.clone(), writing.clone());
        receivers.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; CHUNK];
            for k in 0..per / CHUNK as u64 {
                s.read_exact(&mut buf)?;
                let _one = writing.lock().unwrap_or_else(|p| p.into_inner());
                // RAM below 3 GiB is at file offset = guest address (memory.rs).
                ram.memfd().write_all_at(&buf, i * per + k * CHUNK as u64)?;
            }
            Ok(())
        }));
    }
    for t in senders.into_iter().chain(receivers) {
        t.join().expect("reference thread")?;
    }
    Ok((per / CHUNK as u64 * CHUNK as u64 * u64::from(n)) as f64 / start.elapsed().as_secs_f64())
}
