//! `ferry run`: boot a VM and stay with it until it stops.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ferry_migrate::events::EventLog;
use ferry_migrate::snapshot::Loading;
use ferry_migrate::transport::Address;
use ferry_migrate::transport::tls::{DestinationTls, Side};
use ferry_migrate::{MigrateError, Phase, Progress};
use ferry_vmm::api::server::ApiServer;
use ferry_vmm::memory::HostPages;
use ferry_vmm::snapshot::ChangedImage;
use ferry_vmm::{GuestKind, RunState, SerialOutput, StopReason, Vm, VmConfig, VmHandle};

use crate::UsageError;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Guest RAM, e.g. 512M, 2G, 64G, or `max` for the most this host's KVM and the guest
    /// allow (511G for the built-in guest; said on start). RAM is sparse: untouched memory
    /// costs nothing, and a migration's cost follows the memory the guest touched.
    #[arg(long, default_value = "2G", value_parser = crate::sizes::parse_memory)]
    memory: crate::sizes::MemorySize,
    /// vCPUs (the PVH boot path starts one).
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// `builtin` for ferry's test guest, or a path to a PVH ELF kernel.
    #[arg(long, default_value = "builtin")]
    guest: String,
    /// Guest command line; for the built-in guest see `ferry guest --params`.
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Where the guest's serial port goes: `stdout`, `none`, or a file path.
    #[arg(long, default_value = "stdout")]
    serial: String,
    /// Serve the control API (JSON over HTTP) on this Unix socket. Whoever can connect to it
    /// can migrate the guest anywhere or stop it: it is created with --api-socket-mode.
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// The API socket's permission bits, in octal, whatever the umask: 600 lets only this
    /// user connect; 660 lets the socket's group too (for a management daemon in it).
    #[arg(long, default_value = "600", value_parser = crate::peers::parse_mode)]
    api_socket_mode: u32,
    /// Boot nothing: wait for a migration on `tcp:HOST:PORT` or `unix:PATH`, then run the
    /// guest it brings. The API socket answers while it waits.
    #[arg(long, value_name = "tcp:HOST:PORT|unix:PATH")]
    incoming: Option<String>,
    /// Start the guest from a snapshot written by `ferry snapshot` instead of booting: the
    /// VM's RAM size, vCPUs and balloon come from the file. Eager by default: all of RAM is
    /// read (every page checked against its CRC) before the guest resumes.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["incoming", "memory", "vcpus", "guest", "cmdline", "prealloc", "hugepages", "balloon"])]
    restore: Option<PathBuf>,
    /// With --restore: resume the guest as soon as its state is loaded; the pages it touches
    /// are read from the file on demand (userfaultfd) while a background loader reads the
    /// rest, the pages the snapshot found hottest first.
    #[arg(long, requires = "restore")]
    lazy: bool,
    /// With --restore: map the snapshot's RAM into the guest copy-on-write instead of reading
    /// it: the guest runs at once, its pages come from the page cache on first touch, and
    /// VMs mapped from one file share them. Its pages are not checked against their CRCs, the
    /// file must not change while the VM runs, and the VM cannot be migrated or snapshotted.
    #[arg(long, requires = "restore", conflicts_with = "lazy")]
    map: bool,
    /// With --restore --lazy: ignore the snapshot's hot set (to measure what it saves).
    #[arg(long, requires = "lazy", hide = true)]
    no_hot_set: bool,
    /// With --restore --disk: take an image whose mtime or allocated map differs from the one
    /// the snapshot recorded (its size must still match), when you know it holds what the
    /// snapshot's guest left there (a copy made without its timestamps, say).
    #[arg(long, requires_all = ["restore", "disk"])]
    disk_changed_ok: bool,
    /// Once the guest has migrated away from this process, wait for the next migration on
    /// this address instead of staying paused: the process becomes a destination again, with
    /// the same API socket and TLS, for as many hops as come (`ferry bench soak` migrates a
    /// guest back and forth between two such processes).
    #[arg(long, value_name = "tcp:HOST:PORT|unix:PATH")]
    then_incoming: Option<String>,
    /// When an incoming migration ends before any guest ran here (the source cancelled it,
    /// or it failed), wait for the next one on the same address instead of exiting, so the
    /// source can simply try again. A cancel here (ferry cancel, Ctrl-C) still exits.
    #[arg(long)]
    incoming_retry: bool,
    /// With --incoming: populate all of guest RAM before waiting (one thread per core), so the
    /// migration copies into memory that is already there. The guest's RAM is no longer
    /// sparse on this host.
    #[arg(long, requires = "incoming")]
    prealloc: bool,
    /// With --incoming: give up on a source that sends nothing at all for this long (stopped,
    /// hung, its host gone without a reset) as on a broken connection: before the handover no
    /// guest runs here; in postcopy the migration pauses for a recovery.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    peer_timeout: std::time::Duration,
    #[command(flatten)]
    incoming_socket: crate::peers::IncomingSocketArgs,
    /// With --incoming: TLS on every connection (see --tls-dir).
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
    /// With TLS: take only sources whose certificate carries this name (a DNS name or IP
    /// address; repeat for more). Default: any certificate the CA signed (QEMU: tls-authz).
    #[arg(long, value_name = "NAME")]
    tls_allow: Vec<String>,
    /// Back guest RAM with 2 MiB huge pages from the host's hugetlbfs pool (reserve them
    /// first: /proc/sys/vm/nr_hugepages); all of RAM is reserved at start. Precopy migrates it
    /// (into a destination started with --hugepages too, or not), and so does postcopy, in
    /// whole 2 MiB pages when the destination is on huge pages.
    #[arg(long)]
    hugepages: bool,
    /// A virtio-balloon device (virtio-mmio, announced on the guest's command line): free page
    /// hinting for migrations, `ferry balloon` to inflate or deflate, statistics and free page
    /// reporting. On by default; a destination must match its source.
    #[arg(long, value_enum, default_value = "on", value_name = "on|off")]
    pub balloon: crate::migrate::OnOff,
    /// A virtio-blk disk (virtio-mmio) over a raw image file: PATH[,readonly][,cache=none|writeback].
    /// The file must exist (`truncate -s 8G disk.img` makes a sparse one); `cache=none` opens
    /// it with O_DIRECT, bypassing the host's page cache (writeback, the default, uses it).
    /// A migration's destination names the same image (shared storage) and opens it only when
    /// the guest's state arrives, after the source flushed it and stopped writing.
    #[arg(long, value_name = "PATH[,readonly][,cache=none|writeback]")]
    pub disk: Option<ferry_vmm::DiskOptions>,
    /// A virtio-net NIC (virtio-mmio) over a tap device: tap=NAME (attached, or made if none
    /// exists) or fd=N (an inherited descriptor of a tap), and mac=MAC (random if not given;
    /// a migrated guest keeps its source's). A migration's destination gives its own tap and
    /// announces the guest's MAC once it runs there.
    #[arg(long, value_name = "tap=NAME|fd=N[,mac=MAC]")]
    pub net: Option<ferry_vmm::devices::virtio::net::NetOptions>,
    /// Track the pages a migration must send again with KVM's dirty ring, N entries per vCPU
    /// (a power of two, 256 to 65536), instead of the memory slots' dirty bitmaps: a sync
    /// reads what was dirtied rather than every logged slot's bitmap, and it knows which vCPU
    /// dirtied a page, which `ferry migrate --dirty-limit` needs. Off by default (the bitmap).
    #[arg(long, value_name = "N", value_parser = dirty_ring_entries)]
    pub dirty_ring: Option<u32>,
    /// Stand for a newer ferry in the version-range tests: the telemetry port writes its next
    /// section layout and loads today's too, so this VM takes a guest from an ordinary ferry
    /// and an ordinary ferry refuses its guest before the pause.
    #[arg(long, hide = true)]
    next_section_layout: bool,
}

