//! A VM: its RAM, its vCPU thread, its devices, and the control state that pauses, resumes and
//! stops it. [`Vm::boot`] starts a fresh guest; [`Vm::incoming`] prepares an empty VM that a
//! migration fills and then starts.
//!
//! Control is a small state machine under one mutex. The controller sets the desired state and
//! kicks the vCPU threads (see `kvm::kick`); each vCPU thread looks at the desired state before
//! every `KVM_RUN`, parks while paused and leaves when stopped. `pause` returns only once every
//! vCPU is parked, so a paused VM's memory and registers are still (and a migration may read
//! the vCPU, whose mutex a parked thread does not hold).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::VcpuFd;
use serde::Serialize;

use crate::boot;
use crate::devices::irq::IrqLine;
use crate::devices::serial::{SerialDevice, SerialOutput};
use crate::devices::telemetry::GuestTelemetry;
use crate::devices::telemetry_port::{self, TelemetryPort};
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::{MmioTransport, mmio};
use crate::devices::{BusKind, Devices};
use crate::error::VmmError;
use crate::kvm::{self, KvmVm, irqchip, kick, vcpu};
use crate::memory::{self, GuestRam};
use crate::throttle::{self, Throttle};
use ferry_guest_abi::smp::{START_PORT, START_SIZE, StartVcpu};

/// What kind of kernel the VM boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestKind {
    /// ferry's test guest (or one that speaks its ABI): the command line is checked with the
    /// guest's own parser and the working set against the RAM before boot.
    FerryGuest,
    /// Any other PVH kernel: its command line is passed through unchecked.
    Foreign,
}

/// Everything needed to boot a VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub memory_bytes: u64,
    pub vcpus: u8,
    pub kernel: Arc<[u8]>,
    pub cmdline: String,
    pub guest: GuestKind,
    pub serial: SerialOutput,
    /// What guest RAM is made of: 4 KiB pages, or 2 MiB huge pages (`--hugepages`).
    pub host_pages: crate::memory::HostPages,
    /// A virtio-balloon on virtio-mmio (announced on the command line): free page hinting
    /// for migrations, inflate/deflate, statistics and free page reporting.
    pub balloon: bool,
}

impl VmConfig {
    /// The guest's command line: the user's, for ferry's guest `vcpus=`, and the balloon's
    /// `virtio_mmio.device=` when the VM has one (later keys win, so the VM's own facts
    /// override the user's).
    pub fn full_cmdline(&self) -> String {
        let mut words: Vec<String> = Vec::new();
        if !self.cmdline.is_empty() {
            words.push(self.cmdline.clone());
        }
        if self.guest == GuestKind::FerryGuest {
            words.push(format!("vcpus={}", self.vcpus));
        }
        if self.balloon {
            words.push(mmio::cmdline_fragment(BALLOON_MMIO, BALLOON_GSI));
        }
        words.join(" ")
    }
}

/// Most vCPUs a VM may have: the seeds' largest examples (32 and 40) with room, and what one
/// byte of local APIC id in CPUID leaf 1 and a flat PVH start allow without x2APIC.
pub const MAX_VCPUS: u8 = ferry_guest_abi::smp::MAX_VCPUS as u8;

/// Where the balloon's registers are: the first page of the 32-bit MMIO hole above the
/// 3 GiB of RAM below it, far from the IOAPIC and LAPIC windows at its top.
pub const BALLOON_MMIO: u64 = crate::memory::MMIO_HOLE_START + 0x1000_0000;
/// Its interrupt: the first legacy line free of the PC's devices (COM1 and COM2 take 4 and 3).
pub const BALLOON_GSI: u32 = 5;

/// Why a VM stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum StopReason {
    /// The guest halted; the text is its stated reason when it gave one.
    GuestHalted(String),
    /// Someone asked (API, Ctrl-C, the owning program).
    Requested(String),
    /// The VM cannot go on: triple fault, KVM error, unknown exit. Holds the explanation and
    /// a register dump.
    Failed(String),
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::GuestHalted(why) => write!(f, "guest halted ({why})"),
            StopReason::Requested(who) => write!(f, "stopped on request ({who})"),
            StopReason::Failed(why) => write!(f, "VM failed: {why}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// An empty VM readying itself for a migration before it listens (populating its RAM):
    /// a state the API reports, never one the VM is told to be in.
    Preparing,
    /// An empty VM waiting for (or receiving) a migration; no vCPU has run.
    Incoming,
    Running,
    Paused,
    Stopped,
}

#[derive(Debug)]
struct Control {
    desired: RunState,
    stop_reason: Option<StopReason>,
    vcpus_alive: usize,
    vcpus_parked: usize,
    threads: Vec<libc::pthread_t>,
    /// Secondary vCPUs the guest asked to start, by index, until their threads do.
    starts: Vec<Option<StartVcpu>>,
}

