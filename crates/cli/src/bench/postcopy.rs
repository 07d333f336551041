//! `ferry bench postcopy`: postcopy on the built-in guest, with and without the preempt
//! connection, on loopback and on a link capped at 1 GB/s, against the raw 4 KiB
//! request/response round trip on the same link measured in the same run (idle, and beside a
//! bulk stream that fills the link, as the background stream does in postcopy).
//!
//! The capped link is a veth pair into a network namespace of its own, with `tc tbf` at
//! 8 Gbit/s on both ends; the destination's listener is created inside the namespace, so every
//! connection of the migration crosses the link while both VMs stay in this process. It needs
//! root (`ip netns`, `tc`); without it the capped rows are skipped with a message saying why.
//!
//! Each migration: a 2 GiB guest writing a 1 GiB working set of random pages at 400 MB/s and
//! flat out, switched to postcopy after pass 1, over 2 data channels, with guest RAM on 4 KiB
//! pages and on 2 MiB huge pages (both sides; the bench raises the host's huge page pool for
//! those rows and puts it back, and skips them with a message if it cannot). The guest's own stall is
//! its longest batch of writes after the switch (the pause included) and the time it spent in
//! batches over 1 ms; the request latency is the destination's, from a fault to its page in
//! place.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde_json::json;

use ferry_vmm::memory::{HostPages, HugePagePool};

use super::link::{CappedLink, LINK_BYTES_PER_S, Queue};
use super::precopy::{DestinationSetup, Scenario, migrate_over};
use super::process::median;

#[derive(Debug, Args)]
pub struct PostcopyBenchArgs {
    /// Only the migrations whose name contains this (the references always run).
    #[arg(long)]
    scenario: Option<String>,
    /// vCPUs of the guest, each writing its share of the working set at the row's rate
    /// (`400` rows: 400 MB/s in all), so that as many vCPUs fault at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=64))]
    vcpus: u8,
    /// Only the pause section: an 8 GiB guest switched after pass 1, five runs each without and
    /// with the preempt connection, each run's downtime and guest-observed pause and their
    /// medians.
    #[arg(long)]
    pause_only: bool,
    /// Only the blocktime section: the flat-out scenario of the pause section, three runs each
    /// without and with the preempt connection, its blocktime, demand faults and postcopy phase
    /// against the raw loopback rate.
    #[arg(long)]
    blocktime: bool,
}

const GIB: u64 = 1 << 30;
/// Round trips per latency reference.
const ROUND_TRIPS: usize = 2000;

