//! Building a VM: [`Vm::boot`] checks the configuration, loads the guest and starts a fresh
//! VM; [`Vm::incoming`] makes an empty one ([`IncomingVm`]) that a migration fills and then
//! starts. Both build the same parts: RAM, the KVM VM with its memory slots and interrupt
//! controller, the vCPUs with their CPUID, the devices with their interrupts wired, and a
//! thread per vCPU.

#![forbid(unsafe_code)]

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use super::config::{
    BALLOON_GSI, BALLOON_MMIO, DISK_GSI, DISK_MMIO, GuestKind, MAX_VCPUS, VmConfig,
};
use super::disk::DISK_INSTANCE;
use super::handle::VmHandle;
use super::runner::VcpuRunner;
use super::shared::{Control, Shared};
use super::state::{RunState, StopReason};
use crate::boot;
use crate::devices::irq::IrqLine;
use crate::devices::pit::{self, PitPort};
use crate::devices::rtc::{self, RtcDevice};
use crate::devices::serial::{SerialDevice, SerialOutput};
use crate::devices::telemetry::GuestTelemetry;
use crate::devices::telemetry_port::{self, Layout, TelemetryPort};
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::blk::Block;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::{MmioTransport, mmio};
use crate::devices::vmgenid::{self, VmGenId};
use crate::devices::{BusKind, Devices};
use crate::error::VmmError;
use crate::kvm::log_state::LogStart;
use crate::kvm::{self, KvmVm, irqchip, kick, vcpu};
use crate::limit::MemoryLimit;
use crate::memory::{self, GuestRam};
use crate::sections;
use crate::throttle::Throttle;
use crate::vmconfig::VmDescription;

/// A VM whose vCPU threads run. Dropping it stops the VM and joins its threads.
#[derive(Debug)]
pub struct Vm {
    handle: VmHandle,
    threads: Vec<JoinHandle<()>>,
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
/// `crate::migration` implements the engine's `DestinationVm` on it.
#[derive(Debug)]
pub struct IncomingVm {
    pub(crate) shared: Arc<Shared>,
    /// The vCPU threads: parked from the start when prepared, else started at resume.
    threads: Option<Vm>,
    /// Whether a migration resumed the guest here.
    resumed: bool,
    /// How received pages land, if forced (see [`IncomingVm::land_pages`]).
    pub(crate) landing: Option<ferry_migrate::PageLanding>,
    /// Whether the guest keeps the VM generation ID its state carries (a migration) or gets a
    /// new one with its state (a restore: a clone).
    pub(crate) identity: Identity,
    /// The announce the NIC sends for the guest's MAC once it runs here (`vm/net.rs`).
    pub(crate) announce: super::net::Announce,
}

/// What becomes of the VM generation ID (`devices::vmgenid`) when an incoming VM loads its
/// state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Identity {
    /// The one the state carries: the same VM, moved.
    #[default]
    Kept,
    /// A new one, drawn once the state is loaded and before the guest runs: a clone, one of
    /// the VMs a snapshot may be restored into.
    Renewed,
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
        let control = Arc::new(ferry_migrate::destination::IncomingControl::with_events(
            Arc::default(),
        ));
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
            identity: Identity::Kept,
            announce: super::net::Announce::default(),
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

    /// Sets the announce the NIC sends once the guest runs here (QEMU's defaults unless set;
    /// 0 rounds sends none).
    pub fn set_announce(&mut self, plan: super::net::Announce) {
        self.announce = plan;
    }

    /// Whether the migration resumed the guest here (it may have stopped since: a postcopy
    /// failure after the resume stops it with its memory incomplete).
    pub fn guest_ran(&self) -> bool {
        self.resumed
    }