/// What every thread of a VM shares.
#[derive(Debug)]
pub(crate) struct Shared {
    control: Mutex<Control>,
    changed: Condvar,
    pub(crate) telemetry: Arc<Mutex<GuestTelemetry>>,
    pub(crate) ram: Arc<GuestRam>,
    pub(crate) kvm: Arc<KvmVm>,
    /// The vCPUs, by id, once created (at build, or for an unprepared destination at its
    /// state load); each one's thread holds its lock only inside `KVM_RUN` and exit handling.
    vcpu_fds: OnceLock<Vec<Arc<Mutex<VcpuFd>>>>,
    /// Fixed once built; each device has a lock of its own.
    pub(crate) devices: Devices,
    /// The balloon (also on the MMIO bus in `devices`), for migrations and the API.
    pub(crate) balloon: Option<Arc<Mutex<MmioTransport<Balloon>>>>,
    /// MSRs this host lets a vCPU save and restore (found with the vCPUs).
    msrs: OnceLock<Vec<u32>>,
    /// Where the last state save or load (and a destination's resume) spent its time.
    pub(crate) state_parts: Mutex<Vec<ferry_migrate::StatePart>>,
    /// What a migration's destination must match (`vmconfig.rs`).
    pub(crate) description: crate::vmconfig::VmDescription,
    pub(crate) migration: Mutex<Option<Arc<ferry_migrate::Control>>>,
    /// On a migration destination: the incoming migration's progress and cancel.
    pub(crate) incoming: Option<Arc<ferry_migrate::destination::IncomingControl>>,
    /// The TLS of the last migration from here, for its postcopy recovery's connections.
    pub(crate) migration_tls: Mutex<Option<Arc<ferry_migrate::transport::tls::SourceTls>>>,
    /// On a migration destination: the TLS its listener requires, for a recovery's listener.
    pub(crate) incoming_tls: Mutex<Option<Arc<ferry_migrate::transport::tls::DestinationTls>>>,
    /// How the last migration away from the VMM that made this VM ended, when the VMM went on
    /// to receive the guest again (`ferry run --then-incoming`): what its follower reads.
    pub(crate) previous_migration: Mutex<Option<ferry_migrate::Progress>>,
    /// Auto-converge's throttle (see `throttle.rs`).
    throttle: Throttle,
    started: Instant,
}

/// A VM whose vCPU threads run. Dropping it stops the VM and joins its threads.
#[derive(Debug)]
pub struct Vm {
    handle: VmHandle,
    threads: Vec<JoinHandle<()>>,
}

/// A cheap, cloneable handle to control and observe a VM from any thread.
#[derive(Clone, Debug)]
pub struct VmHandle(pub(crate) Arc<Shared>);

/// Why a control request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ControlError {
    #[error("the VM has stopped: {0}")]
    Stopped(StopReason),
    #[error(
        "the VM is waiting for an incoming migration and has no guest to pause or resume yet; watch it with GET /migration, or cancel with PUT /migration/cancel"
    )]
    Incoming,
    #[error(
        "{parked} of {alive} vCPUs stopped within {waited:?} of the pause; the VM keeps running. A vCPU that waits on a page that has not arrived (postcopy) cannot stop until it comes: recover or wait for the migration, then pause again"
    )]
    PauseTimeout {
        parked: usize,
        alive: usize,
        waited: Duration,
    },
}

/// Longest [`VmHandle::pause`] waits for every vCPU to stop.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A snapshot for the control API.
#[derive(Clone, Debug, Serialize)]
pub struct VmStatus {
    pub state: RunState,
    pub stop_reason: Option<StopReason>,
    pub memory_bytes: u64,
    /// Host memory guest RAM occupies now (the memfd's allocated bytes).
    pub memory_allocated_bytes: u64,
    pub vcpus: u8,
    /// vCPU threads alive now: every vCPU's while the VM runs or is paused, 0 once it stopped.
    pub vcpu_threads: usize,
    pub uptime_ms: u64,
    /// CPU time the vCPU threads have used, summed (a halted vCPU uses none).
    pub vcpu_cpu_ms: f64,
    /// Auto-converge's throttle in force, percent of each vCPU's time spent asleep.
    pub throttle_percent: u8,
    pub host_monotonic_ns: u64,
    pub guest: GuestTelemetry,
    /// While the state is `preparing`: what, and how far along.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preparing: Option<ferry_migrate::destination::Preparing>,
}

/// How much of a destination is made before the migration's switchover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preparation {
    /// Everything the VM's configuration determines: RAM and its memory slots, devices, the
    /// vCPUs (created, CPUID set) and their threads (started, parked until the guest runs).
    /// During the downtime only state is loaded and the parked threads are woken.
    Prepared,
    /// RAM, memory slots and devices only (pages land in RAM during precopy); the vCPUs are
    /// created at the state load and their threads at resume, in the downtime. The
    /// reference `ferry bench state` measures preparation against.
    Unprepared,
}

/// A VM waiting for an incoming migration: RAM, a KVM VM and vCPUs with nothing loaded.
/// [`crate::migration`] implements the engine's `DestinationVm` on it.
#[derive(Debug)]
pub struct IncomingVm {
    pub(crate) shared: Arc<Shared>,
    /// The vCPU threads: parked from the start when prepared, else started at resume.
    threads: Option<Vm>,
    /// Whether a migration resumed the guest here.
    resumed: bool,
    /// How received pages land, if forced (see [`IncomingVm::land_pages`]).
    pub(crate) landing: Option<ferry_migrate::PageLanding>,
}