/// `--dirty-ring`'s value: a ring size KVM takes.
fn dirty_ring_entries(s: &str) -> Result<u32, String> {
    let n: u32 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of entries"))?;
    ferry_vmm::kvm::ring::check_entries(n).map_err(|e| e.to_string())?;
    Ok(n)
}

/// How this process waits for each incoming migration.
struct Wait {
    ready: Ready,
    tls: Option<Arc<DestinationTls>>,
    peer_timeout: std::time::Duration,
    /// The incoming Unix socket's mode (--incoming-socket-mode).
    socket_mode: u32,
    /// Uids besides this VMM's own that may hand a guest over locally (--allow-uid).
    allow_uids: Vec<u32>,
}

/// How an incoming VM's RAM is readied before the migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ready {
    /// Left sparse: pages are allocated as they arrive.
    Sparse,
    /// Every page populated ahead (`--prealloc`).
    Prealloc,
}

/// What Ctrl-C (or SIGTERM) acts on: the wait for an incoming migration, then the VM. A VM
/// migrating away is not simply stopped: a migration in precopy is cancelled first (the guest
/// would be lost with nothing running it), and one that may already have handed the guest over
/// refuses the stop, since this copy may be all the guest's memory there is.
#[derive(Debug, Default)]
struct Interrupt {
    requested: AtomicBool,
    /// Ctrl-C cancelled a migration away before stopping the VM: the exit says so.
    cancelled_migration: AtomicBool,
    vm: Mutex<Option<VmHandle>>,
}

