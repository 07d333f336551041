//! `ferry bench guest`: how fast the built-in guest dirties memory.
//!
//! For each access pattern and working-set size the guest runs flat out (no verify, no serial
//! lines). First-touch faults on the host make the early rate meaningless (and are slow but
//! steady, so a stable rate alone does not prove the warm-up is over). The warm-up therefore
//! first writes enough pages that fewer than 0.1% are expected to be still untouched (see
//! [`warmup_sweeps`]), then waits until two consecutive half-second rates agree within
//! [`STABLE`]; the rate is taken from two telemetry samples `--seconds` apart. The
//! reference is the guest's own write loop, compiled for the host and run on host memory of the
//! same size in the same process: the ratio is what virtualisation costs the workload.
//!
//! Then the vCPU's CPU share at rate 1, 100 and flat out: how much of a core an idling or
//! paced guest takes (it sleeps on its APIC timer between bursts).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferry_guest::pattern::Picker;
use ferry_guest_abi::PAGE_SIZE;
use ferry_guest_abi::params::Pattern;
use ferry_guest_abi::stamp::{expected_word, next_generation};
use ferry_vmm::{GuestKind, SerialOutput, StopReason, Vm, VmConfig};
use serde_json::json;

#[derive(Debug, Args)]
pub struct GuestBenchArgs {
    /// Working-set sizes to measure: `--ws 256M 1G` or `--ws 256M,1G`.
    #[arg(long, num_args = 1.., value_delimiter = ',', default_value = "256M,1G", value_parser = crate::sizes::parse_size)]
    ws: Vec<u64>,
    /// Seconds each rate is measured over.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
}

/// Headroom above the working set for the guest image, tables and record.
const HEADROOM: u64 = 256 << 20;
/// Relative difference between consecutive warm-up rates that counts as steady.
const STABLE: f64 = 0.05;
/// Longest warm-up: a 1 GiB hot/cold working set needs ~10 s on this kind of machine.
const MAX_WARMUP: Duration = Duration::from_secs(90);