impl Vm {
    /// Validates `config`, sets up RAM, loads the guest, creates the KVM VM and starts it.
    /// Everything that can be checked without KVM is checked first.
    pub fn boot(config: VmConfig) -> Result<Vm, VmmError> {
        check_config(&config)?;
        let ram = Arc::new(GuestRam::with_pages(
            config.memory_bytes,
            config.host_pages,
        )?);
        let cmdline = config.full_cmdline();
        let setup = boot::load(&ram, &config.kernel, &cmdline)?;
        if config.guest == GuestKind::FerryGuest {
            boot::check_workload(&cmdline, &ram, setup.image_end)?;
        }
        let shared = build(&config, ram, None)?;
        shared.create_vcpus()?;
        vcpu::set_pvh_entry(&shared.vcpus()[0].lock().unwrap(), &setup)?;
        start(shared)
    }

    /// An empty VM of `config`'s size and devices, ready to receive a migration, prepared
    /// ([`Preparation::Prepared`]). The kernel and command line are not used: the guest
    /// arrives with its memory.
    pub fn incoming(config: VmConfig) -> Result<IncomingVm, VmmError> {
        Vm::incoming_with(config, Preparation::Prepared)
    }

    /// [`Vm::incoming`], as prepared as `preparation` says.
    pub fn incoming_with(
        config: VmConfig,
        preparation: Preparation,
    ) -> Result<IncomingVm, VmmError> {
        check_config(&config)?;
        let ram = Arc::new(GuestRam::with_pages(
            config.memory_bytes,
            config.host_pages,
        )?);
        let control = Arc::new(ferry_migrate::destination::IncomingControl::default());
        let shared = build(&config, ram, Some(control))?;
        let threads = match preparation {
            Preparation::Prepared => {
                shared.create_vcpus()?;
                Some(start(shared.clone())?)
            }
            Preparation::Unprepared => None,
        };
        Ok(IncomingVm {
            shared,
            threads,
            resumed: false,
            landing: None,
        })
    }

    pub fn handle(&self) -> VmHandle {
        self.handle.clone()
    }

    /// Waits until the VM stops and returns why.
    pub fn wait(mut self) -> StopReason {
        self.join()
    }

    fn join(&mut self) -> StopReason {
        let reason = self.handle.wait_stopped(None).expect("no timeout");
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        reason
    }
}

impl IncomingVm {
    pub fn handle(&self) -> VmHandle {
        VmHandle(self.shared.clone())
    }

    /// Makes a migration into this VM land its pages as `landing` says, whatever the RAM is
    /// (`ferry bench ingest` compares both). Without it, pages land in the mapping when RAM was
    /// preallocated and through the memfd when it is sparse, the faster way for each.
    pub fn land_pages(&mut self, landing: ferry_migrate::PageLanding) {
        self.landing = Some(landing);
    }

    /// Whether the migration resumed the guest here (it may have stopped since: a postcopy
    /// failure after the resume stops it with its memory incomplete).
    pub fn guest_ran(&self) -> bool {
        self.resumed
    }

    /// The running VM, once the migration resumed it.
    pub fn into_running(self) -> Option<Vm> {
        self.threads.filter(|_| self.resumed)
    }

    /// The incoming migration's progress and cancel.
    pub fn control(&self) -> Arc<ferry_migrate::destination::IncomingControl> {
        self.shared
            .incoming
            .clone()
            .expect("an incoming VM has its control")
    }

    /// Runs the guest (called by the migration's resume): wakes the parked vCPU threads, or
    /// starts them if unprepared. Returns the step, for the downtime breakdown.
    pub(crate) fn start(&mut self) -> Result<&'static str, VmmError> {
        {
            let mut c = self.shared.control.lock().unwrap();
            if let Some(r) = &c.stop_reason {
                return Err(VmmError::Stopped(r.to_string()));
            }
            c.desired = RunState::Running;
            self.shared.changed.notify_all();
        }
        self.resumed = true;
        if self.threads.is_some() {
            return Ok("wake vCPU threads");
        }
        self.threads = Some(start(self.shared.clone())?);
        Ok("start vCPU threads")
    }
}

fn check_config(config: &VmConfig) -> Result<(), VmmError> {
    if !(1..=MAX_VCPUS).contains(&config.vcpus) {
        return Err(VmmError::Vcpus(config.vcpus));
    }
    memory::validate_size(config.memory_bytes)?;
    crate::limit::MemoryLimit::of_host(&kvm::open()?, config.guest).check(config.memory_bytes)?;
    if config.guest == GuestKind::FerryGuest {
        // The VMM tells the guest its vCPU count; a vcpus= of the user's that says otherwise
        // was silently overridden.
        let asked = config
            .cmdline
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("vcpus="))
            .next_back();
        if let Some(n) = asked.filter(|n| *n != config.vcpus.to_string()) {
            return Err(boot::BootError::Cmdline(format!(
                "vcpus={n} in --cmdline contradicts --vcpus {}: give the count with --vcpus alone (ferry tells the guest)",
                config.vcpus
            ))
            .into());
        }
        ferry_guest_abi::params::parse(&config.full_cmdline())
            .map_err(|e| boot::BootError::Cmdline(e.to_string()))?;
    }
    Ok(())
}