/// Longest Ctrl-C waits for a cancelled migration to end before it stops the VM.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

impl Interrupt {
    fn install() -> anyhow::Result<Arc<Interrupt>> {
        let me = Arc::new(Interrupt::default());
        let handler = me.clone();
        ctrlc::set_handler(move || handler.interrupted())
            .context("cannot install the Ctrl-C handler")?;
        Ok(me)
    }

    fn interrupted(&self) {
        self.requested.store(true, Ordering::Relaxed);
        let Some(vm) = self.vm.lock().unwrap().clone() else {
            return;
        };
        match vm.migration() {
            Some(p) if p.is_cancellable() => {
                eprintln!("ferry: interrupted during a migration: cancelling it first");
                vm.cancel_migration();
                let deadline = Instant::now() + CANCEL_WAIT;
                while vm.migration().is_some_and(|p| p.is_cancellable())
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                self.cancelled_migration.store(true, Ordering::Relaxed);
                vm.stop(StopReason::Requested(
                    "Ctrl-C, after cancelling the migration".into(),
                ));
            }
            Some(p) if p.phase.is_active() => {
                eprintln!(
                    "ferry: interrupt refused: the migration is handing the guest over (or has), and this VMM may hold the only copy of its memory; wait for the migration to end (ferry status), or kill the process if the guest is to be lost"
                );
            }
            _ => vm.stop(StopReason::Requested("Ctrl-C".into())),
        }
    }

    fn requested(&self) -> bool {
        self.requested.load(Ordering::Relaxed)
    }
}

/// How a `ferry run --incoming` ended without a guest to run.
#[derive(Debug)]
enum NoGuest {
    /// Cancelled here (API or Ctrl-C) or shut down before the guest arrived.
    Stopped(String),
    /// The migration ended before any guest ran here, cancelled by the source or failed:
    /// another may come (`--incoming-retry`).
    Ended {
        cancelled: bool,
        why: anyhow::Error,
    },
    Failed(anyhow::Error),
}

