//! `ferry bench hostile`: strangers thrown at a destination's migration port, while it waits
//! and while a real migration runs into it, against the same migration without them.
//!
//! Two VMM processes (`ferry run --then-incoming`, as in the soak): the guest starts in the
//! first, the second waits. Phase one: strangers at the waiting second process. Then the
//! reference: the guest migrates to the second with nobody else on the port. Phase two: the
//! guest migrates back to the first while strangers hit the first's port. Each migration must
//! complete and the guest verify clean after it; each stranger at the waiting destination must
//! be dropped and counted (`rejected_connections`); each process's descriptors and resident
//! memory are printed before and after the strangers.
//!
//! The strangers, from several threads, each a new connection on loopback, in turn: 64 bytes
//! of garbage, an HTTP request, the start of a TLS ClientHello, a hello trickled a byte every
//! 100 ms, a connection that says nothing, and a valid data hello naming another migration.

use std::io::Write;
use std::net::TcpStream;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use ferry_migrate::wire::{Capabilities, HELLO_SIZE, Hello, Role};
use ferry_vmm::request::MigrationRequest;
use serde_json::json;

use super::process::{HopPair, Migrated, STEP_LIMIT, Vmm, at, migrate_and_verify};

#[derive(Debug, Args)]
pub struct HostileBenchArgs {
    /// How long the strangers hit the waiting destination.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    waiting: Duration,
    /// Threads that open stranger connections, one after another each.
    #[arg(long, default_value_t = 16)]
    threads: usize,
    /// Guest RAM of the VM.
    #[arg(long, default_value = "512M", value_parser = crate::sizes::parse_size)]
    memory: u64,
    /// The guest's workload.
    #[arg(
        long,
        default_value = "ws=128M pattern=random rate=40 verify-ms=100 log-ms=0"
    )]
    cmdline: String,
}

/// Strangers at `port` from `threads` threads until `stop`; returns how many connected.
fn strangers(port: u16, threads: usize, stop: &AtomicBool) -> u64 {
    let opened = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let opened = &opened;
            s.spawn(move || {
                let mut kind = t;
                while !stop.load(Ordering::Acquire) {
                    if let Ok(c) = TcpStream::connect(("127.0.0.1", port)) {
                        opened.fetch_add(1, Ordering::Relaxed);
                        stranger(c, kind, stop);
                    }
                    kind += 1;
                }
            });
        }
    });
    opened.load(Ordering::Relaxed)
}