/// The legacy serial ports: COM1 carries the guest's output, COM2 is there as a PC has one
/// (and so that the VM has two instances of one device kind); its output is discarded.
const SERIAL_PORTS: [(u16, u32); 2] = [(ferry_guest_abi::SERIAL_PORT, 4), (0x2f8, 3)];
/// A 16550's eight registers.
const SERIAL_PORT_LEN: u64 = 8;

/// RAM, KVM VM with memory slots and its interrupt controller, a vCPU with its CPUID, and the
/// devices.
fn build(
    config: &VmConfig,
    ram: Arc<GuestRam>,
    incoming: Option<Arc<ferry_migrate::destination::IncomingControl>>,
) -> Result<Arc<Shared>, VmmError> {
    let kvm_vm = KvmVm::new(kvm::open()?, &ram)?;
    kvm_vm.enable_manual_dirty_protect()?;
    irqchip::create(&kvm_vm.vm)?;
    kick::install_handler().map_err(kvm::KvmError::Signal)?;
    let description = crate::vmconfig::VmDescription {
        vcpus: config.vcpus,
        balloon: config.balloon,
        cpuid: vcpu::cpuid_digest(&kvm_vm)?,
    };
    let telemetry = Arc::new(Mutex::new(GuestTelemetry::default()));
    let (devices, balloon) = devices(config, &kvm_vm, &ram, &telemetry)?;
    Ok(Arc::new(Shared {
        control: Mutex::new(Control {
            desired: match incoming {
                Some(_) => RunState::Incoming,
                None => RunState::Running,
            },
            stop_reason: None,
            vcpus_alive: 0,
            vcpus_parked: 0,
            threads: Vec::new(),
            starts: vec![None; usize::from(config.vcpus)],
        }),
        changed: Condvar::new(),
        devices,
        balloon,
        telemetry,
        ram,
        kvm: Arc::new(kvm_vm),
        vcpu_fds: OnceLock::new(),
        description,
        msrs: OnceLock::new(),
        state_parts: Mutex::new(Vec::new()),
        migration: Mutex::new(None),
        incoming,
        migration_tls: Mutex::new(None),
        incoming_tls: Mutex::new(None),
        previous_migration: Mutex::new(None),
        throttle: Throttle::default(),
        started: Instant::now(),
    }))
}

impl Shared {
    /// The vCPUs, by id; none before they are created.
    pub(crate) fn vcpus(&self) -> &[Arc<Mutex<VcpuFd>>] {
        self.vcpu_fds.get().map_or(&[], Vec::as_slice)
    }

    /// The MSRs a vCPU saves; none before the vCPUs are created.
    pub(crate) fn msrs(&self) -> &[u32] {
        self.msrs.get().map_or(&[], Vec::as_slice)
    }

    /// Creates the VM's vCPUs with their CPUID, and finds the MSRs they can save, unless
    /// that was done; says whether it created them.
    pub(crate) fn create_vcpus(&self) -> Result<bool, VmmError> {
        if self.vcpu_fds.get().is_some() {
            return Ok(false);
        }
        let fds = (0..self.description.vcpus)
            .map(|id| vcpu::create(&self.kvm, id).map(|fd| Arc::new(Mutex::new(fd))))
            .collect::<Result<Vec<_>, _>>()?;
        let msrs = kvm::state::readable_msrs(&self.kvm.kvm, &fds[0].lock().unwrap())?;
        // Only the state load or a boot creates them, on one thread, before any vCPU runs.
        let _ = self.msrs.set(msrs);
        let _ = self.vcpu_fds.set(fds);
        Ok(true)
    }
}

/// The balloon a VM built by `devices` has, if any.
type BalloonDevice = Option<Arc<Mutex<MmioTransport<Balloon>>>>;

/// The serial ports and the telemetry port on the port bus, and the balloon on the MMIO bus,
/// their interrupts wired.
fn devices(
    config: &VmConfig,
    kvm_vm: &KvmVm,
    ram: &Arc<GuestRam>,
    telemetry: &Arc<Mutex<GuestTelemetry>>,
) -> Result<(Devices, BalloonDevice), VmmError> {
    let mut devices = Devices::default();
    for (instance, (port, gsi)) in SERIAL_PORTS.into_iter().enumerate() {
        let out = match instance {
            0 => &config.serial,
            _ => &SerialOutput::Discard,
        };
        let line = IrqLine::unconnected().map_err(VmmError::Eventfd)?;
        irqchip::connect(&kvm_vm.vm, &line, gsi)?;
        let uart = SerialDevice::new(out, line).map_err(|source| VmmError::Serial {
            path: format!("{out:?}"),
            source,
        })?;
        let at = (BusKind::Pio, u64::from(port), SERIAL_PORT_LEN);
        devices.register(
            "serial port",
            instance as u32,
            at,
            Arc::new(Mutex::new(uart)),
        )?;
    }
    let port = TelemetryPort::new(telemetry.clone(), ram.clone());
    let at = (
        BusKind::Pio,
        u64::from(ferry_guest_abi::TELEMETRY_PORT),
        telemetry_port::LEN,
    );
    devices.register("telemetry port", 0, at, Arc::new(Mutex::new(port)))?;
    let balloon = match config.balloon {
        false => None,
        true => {
            let line = IrqLine::unconnected().map_err(VmmError::Eventfd)?;
            irqchip::connect(&kvm_vm.vm, &line, BALLOON_GSI)?;
            let balloon = Arc::new(Mutex::new(MmioTransport::new(
                Balloon::new(),
                ram.clone(),
                line,
            )));
            let at = (BusKind::Mmio, BALLOON_MMIO, mmio::MMIO_SIZE);
            devices.register("virtio-balloon", 0, at, balloon.clone())?;
            Some(balloon)
        }
    };
    Ok((devices, balloon))
}