/// Waits for a migration on `spec`, with the API (if asked for) answering from the start, and
/// returns the VM running the guest it brought.
fn receive(
    config: VmConfig,
    spec: &str,
    wait: &Wait,
    interrupt: &Interrupt,
    api: &mut Api,
    previous: Option<Progress>,
    earlier_events: Option<Arc<EventLog>>,
) -> Result<Vm, NoGuest> {
    let Wait {
        ready,
        ref tls,
        peer_timeout,
        socket_mode,
        ref allow_uids,
    } = *wait;
    let address: Address = spec
        .parse()
        .map_err(|e| NoGuest::Failed(anyhow::Error::new(e)))?;
    let secured = tls.is_some();
    let mut incoming = Vm::incoming(config).map_err(|e| NoGuest::Failed(e.into()))?;
    incoming.control().set_peer_timeout(Some(peer_timeout));
    incoming.control().set_allow_uids(allow_uids.clone());
    let handle = incoming.handle();
    if let Some(previous) = previous {
        handle.set_previous_migration(previous);
    }
    // One log for the process's VMs, as a watcher of its API sees them: the numbers run on.
    if let Some(earlier) = earlier_events {
        handle.events().carry_on_from(&earlier);
    }
    *interrupt.vm.lock().unwrap() = Some(handle.clone());
    // Preallocation comes before the listener, as QEMU's: a destination that accepted a
    // source while it populated would hold that source in its setup for the whole population
    // (25 s for 8 GiB of cold memory here). The API answers meanwhile, "preparing".
    if ready == Ready::Prealloc {
        incoming
            .control()
            .preparing("populating guest RAM", handle.ram().size());
    }
    api.serve(&handle).map_err(NoGuest::Failed)?;
    if ready == Ready::Prealloc {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        eprintln!(
            "ferry: populating {} MiB of guest RAM before listening ({threads} threads)",
            handle.ram().size() >> 20
        );
        let took = handle
            .ram()
            .prealloc(threads)
            .context(
                "cannot preallocate guest RAM (--prealloc); run without it, or free host memory",
            )
            .map_err(NoGuest::Failed)?;
        eprintln!(
            "ferry: preallocated {} MiB of guest RAM in {} ms ({threads} threads)",
            handle.ram().size() >> 20,
            took.as_millis()
        );
    }
    let listener = handle
        .listen_incoming(&address, tls.clone(), socket_mode)
        .map_err(|e| NoGuest::Failed(anyhow::Error::new(e)))?;
    eprintln!(
        "ferry: waiting for a migration on {}{}",
        listener.local(),
        if secured { " (TLS)" } else { "" }
    );
    let received =
        ferry_vmm::migration::receive(&mut incoming, listener.as_ref(), &|| !interrupt.requested());
    let stats = match received {
        Ok(stats) => stats,
        Err(_) if handle.state() == RunState::Stopped => {
            return Err(NoGuest::Stopped(format!(
                "{}; {}",
                handle
                    .status()
                    .stop_reason
                    .map_or("stopped".into(), |r| r.to_string()),
                match incoming.guest_ran() {
                    true => "the guest ran here until then, and is gone",
                    false => "no guest ran here",
                }
            )));
        }
        Err(MigrateError::CancelledHere) => {
            return Err(NoGuest::Stopped(
                "the incoming migration was cancelled; no guest ran here".into(),
            ));
        }
        Err(e @ MigrateError::CancelledThere(..)) if !incoming.guest_ran() => {
            return Err(NoGuest::Ended {
                cancelled: true,
                why: anyhow::Error::new(e).context("no guest ran here"),
            });
        }
        Err(e) if !incoming.guest_ran() => {
            return Err(NoGuest::Ended {
                cancelled: false,
                why: anyhow::Error::new(e)
                    .context("the incoming migration failed; no guest ran here"),
            });
        }
        Err(e) => {
            return Err(NoGuest::Failed(anyhow::Error::new(e).context(
                "the incoming migration failed after the guest ran here; it is gone",
            )));
        }
    };
    eprintln!(
        "ferry: migration received: {} pages, {} zero pages in {} passes; state loaded in {:.1} ms, guest resumed in {:.1} ms",
        stats.pages,
        stats.zero_pages,
        stats.passes,
        stats.load.as_secs_f64() * 1e3,
        stats.resume.as_secs_f64() * 1e3
    );
    if stats.compressed_records > 0 {
        eprintln!(
            "ferry: {} compressed records decoded in {:.3} CPU seconds",
            stats.compressed_records,
            stats.decompress_cpu_ns as f64 / 1e9
        );
    }
    let vm = incoming.into_running().ok_or_else(|| {
        NoGuest::Failed(anyhow::anyhow!(
            "the migration ended without resuming the guest"
        ))
    })?;
    Ok(vm)
}

/// The control API, if one was asked for: one server for the process, answering for its
/// VM of the moment.
struct Api {
    path: Option<PathBuf>,
    mode: u32,
    server: Option<ApiServer>,
}