pub fn run(args: &GuestBenchArgs) -> anyhow::Result<ExitCode> {
    let window = Duration::from_secs_f64(args.seconds);
    println!(
        "{:<8} {:>8} {:>16} {:>16} {:>8}",
        "pattern", "ws", "guest Mpages/s", "host Mpages/s", "ratio"
    );
    let mut rows = Vec::new();
    for pattern in [Pattern::Sequential, Pattern::Random, Pattern::HotCold] {
        for &ws in &args.ws {
            let guest = guest_rate(pattern, ws, window)?;
            let host = host_rate(pattern, ws, window);
            println!(
                "{:<8} {:>7}M {:>16.1} {:>16.1} {:>8.2}",
                pattern.name(),
                ws >> 20,
                guest / 1e6,
                host / 1e6,
                guest / host
            );
            rows.push(json!({
                "bench": "guest", "pattern": pattern.name(), "ws_bytes": ws,
                "guest_pages_per_s": guest, "host_pages_per_s": host, "ratio": guest / host,
            }));
        }
    }
    println!("{:<10} {:>14} {:>12}", "rate", "vCPU share", "MB/s written");
    for rate in [Some(1), Some(100), None] {
        let (share, mb_s) = vcpu_share(rate, window)?;
        let name = rate.map_or("max".to_string(), |r| format!("{r} MB/s"));
        println!("{name:<10} {share:>14.3} {mb_s:>12.1}");
        rows.push(json!({
            "bench": "guest_cpu", "rate_mb_s": rate, "vcpu_cpu_share": share, "write_mb_s": mb_s,
        }));
    }
    for row in rows {
        println!("{row}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The vCPU thread's CPU time over wall time while the guest writes at `rate` MB/s (`None`:
/// flat out) over a 64 MiB working set, after two heartbeats; and the rate it wrote at. A
/// paced guest sleeps on its APIC timer between bursts, so its share is far below one core.
fn vcpu_share(rate: Option<u32>, window: Duration) -> anyhow::Result<(f64, f64)> {
    let rate_param = rate.map_or(String::new(), |r| format!(" rate={r}"));
    let vm = Vm::boot(VmConfig {
        memory_bytes: 256 << 20,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: format!("ws=64M verify-ms=0 log-ms=0 heartbeat-ms=100{rate_param}"),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::Discard,
        balloon: true,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout: false,
    })?;
    let h = vm.handle();
    let started = Instant::now();
    while h.telemetry().heartbeats < 2 {
        if started.elapsed() > MAX_WARMUP || h.state() == ferry_vmm::RunState::Stopped {
            bail!("the guest never reported: {:?}", h.status().stop_reason);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let (cpu0, pages0, t0) = (h.vcpu_cpu_ns(), h.telemetry().pages_written, Instant::now());
    std::thread::sleep(window);
    let (cpu1, pages1, wall) = (h.vcpu_cpu_ns(), h.telemetry().pages_written, t0.elapsed());
    h.stop(StopReason::Requested("benchmark done".into()));
    let share = (cpu1 - cpu0) as f64 / wall.as_nanos() as f64;
    let mb_s = ((pages1 - pages0) * PAGE_SIZE) as f64 / wall.as_secs_f64() / 1e6;
    Ok((share, mb_s))
}

/// Pages per second the guest writes, from its telemetry.
fn guest_rate(pattern: Pattern, ws: u64, window: Duration) -> anyhow::Result<f64> {
    let memory = (ws + HEADROOM).next_multiple_of(2 << 20);
    let vm = Vm::boot(VmConfig {
        memory_bytes: memory,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: format!("ws={ws} pattern={} verify-ms=0 log-ms=0", pattern.name()),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::Discard,
        balloon: true,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout: false,
    })?;
    let h = vm.handle();
    let started = Instant::now();
    while h.telemetry().heartbeats == 0 {
        if started.elapsed() > MAX_WARMUP || h.state() == ferry_vmm::RunState::Stopped {
            bail!("the guest never reported: {:?}", h.status().stop_reason);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let warm = warmup_sweeps(pattern) * (ws / PAGE_SIZE);
    while h.telemetry().pages_written < warm {
        if started.elapsed() > MAX_WARMUP || h.state() == ferry_vmm::RunState::Stopped {
            bail!(
                "the guest did not write {warm} pages in {MAX_WARMUP:?}: {:?}",
                h.status().stop_reason
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut previous = f64::NAN;
    loop {
        let rate = sampled_rate(&h, Duration::from_millis(500))?;
        if (rate - previous).abs() <= STABLE * rate {
            break;
        }
        if started.elapsed() > MAX_WARMUP || h.state() == ferry_vmm::RunState::Stopped {
            bail!(
                "the guest's write rate did not settle: {:?}",
                h.status().stop_reason
            );
        }
        previous = rate;
    }
    let rate = sampled_rate(&h, window)?;
    h.stop(StopReason::Requested("benchmark done".into()));
    Ok(rate)
}

/// Writes, in working sets, after which fewer than 0.1% of pages are expected untouched: a
/// page escapes n uniform writes over N pages with probability e^(-n/N) < 0.001 for n >= 7N;
/// hot/cold sends only a tenth of its writes across the whole set, so it needs ten times that.
fn warmup_sweeps(pattern: Pattern) -> u64 {
    match pattern {
        Pattern::Sequential => 2,
        Pattern::Random => 7,
        Pattern::HotCold => 70,
    }
}

/// The guest's pages per second between two telemetry samples `window` apart.
fn sampled_rate(h: &ferry_vmm::VmHandle, window: Duration) -> anyhow::Result<f64> {
    let a = h.telemetry();
    std::thread::sleep(window);
    let b = h.telemetry();
    let t0 = a
        .last_report_host_ns
        .context("the guest sent no telemetry")?;
    let t1 = b
        .last_report_host_ns
        .context("the guest sent no telemetry")?;
    if t1 <= t0 {
        bail!("the guest stopped reporting: {:?}", h.status().stop_reason);
    }
    Ok((b.pages_written - a.pages_written) as f64 * 1e9 / (t1 - t0) as f64)
}

/// Pages per second the same loop writes on the host, over `ws` bytes of host memory.
fn host_rate(pattern: Pattern, ws: u64, window: Duration) -> f64 {
    let pages = (ws / PAGE_SIZE) as usize;
    let words_per_page = (PAGE_SIZE / 8) as usize;
    let mut memory = vec![0u64; pages * words_per_page];
    let mut record = vec![0u32; pages];
    let mut picker = Picker::new(pattern, pages as u64, 10, 1);
    let mut cursor = 0usize;
    let mut write = |n: usize| {
        for _ in 0..n {
            let index = match pattern {
                Pattern::Sequential => {
                    cursor = (cursor + 1) % pages;
                    cursor
                }
                _ => picker.next_index() as usize,
            };
            let generation = next_generation(record[index]);
            record[index] = generation;
            memory[index * words_per_page] = expected_word(index as u64, generation, 0);
        }
    };
    write(2 * pages);
    let start = Instant::now();
    let mut written = 0u64;
    while start.elapsed() < window {
        write(2048);
        written += 2048;
    }
    let rate = written as f64 / start.elapsed().as_secs_f64();
    // The stores are observed, so the compiler may not drop them.
    std::hint::black_box(&memory);
    rate
}