/// Spawns a thread per vCPU.
fn start(shared: Arc<Shared>) -> Result<Vm, VmmError> {
    // Hold the control lock until every thread id is recorded, so no kick can miss one.
    let mut control = shared.control.lock().unwrap();
    let mut threads = Vec::new();
    for index in 0..shared.vcpus().len() {
        let runner = VcpuRunner {
            shared: shared.clone(),
            index,
        };
        let thread = match std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || runner.run())
        {
            Ok(t) => t,
            Err(e) => {
                // The threads already running stop and are joined before the error returns.
                control.stop_reason = Some(StopReason::Failed(format!("no thread: {e}")));
                control.desired = RunState::Stopped;
                VmHandle::kick_all(&control);
                shared.changed.notify_all();
                drop(control);
                for t in threads {
                    let _ = JoinHandle::join(t);
                }
                return Err(VmmError::Thread(e));
            }
        };
        control.vcpus_alive += 1;
        control
            .threads
            .push(std::os::unix::thread::JoinHandleExt::as_pthread_t(&thread));
        threads.push(thread);
    }
    drop(control);
    Ok(Vm {
        handle: VmHandle(shared),
        threads,
    })
}

impl Drop for Vm {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.handle.stop(StopReason::Requested("VM dropped".into()));
            self.join();
        }
    }
}