pub fn run(args: &PostcopyBenchArgs) -> anyhow::Result<ExitCode> {
    if args.pause_only {
        for r in pause_rows()? {
            println!("{r}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    if args.blocktime {
        for r in super::blocktime::rows(args.scenario.as_deref())? {
            println!("{r}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let link = |queue: Queue| match CappedLink::new(queue) {
        Ok(l) => Some(l),
        Err(e) => {
            eprintln!(
                "ferry bench postcopy: NO CAPPED LINK, its rows are skipped: {e:#} (run as root with iproute2's ip and tc)"
            );
            None
        }
    };
    let capped = link(Queue::Fifo);
    let banded = link(Queue::Bands);
    let mut rows = Vec::new();
    println!("references (same run): 16-byte request, 4 KiB answer");
    let mut links: Vec<(&str, Option<&CappedLink>)> = vec![("loopback", None)];
    if let Some(c) = &capped {
        links.push(("capped 1 GB/s", Some(c)));
    }
    let mut refs: Vec<(&str, Option<&CappedLink>, bool, bool)> = links
        .iter()
        .flat_map(|&(name, l)| [(name, l, false, false), (name, l, true, false)])
        .collect();
    if let Some(b) = &banded {
        refs.push((PRIO_LINK, Some(b), true, false));
        refs.push((PRIO_LINK, Some(b), true, true));
    }
    for (name, link, busy, marked) in refs {
        let r = round_trips(link, busy, marked)?;
        println!(
            "  {:<28} {:<30} mean {:>7.0} µs  p50 {:>6.0} µs  p99 {:>7.0} µs  max {:>7.0} µs",
            name,
            match (busy, marked) {
                (false, _) => "idle",
                (true, false) => "beside a bulk stream",
                (true, true) => "beside a bulk stream, marked",
            },
            r.mean,
            r.p50,
            r.p99,
            r.max
        );
        rows.push(
            json!({"bench": "postcopy_ref", "link": name, "busy": busy, "marked": marked,
            "mean_us": r.mean, "p50_us": r.p50, "p99_us": r.p99, "max_us": r.max}),
        );
    }
    println!(
        "\n2 GiB guest with {} vCPU(s) on 4 KiB or 2 MiB host pages, 1 GiB random working set, postcopy after pass 1, 2 channels; stall = the guest's longest write batch (pause included) and its time in batches over 1 ms",
        args.vcpus
    );
    println!(
        "{:<56} {:>8} {:>7} {:>7} {:>8} {:>8} {:>6} {:>6} {:>8} {:>7} {:>7} {:>7}",
        "migration",
        "total ms",
        "down",
        "post ms",
        "stall ms",
        "slow ms",
        "asked",
        "again",
        "mean µs",
        "p50",
        "p99",
        "max"
    );
    let wanted = |name: &str| args.scenario.as_deref().is_none_or(|o| name.contains(o));
    // Raised for the 2M rows only, and put back when the bench ends.
    let mut pool = None;
    for (pages, host_pages) in [("4K", HostPages::Small), ("2M", HostPages::Huge2M)] {
        if host_pages == HostPages::Huge2M {
            // Both VMs' RAM, and a few pages of slack.
            match HugePagePool::reserve_more(2 * 2 * GIB / (2 << 20) + 16) {
                Ok(p) => pool = Some(p),
                Err(e) => {
                    eprintln!(
                        "ferry bench postcopy: NO HUGE PAGES, the 2M rows are skipped: {e:#}"
                    );
                    continue;
                }
            }
        }
        for &(link_name, link) in &links {
            for rate in ["400", "max"] {
                for preempt in [false, true] {
                    let name = format!(
                        "{pages} {link_name}, {rate} MB/s, {}",
                        if preempt { "preempt" } else { "no preempt" }
                    );
                    if wanted(&name) {
                        let s = Scenario {
                            postcopy: Some(preempt),
                            host_pages,
                            ..scenario(&name, rate, args.vcpus)
                        };
                        rows.push(migrate_row(&s, link_name, link)?);
                    }
                }
            }
        }
    }
    drop(pool);
    // The preempt connection's urgent marking, on a link whose queue serves it first.
    for rate in ["400", "max"] {
        for marked in [false, true] {
            let name = format!(
                "4K {PRIO_LINK}, {rate} MB/s, preempt{}",
                if marked { ", marked" } else { "" }
            );
            if let Some(b) = &banded
                && wanted(&name)
            {
                let s = Scenario {
                    postcopy: Some(true),
                    preempt_priority: marked,
                    ..scenario(&name, rate, args.vcpus)
                };
                rows.push(migrate_row(&s, PRIO_LINK, Some(b))?);
            }
        }
    }
    rows.extend(pause_rows()?);
    rows.extend(super::blocktime::rows(args.scenario.as_deref())?);
    for r in rows {
        println!("{r}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs per row of [`pause_rows`].
const PAUSE_RUNS: usize = 5;

/// The pause of a postcopy switch, where the guest dirties memory as fast as it can: an 8 GiB
/// guest writing a 1 GiB working set flat out (in order, the guest's default), switched after
/// pass 1 on loopback, without and
/// with the preempt connection, [`PAUSE_RUNS`] runs each: the source's downtime and the pause
/// the guest saw (its heartbeats' longest gap across the switch), each run and the median.
fn pause_rows() -> anyhow::Result<Vec<serde_json::Value>> {
    println!(
        "\nthe pause: 8 GiB guest, 1 GiB working set written flat out in order, postcopy after pass 1, loopback, 2 channels"
    );
    println!(
        "{:<12} {:<40} {:>9} {:<40} {:>9}",
        "", "downtime ms, each run", "median", "guest-observed pause ms, each run", "median"
    );
    let mut rows = Vec::new();
    for preempt in [false, true] {
        let name = if preempt { "preempt" } else { "no preempt" };
        let (mut down, mut pause) = (Vec::new(), Vec::new());
        for run in 0..PAUSE_RUNS {
            let s = Scenario {
                postcopy: Some(preempt),
                ..Scenario::new(
                    &format!("pause, {name}"),
                    8 * GIB,
                    "ws=1G rate=max prefill=1 verify-ms=0 log-ms=0 heartbeat-ms=2",
                    2,
                )
            };
            let m = migrate_over(
                &s,
                DestinationSetup::default(),
                TcpListener::bind("127.0.0.1:0")?,
            )
            .with_context(|| format!("pause run {} {name}", run + 1))?;
            down.push(m.stats.downtime.total_ms);
            pause.push(m.pause_ms);
            rows.push(
                json!({"bench": "postcopy_pause", "preempt": preempt, "run": run + 1,
                "downtime_ms": m.stats.downtime.total_ms, "guest_pause_ms": m.pause_ms,
                "downtime": m.stats.downtime}),
            );
        }
        let each = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "{:<12} {:<40} {:>9.1} {:<40} {:>9.1}",
            name,
            each(&down),
            median(&down),
            each(&pause),
            median(&pause)
        );
        rows.push(json!({"bench": "postcopy_pause", "preempt": preempt,
            "median_downtime_ms": median(&down), "median_guest_pause_ms": median(&pause)}));
    }
    Ok(rows)
}

/// The link with priority bands under its cap.
const PRIO_LINK: &str = "capped 1 GB/s, prio bands";

/// A bench migration: the guest's `vcpus` dirtying its working set at `rate` MB/s in all
/// (or each flat out).
fn scenario(name: &str, rate: &str, vcpus: u8) -> Scenario {
    let rate = match rate.parse::<u32>() {
        Ok(total) => (total / u32::from(vcpus)).max(1).to_string(),
        Err(_) => rate.to_string(),
    };
    // Reports from all vCPUs together about every 2 ms.
    let heartbeat_ms = 2 * u32::from(vcpus);
    Scenario {
        vcpus,
        ..Scenario::new(
            name,
            2 * GIB,
            &format!(
                "ws=1G pattern=random rate={rate} prefill=1 verify-ms=0 log-ms=0 heartbeat-ms={heartbeat_ms}"
            ),
            2,
        )
    }
}

/// The request latencies as a histogram: one line per non-empty power-of-two bucket.
fn print_histogram(buckets: &[u64]) {
    let total: u64 = buckets.iter().sum();
    for (k, &n) in buckets.iter().enumerate().filter(|(_, n)| **n > 0) {
        let bar = "#".repeat((60 * n).div_ceil(total.max(1)) as usize);
        println!(
            "    {:>8} - {:<8} µs {:>7} {bar}",
            1u64 << k,
            (1u64 << (k + 1)) - 1,
            n
        );
    }
}

/// Runs `s` across `link` (loopback if `None`), prints its row and returns its JSON.
fn migrate_row(
    s: &Scenario,
    link_name: &str,
    link: Option<&CappedLink>,
) -> anyhow::Result<serde_json::Value> {
    let listener = match link {
        None => TcpListener::bind("127.0.0.1:0")?,
        Some(l) => l.listener()?,
    };
    let m = migrate_over(s, DestinationSetup::default(), listener)
        .with_context(|| format!("migration '{}'", s.name))?;
    let st = &m.stats;
    let pc = st
        .postcopy
        .clone()
        .context("the migration did not switch to postcopy")?;
    let stall_ms = m.guest.max_batch_ns as f64 / 1e6;
    let slow_ms = m.guest.slow_batch_ns as f64 / 1e6;
    println!(
        "{:<56} {:>8.0} {:>7.1} {:>7.0} {:>8.1} {:>8.0} {:>6} {:>6} {:>8.0} {:>7} {:>7} {:>7}",
        s.name,
        st.total_ms,
        st.downtime.total_ms,
        pc.duration_ms,
        stall_ms,
        slow_ms,
        pc.pages_requested,
        pc.pages_resent,
        pc.latency_mean_us,
        pc.latency_p50_us,
        pc.latency_p99_us,
        pc.latency_max_us
    );
    if s.vcpus > 1 {
        print_histogram(&pc.latency_buckets);
    }
    let stages = m.received.postcopy.clone().unwrap_or_default();
    print_stages(&pc, &stages);
    // On the capped link the link, not the cores, bounds the push: its phase against the time
    // its bytes take at the cap's rate.
    let vs_cap = link.map(|_| pc.duration_ms / (pc.bytes as f64 / LINK_BYTES_PER_S * 1e3));
    if let Some(x) = vs_cap {
        println!(
            "    postcopy phase {:.0} ms for {:.0} MB: {x:.2}x their time at the cap's {:.0} MB/s",
            pc.duration_ms,
            pc.bytes as f64 / 1e6,
            LINK_BYTES_PER_S / 1e6
        );
    }
    Ok(
        json!({"bench": "postcopy", "migration": s.name, "link": link_name,
        "pages": if s.host_pages == HostPages::Huge2M { "2M" } else { "4K" },
        "vcpus": s.vcpus, "preempt": s.postcopy, "marked": s.preempt_priority, "total_ms": st.total_ms,
        "downtime_ms": st.downtime.total_ms, "guest_pause_ms": m.pause_ms,
        "guest_stall_ms": stall_ms, "guest_slow_batch_ms": slow_ms,
        "guest_slow_batches": m.guest.slow_batches, "postcopy": pc,
        "postcopy_vs_cap": vs_cap, "stages": {"ask": stages.ask, "source_turnaround": pc.source_turnaround,
            "source_handoff": pc.source_handoff,
            "install": stages.install, "wake": stages.wake}}),
    )
}

/// Where a request's time went, stage by stage (mean and p50/p99 bounds in µs): the
/// destination's fault thread (fault to request written), the source's turnaround (request
/// read to its pages written), the destination's install of the record and its wakes; the
/// rest of the whole latency's mean is the wire and the queues between.
fn print_stages(
    pc: &ferry_migrate::stats::PostcopyStats,
    d: &ferry_migrate::destination::PostcopyReceived,
) {
    let stage = |name: &str, s: &ferry_migrate::stats::Stage| {
        format!("{name} {:.0} ({}/{})", s.mean_us, s.p50_us, s.p99_us)
    };
    let parts = d.ask.mean_us + pc.source_turnaround.mean_us + d.install.mean_us + d.wake.mean_us;
    println!(
        "    stages, mean (p50/p99) µs: {}, {} of which {}, {}, {}; wire and queues {:.0} of the {:.0} mean",
        stage("ask", &d.ask),
        stage("source", &pc.source_turnaround),
        stage("hand-off", &pc.source_handoff),
        stage("install", &d.install),
        stage("wake", &d.wake),
        (pc.latency_mean_us - parts).max(0.0),
        pc.latency_mean_us
    );
}

/// Round-trip times in µs.
struct RoundTrips {
    mean: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

/// [`ROUND_TRIPS`] 16-byte requests each answered with 4 KiB, over `link` (loopback if
/// `None`); with `busy`, beside a bulk stream in the same direction as the answers.
/// The round trip across `link` (loopback if `None`), beside a bulk stream if `busy`, with the
/// answers marked urgent (as the preempt connection is) if `marked`.
fn round_trips(link: Option<&CappedLink>, busy: bool, marked: bool) -> anyhow::Result<RoundTrips> {
    let listen = || match link {
        None => TcpListener::bind("127.0.0.1:0").map_err(anyhow::Error::from),
        Some(l) => l.listener(),
    };
    let server = listen()?;
    let addr = server.local_addr()?;
    let answering = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = server.accept()?;
        s.set_nodelay(true)?;
        if marked {
            ferry_migrate::transport::Stream::set_urgent(&s)?;
        }
        let (mut req, page) = ([0u8; 16], vec![0x5au8; 4096]);
        while s.read_exact(&mut req).is_ok() {
            s.write_all(&page)?;
        }
        Ok(())
    });
    // The bulk stream: the destination side writes as fast as the link takes it back to us,
    // as postcopy's background pages flow; it stops when we close it.
    let bulk = if busy {
        let bulk_server = listen()?;
        let bulk_addr = bulk_server.local_addr()?;
        let mut reader = TcpStream::connect(bulk_addr)?;
        let stop = reader.try_clone()?;
        let writer = std::thread::spawn(move || {
            if let Ok((mut s, _)) = bulk_server.accept() {
                let chunk = vec![0u8; 1 << 20];
                while s.write_all(&chunk).is_ok() {}
            }
        });
        let draining = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
        });
        std::thread::sleep(Duration::from_millis(200));
        Some((writer, draining, stop))
    } else {
        None
    };
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut page = vec![0u8; 4096];
    let mut us = Vec::with_capacity(ROUND_TRIPS);
    for _ in 0..ROUND_TRIPS {
        let t = Instant::now();
        s.write_all(&[1u8; 16])?;
        s.read_exact(&mut page)?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(s);
    answering.join().expect("answering thread")?;
    if let Some((writer, draining, stop)) = bulk {
        // Shutting the bulk connection down ends both its reader and (its writes failing)
        // its writer.
        let _ = stop.shutdown(std::net::Shutdown::Both);
        let _ = draining.join();
        let _ = writer.join();
    }
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() as f64 * q) as usize).min(us.len() - 1)];
    Ok(RoundTrips {
        mean: us.iter().sum::<f64>() / us.len() as f64,
        p50: at(0.5),
        p99: at(0.99),
        max: us[us.len() - 1],
    })
}