impl Api {
    /// Answers for `handle` from now on, starting the server on first use.
    fn serve(&mut self, handle: &VmHandle) -> anyhow::Result<()> {
        match (&self.server, &self.path) {
            (Some(server), _) => server.serve(handle.clone()),
            (None, Some(path)) => {
                let server =
                    ApiServer::start_with_mode(path, self.mode, handle.clone()).map_err(|e| {
                        handle.stop(StopReason::Requested("API socket unavailable".into()));
                        anyhow::Error::new(e)
                    })?;
                self.server = Some(server);
            }
            (None, None) => {}
        }
        Ok(())
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let tls = destination_tls(&args)?;
    let (kernel, guest): (Arc<[u8]>, GuestKind) = if args.guest == "builtin" {
        (Arc::from(ferry_guest_image::ELF), GuestKind::FerryGuest)
    } else {
        let bytes = std::fs::read(&args.guest).with_context(|| {
            format!(
                "cannot read guest kernel {}; give a PVH ELF or `builtin`",
                args.guest
            )
        })?;
        (Arc::from(bytes), GuestKind::Foreign)
    };
    let serial = match args.serial.as_str() {
        "stdout" => SerialOutput::Stdout,
        "none" => SerialOutput::Discard,
        path => SerialOutput::File(path.into()),
    };
    let config = VmConfig {
        memory_bytes: crate::sizes::memory_size(args.memory, guest)?,
        vcpus: args.vcpus,
        kernel,
        cmdline: args.cmdline,
        guest,
        serial,
        balloon: args.balloon == crate::migrate::OnOff::On,
        disk: args.disk.clone(),
        net: args.net.clone(),
        dirty_ring: args.dirty_ring,
        host_pages: if args.hugepages {
            HostPages::Huge2M
        } else {
            HostPages::Small
        },
        next_layout: args.next_section_layout,
    };
    if args.incoming_retry && args.incoming.is_none() && args.then_incoming.is_none() {
        return Err(UsageError(
            "--incoming-retry is for a destination; give --incoming (or --then-incoming) too"
                .into(),
        )
        .into());
    }
    args.incoming_socket.check(
        match args.incoming.is_some() || args.then_incoming.is_some() {
            true => crate::peers::Waits::ForAMigration,
            false => crate::peers::Waits::Never,
        },
    )?;
    let interrupt = Interrupt::install()?;
    if args.peer_timeout.is_zero() {
        anyhow::bail!(
            "--peer-timeout 0 would give up on every source at once; give a positive timeout (default 30s)"
        );
    }
    let wait = Wait {
        ready: if args.prealloc {
            Ready::Prealloc
        } else {
            Ready::Sparse
        },
        tls,
        peer_timeout: args.peer_timeout,
        socket_mode: args.incoming_socket.socket_mode(),
        allow_uids: args.incoming_socket.allow.allow_uid.clone(),
    };
    let mut wait_on = args.incoming.clone();
    let mut restore_from = args.restore.clone();
    let mut previous = None;
    let mut earlier_events = None;
    let mut api = Api {
        path: args.api_socket.clone(),
        mode: args.api_socket_mode,
        server: None,
    };
    loop {
        let vm = match &wait_on {
            None if restore_from.is_some() => {
                let file = restore_from.take().expect("checked");
                let how = crate::restore::How {
                    loading: match (args.lazy, args.map) {
                        (true, _) => Loading::Lazy,
                        (_, true) => Loading::Mapped,
                        _ => Loading::Eager,
                    },
                    hot_first: !args.no_hot_set,
                    changed_image: match args.disk_changed_ok {
                        true => ChangedImage::Accept,
                        false => ChangedImage::Refuse,
                    },
                };
                let vm = crate::restore::restore(&config, &file, &how)?;
                api.serve(&vm.handle())?;
                vm
            }
            None => {
                let vm = Vm::boot(config.clone())?;
                api.serve(&vm.handle())?;
                vm
            }
            Some(spec) => match receive(
                config.clone(),
                spec,
                &wait,
                &interrupt,
                &mut api,
                previous.take(),
                earlier_events.take(),
            ) {
                Ok(got) => got,
                Err(NoGuest::Stopped(why)) => {
                    eprintln!("ferry: {why}");
                    return Ok(ExitCode::from(crate::exit::CANCELLED));
                }
                Err(NoGuest::Ended { why, .. }) if args.incoming_retry => {
                    eprintln!(
                        "ferry: {}\nferry: waiting for the next migration on {spec} (--incoming-retry)",
                        crate::exit::error_text(&why)
                    );
                    continue;
                }
                Err(NoGuest::Ended {
                    cancelled: true,
                    why,
                }) => {
                    eprintln!("ferry: {}", crate::exit::error_text(&why));
                    return Ok(ExitCode::from(crate::exit::CANCELLED));
                }
                Err(NoGuest::Ended { why, .. } | NoGuest::Failed(why)) => return Err(why),
            },
        };
        let handle = vm.handle();
        if let Some(next) = &args.then_incoming {
            handle.set_then_incoming(next);
        }
        *interrupt.vm.lock().unwrap() = Some(handle.clone());
        if interrupt.requested() {
            interrupt.interrupted();
        }
        let reason = match &args.then_incoming {
            Some(next) => match wait_unless_migrated(vm, Away::Any) {
                Ended::Stopped(reason) => reason,
                Ended::MigratedAway(progress) => {
                    // Every reference to the VM goes (the API's when it answers for the
                    // next), so that its memory and descriptors are given back hop after hop.
                    *interrupt.vm.lock().unwrap() = None;
                    earlier_events = Some(handle.events());
                    drop(handle);
                    eprintln!(
                        "ferry: the guest migrated away; this VMM waits for the next migration"
                    );
                    wait_on = Some(next.clone());
                    previous = Some(*progress);
                    continue;
                }
            },
            // A local handover's old process has nothing left: the guest's memory is the new
            // one's, and so is the guest.
            None => match wait_unless_migrated(vm, Away::Locally) {
                Ended::Stopped(reason) => reason,
                Ended::MigratedAway(_) => {
                    handle.wait_ending_read(ENDING_READ);
                    drop(api);
                    eprintln!(
                        "ferry: the guest was handed over to the process on this host that received it (--local); this one exits"
                    );
                    return Ok(ExitCode::SUCCESS);
                }
            },
        };
        drop(api);
        let t = handle.telemetry();
        eprintln!(
            "ferry: VM stopped after {:.1} s: {reason}\nferry: guest wrote {} pages; {} verify passes, {} failed",
            handle.status().uptime_ms as f64 / 1000.0,
            t.pages_written,
            t.verify_passes,
            t.verify_failures,
        );
        if let Some(d) = &t.disk {
            eprintln!(
                "ferry: guest disk: {} blocks written, {} read back; {} bad, {} request errors",
                d.blocks_written, d.blocks_read, d.verify_failures, d.request_errors
            );
        }
        if let Some(n) = &t.net {
            eprintln!(
                "ferry: guest network: {} frames received, {} echoes sent; {} numbers skipped, {} out of order",
                n.frames_received, n.echoes_sent, n.seq_gaps, n.duplicates
            );
        }
        if interrupt.cancelled_migration.load(Ordering::Relaxed) {
            eprintln!("ferry: the migration away was cancelled, then the VM stopped");
            return Ok(ExitCode::from(crate::exit::CANCELLED));
        }
        return Ok(match reason {
            StopReason::Failed(_) => ExitCode::FAILURE,
            StopReason::GuestHalted(_) | StopReason::Requested(_) => ExitCode::SUCCESS,
        });
    }
}

/// How a VM that may migrate away ended here.
enum Ended {
    Stopped(StopReason),
    /// A migration handed the guest over, and ended so; this VM is stopped and its threads
    /// are gone.
    MigratedAway(Box<Progress>),
}

/// Longest a process that handed its guest over locally waits for its `ferry migrate` to read
/// the end (it looks every 200 ms) before it exits; a detached one never asks.
const ENDING_READ: Duration = Duration::from_secs(2);

/// How often a VM that may migrate away is looked at.
const HANDOVER_POLL: Duration = Duration::from_millis(20);

/// Which migrations away end a VM's wait.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Away {
    /// Any that handed the guest over.
    Any,
    /// Only a local handover (other sources stay paused, as QEMU's do, for the operator).
    Locally,
}