impl VmHandle {
    fn lock(&self) -> MutexGuard<'_, Control> {
        self.0.control.lock().unwrap()
    }

    fn kick_all(control: &Control) {
        // Once every vCPU has left, their threads may have been joined (a stop after the guest
        // halted, or between two hops of --then-incoming): their ids name nothing any more.
        if control.vcpus_alive == 0 {
            return;
        }
        for &t in &control.threads {
            // SAFETY: thread ids are recorded at spawn and the threads are joined only after
            // every vCPU has left (vcpus_alive == 0), which needs this lock; it is held here
            // with a vCPU alive, so every id names a thread that has not been joined.
            unsafe { kick::kick(t) };
        }
    }

    /// Pauses all vCPUs; returns once none is running guest code, or fails after
    /// [`PAUSE_TIMEOUT`] with the VM running as before (a vCPU blocked on a postcopy page
    /// cannot stop, and the caller, such as the API's one thread, must not wait for ever).
    pub fn pause(&self) -> Result<(), ControlError> {
        self.pause_within(PAUSE_TIMEOUT)
    }

    fn pause_within(&self, timeout: Duration) -> Result<(), ControlError> {
        let mut c = self.lock();
        if let Some(r) = &c.stop_reason {
            return Err(ControlError::Stopped(r.clone()));
        }
        if c.desired == RunState::Incoming {
            return Err(ControlError::Incoming);
        }
        let before = c.desired;
        c.desired = RunState::Paused;
        Self::kick_all(&c);
        let deadline = Instant::now() + timeout;
        while c.vcpus_parked < c.vcpus_alive && c.stop_reason.is_none() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                c.desired = before;
                self.0.changed.notify_all();
                return Err(ControlError::PauseTimeout {
                    parked: c.vcpus_parked,
                    alive: c.vcpus_alive,
                    waited: timeout,
                });
            };
            c = self.0.changed.wait_timeout(c, left).unwrap().0;
        }
        if let Some(r) = &c.stop_reason {
            return Err(ControlError::Stopped(r.clone()));
        }
        self.start_asked(&mut c);
        Ok(())
    }

    /// Starts the vCPUs the guest asked for that their threads have not started yet: a request
    /// made just before a pause, whose target had already parked. With every vCPU parked no
    /// thread holds a vCPU's lock, and no guest code can ask for more, so a paused VM is
    /// saved with every vCPU it started running.
    fn start_asked(&self, c: &mut Control) {
        for (id, request) in c.starts.iter_mut().enumerate() {
            let Some(r) = request.take() else {
                continue;
            };
            let vcpu = self.0.vcpus()[id].lock().unwrap();
            if let Err(e) = vcpu::start_secondary(&vcpu, id as u8, &r) {
                tracing::warn!("vCPU {id} could not be started while paused: {e}");
            }
        }
    }

    pub fn resume(&self) -> Result<(), ControlError> {
        let mut c = self.lock();
        if let Some(r) = &c.stop_reason {
            return Err(ControlError::Stopped(r.clone()));
        }
        if c.desired == RunState::Incoming {
            return Err(ControlError::Incoming);
        }
        c.desired = RunState::Running;
        self.0.changed.notify_all();
        Ok(())
    }

    /// Stops the VM (the first reason given wins), and an incoming migration with it. Does
    /// not wait.
    pub fn stop(&self, reason: StopReason) {
        if let Some(incoming) = &self.0.incoming {
            incoming.cancel();
        }
        let mut c = self.lock();
        c.stop_reason.get_or_insert(reason);
        c.desired = RunState::Stopped;
        Self::kick_all(&c);
        self.0.changed.notify_all();
    }

    pub fn state(&self) -> RunState {
        let c = self.lock();
        match (&c.stop_reason, c.desired) {
            (Some(_), _) | (None, RunState::Stopped) => RunState::Stopped,
            (None, d) => d,
        }
    }

    /// Waits until every vCPU has left, or `timeout` passes (`None`: forever).
    pub fn wait_stopped(&self, timeout: Option<Duration>) -> Option<StopReason> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut c = self.lock();
        while c.vcpus_alive > 0 || c.stop_reason.is_none() {
            match deadline {
                None => c = self.0.changed.wait(c).unwrap(),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    c = self.0.changed.wait_timeout(c, left).unwrap().0;
                }
            }
        }
        c.stop_reason.clone()
    }

    /// CPU time used by the vCPU threads still alive, in ns.
    pub fn vcpu_cpu_ns(&self) -> u64 {
        let c = self.lock();
        if c.vcpus_alive == 0 {
            return 0;
        }
        c.threads
            .iter()
            // SAFETY: as in `kick_all`: under this lock, with a vCPU alive, no vCPU thread
            // has been joined.
            .map(|&t| unsafe { kick::thread_cpu_ns(t) })
            .sum()
    }

    /// Throttles every vCPU to run `100 - percent`% of the time (auto-converge; 0 lifts it,
    /// above 99 is 99). See `throttle.rs`.
    pub fn set_throttle(&self, percent: u8) -> Result<(), ControlError> {
        if let Some(r) = &self.lock().stop_reason {
            return Err(ControlError::Stopped(r.clone()));
        }
        if self.0.throttle.set(percent) {
            let vm = Arc::downgrade(&self.0);
            let spawned = std::thread::Builder::new()
                .name("throttle".into())
                .spawn(move || tick(&vm));
            if spawned.is_err() {
                // No ticker: a vCPU that exits for its own reasons is still throttled, and
                // the next set tries again.
                self.0.throttle.keep_ticking(false);
                tracing::warn!("could not start the throttle's ticker thread");
            }
        }
        Ok(())
    }

    pub fn throttle_percent(&self) -> u8 {
        self.0.throttle.percent()
    }

    pub fn telemetry(&self) -> GuestTelemetry {
        self.0.telemetry.lock().unwrap().clone()
    }

    pub fn ram(&self) -> &GuestRam {
        &self.0.ram
    }

    pub fn status(&self) -> VmStatus {
        // Each of these takes the control lock; none may run while another holds it.
        let stop_reason = self.lock().stop_reason.clone();
        let vcpu_cpu_ns = self.vcpu_cpu_ns();
        let preparing = self.incoming().and_then(|p| p.preparing);
        VmStatus {
            state: match self.state() {
                RunState::Incoming if preparing.is_some() => RunState::Preparing,
                s => s,
            },
            preparing,
            stop_reason,
            memory_bytes: self.0.ram.size(),
            memory_allocated_bytes: self.0.ram.allocated_bytes().unwrap_or(0),
            vcpus: self.0.description.vcpus,
            vcpu_threads: self.lock().vcpus_alive,
            uptime_ms: self.0.started.elapsed().as_millis() as u64,
            vcpu_cpu_ms: vcpu_cpu_ns as f64 / 1e6,
            throttle_percent: self.throttle_percent(),
            host_monotonic_ns: crate::devices::telemetry::host_monotonic_ns(),
            guest: self.telemetry(),
        }
    }
}

/// The throttle's ticker: kicks every vCPU out of `KVM_RUN` each timeslice while a throttle
/// is set, so that each looks at how long it ran. Holds the VM weakly: a dropped VM ends it.
fn tick(vm: &std::sync::Weak<Shared>) {
    loop {
        std::thread::sleep(throttle::TIMESLICE);
        let Some(shared) = vm.upgrade() else {
            return;
        };
        let c = shared.control.lock().unwrap();
        let alive = c.stop_reason.is_none();
        if !shared.throttle.keep_ticking(alive) {
            return;
        }
        VmHandle::kick_all(&c);
    }
}

/// A vCPU thread's view of the VM.
struct VcpuRunner {
    shared: Arc<Shared>,
    /// Which vCPU (its id).
    index: usize,
}

impl VcpuRunner {
    fn run(self) {
        let vcpu = self.shared.vcpus()[self.index].clone();
        let immediate_exit = &raw mut vcpu.lock().unwrap().get_kvm_run().immediate_exit;
        // SAFETY: the kvm_run mapping belongs to the VcpuFd kept alive by `vcpu` (an Arc held
        // until after the registration is dropped at the end of this function).
        let registration = unsafe { kick::Registration::new(immediate_exit) };
        let reason = self.run_loop(&vcpu);
        drop(registration);
        let mut c = self.shared.control.lock().unwrap();
        c.stop_reason.get_or_insert(reason);
        c.desired = RunState::Stopped;
        c.vcpus_alive -= 1;
        // The VM stops as a whole: get the other vCPUs out of KVM_RUN (their ids are still
        // valid: no thread is joined before every vCPU has left).
        VmHandle::kick_all(&c);
        self.shared.changed.notify_all();
    }