    /// The running VM, once the migration resumed it.
    pub fn into_running(mut self) -> Option<Vm> {
        self.threads.take().filter(|_| self.resumed)
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
            self.shared.net_gate(true);
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
    MemoryLimit::of_host(&kvm::open()?, config.guest).check(config.memory_bytes)?;
    if config.guest == GuestKind::FerryGuest {
        config.check_cmdline()?;
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
    let mut kvm_vm = KvmVm::new(kvm::open()?, &ram)?;
    // The ring has no bitmap to start all set (`kvm/dirty.rs`).
    let log_start = match config.dirty_ring {
        Some(_) => LogStart::WriteProtect,
        None => LogStart::from_env(),
    };
    kvm_vm.enable_manual_dirty_protect(log_start)?;
    if let Some(entries) = config.dirty_ring {
        kvm_vm.enable_dirty_ring(entries)?;
    }
    irqchip::create(&kvm_vm.vm)?;
    let kvm_vm = Arc::new(kvm_vm);
    kick::install_handler().map_err(kvm::KvmError::Signal)?;
    crate::file_size_limit::catch_file_size_limit()?;
    let telemetry = Arc::new(Mutex::new(GuestTelemetry::default()));
    let arriving = incoming.is_some();
    let Parts {
        devices,
        balloon,
        disk,
        net,
        generation,
    } = devices(config, &kvm_vm, &ram, &telemetry, arriving)?;
    let description = VmDescription {
        vcpus: config.vcpus,
        balloon: config.balloon,
        disk: config.disk.is_some(),
        net: config.net.is_some(),
        net_mac: net.as_ref().and_then(|n| {
            let t = n.lock().unwrap();
            match arriving {
                false => Some(t.device().mac().to_string()),
                true => t.device().given_mac().map(|m| m.to_string()),
            }
        }),
        cpuid: vcpu::cpuid_digest(&kvm_vm)?,
        sections: sections::versions(&devices),
        tsc: kvm::tsc::vm_khz(&kvm_vm.vm).map(|khz| crate::vmconfig::TscDescription {
            khz,
            scales: kvm::tsc::can_scale(&kvm_vm.vm),
            tolerance_ppm: kvm::tsc::tolerance_ppm(),
        }),
    };
    let shared = Arc::new(Shared {
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
        holds: super::holds::RamHolds::new(balloon.clone()),
        balloon,
        disk_writes: disk
            .as_ref()
            .map(|d| d.lock().unwrap().device().write_log()),
        disk,
        disk_path: config.disk.as_ref().map(|d| d.path.clone()),
        net,
        disk_arriving: Mutex::new(None),
        disk_copy: Mutex::new(None),
        generation,
        telemetry,
        ram,
        kvm: kvm_vm,
        vcpu_fds: OnceLock::new(),
        description,
        msrs: OnceLock::new(),
        state_parts: Mutex::new(Vec::new()),
        migration: Mutex::new(None),
        events: incoming
            .as_ref()
            .and_then(|c| c.events())
            .unwrap_or_default(),
        incoming,
        migration_tls: Mutex::new(None),
        incoming_tls: Mutex::new(None),
        previous_migration: Mutex::new(None),
        ending_read: Default::default(),
        then_incoming: Mutex::new(None),
        throttle: Throttle::default(),
        dirty_limit: crate::dirty_limit::DirtyLimit::new(usize::from(config.vcpus)),
        tsc_host_hz: OnceLock::new(),
        started: Instant::now(),
    });
    super::net::start_receiver(&shared)?;
    Ok(shared)
}

/// The devices of a VM built by `devices`, and the ones migrations and the API reach directly.
struct Parts {
    devices: Devices,
    balloon: Option<Arc<Mutex<MmioTransport<Balloon>>>>,
    disk: Option<Arc<Mutex<MmioTransport<Block>>>>,
    net: Option<Arc<Mutex<MmioTransport<Net>>>>,
    generation: Arc<Mutex<VmGenId>>,
}

/// The serial ports, the telemetry port, the VM generation ID, the PIT's port 0x61 (KVM's
/// PIT created with it, after the interrupt controller) and the RTC (IRQ 8) on the port bus, and the
/// balloon and the disk on the MMIO bus, their interrupts wired; the generation ID after the
/// telemetry port, whose state it loads into (`devices::registry`). An `arriving` VM (a
/// migration's destination, a restore) opens its disk's image only when the guest's state
/// is loaded, after the source paused and flushed it, so two VMMs never write one image.
fn devices(
    config: &VmConfig,
    kvm_vm: &Arc<KvmVm>,
    ram: &Arc<GuestRam>,
    telemetry: &Arc<Mutex<GuestTelemetry>>,
    arriving: bool,
) -> Result<Parts, VmmError> {
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
    let layout = match config.next_layout {
        false => Layout::Current,
        true => Layout::Next,
    };
    let port = TelemetryPort::new(telemetry.clone(), ram.clone(), layout);
    let at = (
        BusKind::Pio,
        u64::from(ferry_guest_abi::TELEMETRY_PORT),
        telemetry_port::LEN,
    );
    devices.register("telemetry port", 0, at, Arc::new(Mutex::new(port)))?;
    let generation = Arc::new(Mutex::new(VmGenId::new(telemetry.clone())?));
    let at = (
        BusKind::Pio,
        u64::from(ferry_guest_abi::vmgenid::PORT),
        vmgenid::LEN,
    );
    devices.register("VM generation ID", 0, at, generation.clone())?;
    let pit = PitPort::create(kvm_vm.clone())?;
    let at = (BusKind::Pio, u64::from(pit::PORT), pit::LEN);
    devices.register("PIT", 0, at, Arc::new(Mutex::new(pit)))?;
    let line = IrqLine::unconnected().map_err(VmmError::Eventfd)?;
    irqchip::connect(&kvm_vm.vm, &line, rtc::IRQ)?;
    let cmos = rtc::cmos::at_boot(config.memory_bytes, config.vcpus);
    let clock = RtcDevice::new(line, cmos).map_err(VmmError::RtcTimer)?;
    let at = (BusKind::Pio, u64::from(rtc::PORT), rtc::LEN);
    devices.register("RTC", 0, at, Arc::new(Mutex::new(clock)))?;
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
    let disk = match &config.disk {
        None => None,
        Some(options) => {
            let block = match arriving {
                false => Block::open(options)?,
                true => Block::deferred(options),
            };
            let line = IrqLine::unconnected().map_err(VmmError::Eventfd)?;
            irqchip::connect(&kvm_vm.vm, &line, DISK_GSI)?;
            let disk = Arc::new(Mutex::new(MmioTransport::new(block, ram.clone(), line)));
            let at = (BusKind::Mmio, DISK_MMIO, mmio::MMIO_SIZE);
            devices.register("virtio-blk", DISK_INSTANCE, at, disk.clone())?;
            Some(disk)
        }
    };
    let net = match &config.net {
        None => None,
        Some(options) => Some(super::net::build(
            options,
            kvm_vm,
            ram,
            &mut devices,
            arriving,
        )?),
    };
    Ok(Parts {
        devices,
        balloon,
        disk,
        net,
        generation,
    })
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
                control.kick_all();
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

/// An incoming VM dropped before its state made a disk copy the image (its migration failed,
/// or ended before it loaded) takes the copy with it: the `.ferry-incoming` file goes now, not
/// when the last handle to the VM goes. A `ferry run --incoming`'s API server and signal
/// handler hold one to the process's exit, which runs no drop, and the file was left there,
/// in the way of the next migration to that path (issue 50: a link cut in the disk pass).
impl Drop for IncomingVm {
    fn drop(&mut self) {
        drop(self.shared.disk_arriving.lock().unwrap().take());
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.handle.stop(StopReason::Requested("VM dropped".into()));
            self.join();
        }
    }
}

/// The sections of a built VM (`crate::sections`) saved and loaded on KVM, and the layouts its
/// description announces. They live here rather than beside `sections.rs` because they need a
/// VM built, and this file imports `sections` (a test there importing this file would close a
/// circle).
#[cfg(test)]
mod tests;