/// One stranger of kind `kind % 6` on `c`.
fn stranger(mut c: TcpStream, kind: usize, stop: &AtomicBool) {
    let _ = c.set_write_timeout(Some(Duration::from_secs(1)));
    let bytes: Vec<u8> = match kind % 6 {
        0 => vec![0xa5; 64],
        1 => format!("{:<64}", "GET / HTTP/1.1\r\nHost: ferry\r\n\r\n").into_bytes(),
        2 => {
            let mut b = vec![0x16, 0x03, 0x01, 0x00, 0x3c, 0x01];
            b.resize(64, 0);
            b
        }
        3 => {
            // A hello trickled: a byte every 100 ms, never whole within the bench.
            for b in foreign_hello(Role::Main).iter().take(20) {
                if stop.load(Ordering::Acquire) || c.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            return;
        }
        4 => {
            std::thread::sleep(Duration::from_millis(200));
            return;
        }
        _ => foreign_hello(Role::Data).to_vec(),
    };
    let _ = c.write_all(&bytes);
    // Read whatever answer comes, so that the destination's reply never blocks on us.
    let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = std::io::Read::read(&mut c, &mut [0u8; 64]);
}

/// A valid hello of `role` for a migration that is not under way (a stranger's uuid).
fn foreign_hello(role: Role) -> [u8; HELLO_SIZE] {
    Hello {
        role,
        channel: u16::from(role == Role::Data),
        uuid: [0xee; 16],
        memory_size: 1 << 30,
        status: 0,
        channels: 1,
        capabilities: Capabilities::NONE,
        postcopy_page_shift: 0,
    }
    .encode()
}

/// The destination's count of dropped connections (its incoming progress).
fn rejected(vmm: &Vmm) -> u64 {
    vmm.get("/migration")
        .and_then(|m| m["rejected_connections"].as_u64())
        .unwrap_or(0)
}

/// Waits (bounded) until `vmm` has counted `want` more dropped connections than `from`.
fn settle(vmm: &Vmm, from: u64, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let n = rejected(vmm) - from;
        if n >= want || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(args: &HostileBenchArgs) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir()?;
    let HopPair {
        first: mut a,
        second: mut b,
        port_a,
        port_b,
        ..
    } = HopPair::start(dir.path(), args.memory, &args.cmdline)?;
    let body = |port: u16| MigrationRequest {
        timeout_ms: Some(STEP_LIMIT.as_millis() as u64),
        ..MigrationRequest::to(at(port))
    };

    // Phase one: strangers at the waiting second process.
    let b_start = b.usage()?;
    let before = rejected(&b);
    let stop = AtomicBool::new(false);
    let opened = std::thread::scope(|s| {
        let hitting = s.spawn(|| strangers(port_b, args.threads, &stop));
        std::thread::sleep(args.waiting);
        stop.store(true, Ordering::Release);
        hitting.join().expect("the strangers' threads")
    });
    let dropped = settle(&b, before, opened);
    b.waiting()
        .context("the destination is still waiting after the strangers")?;
    let b_after = b.usage()?;

    // The reference: the guest to the second process, nobody else on the port.
    let Migrated { stats: plain, .. } = migrate_and_verify(&mut a, &mut b, &body(port_b))?;
    a.waiting()?;
    // What a process holding the guest takes without strangers: the reference for the first
    // process once the guest is back in it.
    let b_guest = b.usage()?;

    // Phase two: the guest back to the first process, strangers on its port throughout.
    let a_start = a.usage()?;
    let before_a = rejected(&a);
    let stop = AtomicBool::new(false);
    let (hostile, opened_during) = std::thread::scope(|s| {
        let hitting = s.spawn(|| strangers(port_a, args.threads, &stop));
        // Strangers first, then the source.
        std::thread::sleep(Duration::from_millis(200));
        let migrated = migrate_and_verify(&mut b, &mut a, &body(port_a));
        stop.store(true, Ordering::Release);
        (migrated, hitting.join().expect("the strangers' threads"))
    });
    let Migrated { stats: hostile, .. } = hostile?;
    let dropped_during = settle(&a, before_a, opened_during);
    let a_after = a.usage()?;

    println!("{:<28} {:>12} {:>12}", "", "waiting", "during migration");
    // The second column's "after" holds the guest, which arrived with the migration.
    println!(
        "{:<28} {:>12} {:>12}",
        "connections opened", opened, opened_during
    );
    println!(
        "{:<28} {:>12} {:>12}",
        "dropped and counted", dropped, dropped_during
    );
    println!(
        "{:<28} {:>12} {:>12}",
        "descriptors before -> after",
        format!("{} -> {}", b_start.0, b_after.0),
        format!("{} -> {}", a_start.0, a_after.0)
    );
    println!(
        "{:<28} {:>12} {:>12}",
        "RSS MiB before -> after",
        format!("{} -> {}", b_start.1 >> 10, b_after.1 >> 10),
        format!("{} -> {}", a_start.1 >> 10, a_after.1 >> 10)
    );
    println!(
        "{:<28} {:>12} {:>12}",
        "RSS MiB holding the guest",
        format!("{}", b_guest.1 >> 10),
        format!("{}", a_after.1 >> 10)
    );
    println!(
        "migration: {:.0} ms without strangers, {:.0} ms with them; the guest verified clean after both",
        plain.total_ms, hostile.total_ms
    );
    println!(
        "{}",
        json!({
            "bench": "hostile",
            "waiting": {"opened": opened, "dropped": dropped,
                "fds_before": b_start.0, "fds_after": b_after.0,
                "rss_kib_before": b_start.1, "rss_kib_after": b_after.1},
            "during_migration": {"opened": opened_during, "dropped": dropped_during,
                "fds_before": a_start.0, "fds_after": a_after.0,
                "rss_kib_before": a_start.1, "rss_kib_after": a_after.1},
            "rss_kib_holding_the_guest": {"without_strangers": b_guest.1, "with_strangers": a_after.1},
            "migration_ms": plain.total_ms,
            "migration_with_strangers_ms": hostile.total_ms,
        })
    );
    // During the migration the count can fall short: connections that reach the port as
    // the migration completes wait in a backlog nobody accepts any more, and are reset.
    if dropped < opened {
        bail!(
            "not every stranger at the waiting destination was dropped and counted: {dropped} of {opened}"
        );
    }
    Ok(ExitCode::SUCCESS)
}