    /// Runs until the VM must stop, and says why.
    fn run_loop(&self, vcpu: &Mutex<VcpuFd>) -> StopReason {
        // When the vCPU last started running after a wait, and until when it sleeps now.
        let mut running_since = Instant::now();
        let mut asleep_until = None;
        loop {
            // Before parking: a vCPU started just before a pause must be saved started.
            if let Some(reason) = self.start_if_asked(vcpu) {
                return reason;
            }
            if let Some(reason) = self.wait_while_paused(asleep_until.take(), &mut running_since) {
                return reason;
            }
            if self.shared.throttle.percent() == 0 {
                // Unthrottled time is not owed: a throttle set later counts from its first
                // slice.
                running_since = Instant::now();
            } else {
                let sleep = self.shared.throttle.sleep_after(running_since.elapsed());
                if !sleep.is_zero() {
                    asleep_until = Some(Instant::now() + sleep);
                    continue;
                }
            }
            let mut vcpu = vcpu.lock().unwrap();
            let devices = &self.shared.devices;
            match vcpu::run(&mut vcpu) {
                vcpu::Exit::IoOut(ferry_guest_abi::EXIT_PORT, _) => return self.halted(&vcpu),
                vcpu::Exit::IoOut(START_PORT, data) => self.ask_start(data),
                vcpu::Exit::IoOut(port, data) => devices.io_out(port, data),
                vcpu::Exit::IoIn(port, data) => devices.io_in(port, data),
                vcpu::Exit::MmioRead(addr, data) => devices.mmio_read(addr, data),
                vcpu::Exit::MmioWrite(addr, data) => devices.mmio_write(addr, data),
                vcpu::Exit::Interrupted => vcpu.set_kvm_immediate_exit(0),
                vcpu::Exit::Fatal(why) => {
                    let regs = vcpu::describe_registers(&vcpu);
                    return StopReason::Failed(format!("vCPU {}: {why}\n{regs}", self.index));
                }
            }
        }
    }

    /// Parks while the VM is paused, and while running until `asleep_until` (a throttle's
    /// sleep, which counts as parked, so that a pause does not wait for it to end); returns a
    /// reason when it must stop. A vCPU that parked starts its next timeslice when it leaves
    /// (`running_since`), so time paused is never taken for time run.
    fn wait_while_paused(
        &self,
        asleep_until: Option<Instant>,
        running_since: &mut Instant,
    ) -> Option<StopReason> {
        let mut c = self.shared.control.lock().unwrap();
        let mut parked = false;
        loop {
            match c.desired {
                RunState::Running => {
                    let Some(left) =
                        asleep_until.and_then(|t| t.checked_duration_since(Instant::now()))
                    else {
                        break;
                    };
                    if !parked {
                        parked = true;
                        c.vcpus_parked += 1;
                        self.shared.changed.notify_all();
                    }
                    c = self.shared.changed.wait_timeout(c, left).unwrap().0;
                }
                RunState::Stopped => {
                    if parked {
                        c.vcpus_parked -= 1;
                    }
                    return Some(
                        c.stop_reason
                            .clone()
                            .unwrap_or(StopReason::Requested("stop".into())),
                    );
                }
                // An incoming VM's vCPU is started only once its state loaded (the desired
                // state is Running by then); were it not, it must not run.
                RunState::Paused | RunState::Preparing | RunState::Incoming => {
                    if !parked {
                        parked = true;
                        c.vcpus_parked += 1;
                        self.shared.changed.notify_all();
                    }
                    c = self.shared.changed.wait(c).unwrap();
                }
            }
        }
        if parked {
            c.vcpus_parked -= 1;
            *running_since = Instant::now();
        }
        None
    }

    /// The guest asks, through the start port, to start a secondary vCPU
    /// (`ferry_guest_abi::smp`): record the request and kick that vCPU's thread, which starts
    /// it (`start_if_asked`). A malformed request is logged and ignored, as hardware ignores
    /// a bad IPI.
    fn ask_start(&self, data: &[u8]) {
        let request = <[u8; 4]>::try_from(data)
            .map_err(|_| format!("a {}-byte write", data.len()))
            .and_then(|w| {
                let gpa = u64::from(u32::from_le_bytes(w));
                let mut b = [0; START_SIZE];
                self.shared
                    .ram
                    .read(gpa, &mut b)
                    .map_err(|e| format!("a request at {gpa:#x} outside RAM: {e}"))?;
                StartVcpu::from_bytes(&b).ok_or(format!("no request at {gpa:#x} (bad magic)"))
            })
            .and_then(|r| {
                let n = self.shared.vcpus().len();
                match r.vcpu as usize {
                    0 => Err("a request to start vCPU 0, which booted".to_string()),
                    k if k >= n => Err(format!("a request for vCPU {k}; the VM has {n}")),
                    _ if self.shared.ram.read(u64::from(r.entry), &mut [0]).is_err() => {
                        Err(format!("an entry point {:#x} outside RAM", r.entry))
                    }
                    _ => Ok(r),
                }
            });
        match request {
            Ok(r) => {
                let mut c = self.shared.control.lock().unwrap();
                c.starts[r.vcpu as usize] = Some(r);
                if let Some(&t) = c.threads.get(r.vcpu as usize) {
                    // SAFETY: as in `VmHandle::kick_all`: under the control lock, with this
                    // vCPU alive, no vCPU thread has been joined.
                    unsafe { kick::kick(t) };
                }
            }
            Err(why) => tracing::warn!(
                "vCPU {} wrote the start port with {why}; ignored",
                self.index
            ),
        }
    }