/// Waits until `vm` stops or a migration of it that `away` names completes (the guest then
/// runs elsewhere, and this paused copy is stopped).
fn wait_unless_migrated(vm: Vm, away: Away) -> Ended {
    let handle = vm.handle();
    loop {
        if handle.wait_stopped(Some(HANDOVER_POLL)).is_some() {
            return Ended::Stopped(vm.wait());
        }
        // A snapshot completes too, in the same slot, and hands nothing over.
        if let Some(done) = handle
            .migration()
            .filter(|p| p.phase == Phase::Completed && p.handed_over)
            .filter(|p| away == Away::Any || p.local)
        {
            handle.stop(StopReason::Requested("migrated away".into()));
            vm.wait();
            return Ended::MigratedAway(Box::new(done));
        }
    }
}

/// The destination's TLS from `ferry run`'s flags: only with --incoming, and --tls-allow only
/// with TLS.
fn destination_tls(args: &RunArgs) -> anyhow::Result<Option<Arc<DestinationTls>>> {
    let Some(files) = args.tls.files(Side::Destination)? else {
        if !args.tls_allow.is_empty() {
            return Err(UsageError(
                "--tls-allow restricts TLS sources; give --tls-dir (or --tls-ca, --tls-cert and --tls-key) too".into(),
            )
            .into());
        }
        return Ok(None);
    };
    if args.incoming.is_none() && args.then_incoming.is_none() {
        return Err(UsageError(
            "TLS flags on ferry run are for a destination (--incoming); give a source's TLS to ferry migrate".into(),
        )
        .into());
    }
    Ok(Some(Arc::new(DestinationTls::new(
        &files,
        &args.tls_allow,
    )?)))
}