    /// Starts this vCPU if the guest asked; a reason when it cannot be.
    fn start_if_asked(&self, vcpu: &Mutex<VcpuFd>) -> Option<StopReason> {
        let request = self.shared.control.lock().unwrap().starts[self.index].take()?;
        let id = self.index as u8;
        let started = vcpu::start_secondary(&vcpu.lock().unwrap(), id, &request);
        tracing::debug!("vCPU {id} started at {:#x}", request.entry);
        started
            .err()
            .map(|e| StopReason::Failed(format!("vCPU {id}: {e}")))
    }

    fn halted(&self, vcpu: &VcpuFd) -> StopReason {
        let t = self.shared.telemetry.lock().unwrap();
        let why = match (&t.exception, &t.halt_reason) {
            (Some(e), _) => format!(
                "after exception {} on vCPU {} at RIP {:#x}, error code {:#x}; see the serial output",
                e.vector, e.vcpu, e.rip, e.error_code
            ),
            (None, Some(r)) => r.clone(),
            (None, None) => "HLT with interrupts off".into(),
        };
        if t.exception.is_some() {
            StopReason::Failed(format!(
                "guest halted {why}\n{}",
                vcpu::describe_registers(vcpu)
            ))
        } else {
            StopReason::GuestHalted(why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pause waited without bound for every vCPU to park: one that cannot (blocked on a
    /// postcopy page) held the caller, the API's one thread, for good. Here an extra vCPU that
    /// never parks is counted in: the pause gives up, and the VM runs on.
    #[test]
    fn regression_a_pause_that_a_vcpu_cannot_answer_gives_up_and_the_vm_runs_on() {
        kvm::require_for_tests();
        let vm = Vm::boot(VmConfig {
            memory_bytes: 64 << 20,
            vcpus: 1,
            kernel: Arc::from(ferry_guest_image::ELF),
            cmdline: "ws=4M log-ms=0".into(),
            guest: GuestKind::Foreign,
            serial: SerialOutput::Discard,
            balloon: false,
            host_pages: Default::default(),
        })
        .unwrap();
        let h = vm.handle();
        let beats = |n: u64| {
            let deadline = Instant::now() + Duration::from_secs(30);
            while h.telemetry().heartbeats < n {
                assert!(Instant::now() < deadline, "the guest stopped reporting");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        beats(2);
        h.lock().vcpus_alive += 1; // a vCPU that never parks
        let e = h.pause_within(Duration::from_millis(300)).unwrap_err();
        assert!(
            matches!(
                e,
                ControlError::PauseTimeout {
                    parked: 1,
                    alive: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(h.state(), RunState::Running);
        beats(h.telemetry().heartbeats + 2);
        h.lock().vcpus_alive -= 1;
        h.pause().unwrap();
        assert_eq!(h.state(), RunState::Paused);
        h.stop(StopReason::Requested("test".into()));
        vm.wait();
    }

    /// A start the guest asked for while the target had already parked for a pause is carried
    /// out by the pause: the paused VM holds that vCPU started (runnable, at its entry).
    #[test]
    fn a_start_asked_just_before_a_pause_is_made_by_the_pause() {
        kvm::require_for_tests();
        // The built-in guest, told it has one vCPU, never starts vCPU 1 itself.
        let vm = Vm::boot(VmConfig {
            memory_bytes: 128 << 20,
            vcpus: 2,
            kernel: Arc::from(ferry_guest_image::ELF),
            cmdline: "ws=8M vcpus=1 log-ms=0".into(),
            guest: GuestKind::Foreign,
            serial: SerialOutput::Discard,
            balloon: false,
            host_pages: Default::default(),
        })
        .unwrap();
        let h = vm.handle();
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.telemetry().heartbeats < 2 {
            assert!(Instant::now() < deadline, "the guest never reported");
            std::thread::sleep(Duration::from_millis(5));
        }
        h.pause().unwrap();
        let vcpu1 = || h.0.vcpus()[1].lock().unwrap();
        assert_ne!(
            vcpu1().get_mp_state().unwrap().mp_state,
            kvm_bindings::KVM_MP_STATE_RUNNABLE,
            "vCPU 1 waits for a start"
        );
        // As if vCPU 0 had asked just before the pause, with vCPU 1 already parked.
        h.lock().starts[1] = Some(StartVcpu {
            vcpu: 1,
            entry: 0x12_3450,
            arg: 1,
        });
        h.pause().unwrap();
        assert!(h.lock().starts[1].is_none(), "the request was carried out");
        let vcpu = vcpu1();
        assert_eq!(
            vcpu.get_mp_state().unwrap().mp_state,
            kvm_bindings::KVM_MP_STATE_RUNNABLE
        );
        let regs = vcpu.get_regs().unwrap();
        assert_eq!((regs.rip, regs.rbx), (0x12_3450, 1));
    }
}
