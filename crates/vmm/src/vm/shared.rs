//! What every thread of a VM shares: its parts (RAM, the KVM VM, the vCPUs, the devices) and
//! the control state under one mutex with a condvar.
//!
//! The control state also records each vCPU thread's id, so that a controller can kick it out
//! of `KVM_RUN`; the kicks are here, beside the rule that keeps those ids valid: threads are
//! joined only after every vCPU has left (`vcpus_alive == 0`), which takes the control lock.

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use ferry_guest_abi::smp::StartVcpu;

use super::state::{RunState, StopReason};
use crate::devices::Devices;
use crate::devices::telemetry::GuestTelemetry;
use crate::devices::virtio::MmioTransport;
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::blk::Block;
use crate::devices::virtio::net::Net;
use crate::devices::vmgenid::VmGenId;
use crate::dirty_limit::DirtyLimit;
use crate::error::VmmError;
use crate::kvm::dirty::DirtyLogError;
use crate::kvm::vcpu::{self, VcpuFd};
use crate::kvm::{KvmVm, kick};
use crate::memory::GuestRam;
use crate::throttle::Throttle;

#[derive(Debug)]
pub(crate) struct Control {
    pub(super) desired: RunState,
    pub(super) stop_reason: Option<StopReason>,
    pub(super) vcpus_alive: usize,
    pub(super) vcpus_parked: usize,
    pub(super) threads: Vec<libc::pthread_t>,
    /// Secondary vCPUs the guest asked to start, by index, until their threads do.
    pub(super) starts: Vec<Option<StartVcpu>>,
}

impl Control {
    /// Kicks every vCPU thread out of `KVM_RUN`.
    pub(super) fn kick_all(&self) {
        // Once every vCPU has left, their threads may have been joined (a stop after the guest
        // halted, or between two hops of --then-incoming): their ids name nothing any more.
        if self.vcpus_alive == 0 {
            return;
        }
        for &t in &self.threads {
            // SAFETY: thread ids are recorded at spawn and the threads are joined only after
            // every vCPU has left (vcpus_alive == 0), which needs this lock; it is held here
            // with a vCPU alive, so every id names a thread that has not been joined.
            unsafe { kick::kick(t) };
        }
    }

    /// Kicks vCPU `index`'s thread, if it has one; called by a vCPU that runs.
    pub(super) fn kick(&self, index: usize) {
        if let Some(&t) = self.threads.get(index) {
            // SAFETY: as in `kick_all`: under the control lock, with this vCPU alive, no vCPU
            // thread has been joined.
            unsafe { kick::kick(t) };
        }
    }

    /// CPU time used by the vCPU threads still alive, in ns.
    pub(super) fn cpu_ns(&self) -> u64 {
        if self.vcpus_alive == 0 {
            return 0;
        }
        self.threads
            .iter()
            // SAFETY: as in `kick_all`: under this lock, with a vCPU alive, no vCPU thread
            // has been joined.
            .map(|&t| unsafe { kick::thread_cpu_ns(t) })
            .sum()
    }
}

/// What every thread of a VM shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(super) control: Mutex<Control>,
    pub(super) changed: Condvar,
    pub(crate) telemetry: Arc<Mutex<GuestTelemetry>>,
    pub(crate) ram: Arc<GuestRam>,
    pub(crate) kvm: Arc<KvmVm>,
    /// The vCPUs, by id, once created (at build, or for an unprepared destination at its
    /// state load); each one's thread holds its lock only inside `KVM_RUN` and exit handling.
    pub(super) vcpu_fds: OnceLock<Vec<Arc<Mutex<VcpuFd>>>>,
    /// Fixed once built; each device has a lock of its own.
    pub(crate) devices: Devices,
    /// The balloon (also on the MMIO bus in `devices`), for migrations and the API.
    pub(crate) balloon: Option<Arc<Mutex<MmioTransport<Balloon>>>>,
    /// The disk (also on the MMIO bus in `devices`): a source flushes it before its state is
    /// saved, a destination opens its image when the state is loaded.
    pub(crate) disk: Option<Arc<Mutex<MmioTransport<Block>>>>,
    /// The disk's record of writes, shared with a copy of it, which holds a writing vCPU
    /// outside the disk's lock while the copy is behind (`blk::WriteLog`).
    pub(crate) disk_writes: Option<Arc<crate::devices::virtio::blk::WriteLog>>,
    /// Where the disk's image is (`--disk`), and on a destination the copy of a disk no host
    /// shares while it arrives (`disk.rs`).
    pub(crate) disk_path: Option<std::path::PathBuf>,
    /// The NIC (also on the MMIO bus in `devices`): its gate follows the vCPUs, its tap is
    /// attached at the state load on an arriving VM (`net.rs`).
    pub(crate) net: Option<Arc<Mutex<MmioTransport<Net>>>>,
    pub(crate) disk_arriving: Mutex<Option<crate::disk_copy::IncomingCopy>>,
    /// The last disk copy from this VM, as `GET /migration` shows it (`disk.rs`).
    pub(crate) disk_copy: Mutex<Option<crate::disk_copy::DiskCopyStatus>>,
    /// The VM generation ID (also on the port bus in `devices`), which a restore renews.
    pub(crate) generation: Arc<Mutex<VmGenId>>,
    /// RAM still arriving and the balloon's discard ban, counted (`holds.rs`).
    pub(crate) holds: super::holds::RamHolds,
    /// MSRs this host lets a vCPU save and restore (found with the vCPUs).
    pub(super) msrs: OnceLock<Vec<u32>>,
    /// Where the last state save or load (and a destination's resume) spent its time.
    pub(crate) state_parts: Mutex<Vec<ferry_migrate::StatePart>>,
    /// What a migration's destination must match (`vmconfig.rs`).
    pub(crate) description: crate::vmconfig::VmDescription,
    pub(crate) migration: Mutex<Option<Arc<ferry_migrate::Control>>>,
    /// The events of this VM's migrations, both sides, for `GET /events`.
    pub(crate) events: Arc<ferry_migrate::events::EventLog>,
    /// On a migration destination: the incoming migration's progress and cancel.
    pub(crate) incoming: Option<Arc<ferry_migrate::destination::IncomingControl>>,
    /// The TLS of the last migration from here, for its postcopy recovery's connections.
    pub(crate) migration_tls: Mutex<Option<Arc<ferry_migrate::transport::tls::SourceTls>>>,
    /// On a migration destination: the TLS its listener requires, for a recovery's listener.
    pub(crate) incoming_tls: Mutex<Option<Arc<ferry_migrate::transport::tls::DestinationTls>>>,
    /// How the last migration away from the VMM that made this VM ended, when the VMM went on
    /// to receive the guest again (`ferry run --then-incoming`): what its follower reads.
    pub(crate) previous_migration: Mutex<Option<ferry_migrate::Progress>>,
    /// A `GET /migration` answered with the migration's end (the process that handed its
    /// guest over locally exits once its operator's command heard how it ended).
    pub(crate) ending_read: std::sync::atomic::AtomicBool,
    /// Where this VMM waits for the guest's return once a migration took it away
    /// (`ferry run --then-incoming`), if it does.
    pub(crate) then_incoming: Mutex<Option<String>>,
    /// Auto-converge's throttle (see `throttle.rs`).
    pub(super) throttle: Throttle,
    /// The per-vCPU dirty limit (see `dirty_limit.rs`).
    pub(crate) dirty_limit: DirtyLimit,
    /// The TSC frequency KVM gives the guest, once the vCPUs exist (`create_vcpus`).
    pub(super) tsc_host_hz: OnceLock<u64>,
    pub(super) started: Instant,
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
        let raw: Vec<_> = fds
            .iter()
            .map(|fd| std::os::fd::AsRawFd::as_raw_fd(&*fd.lock().unwrap()))
            .collect();
        self.kvm.map_dirty_rings(&raw)?;
        let msrs = crate::kvm::state::readable_msrs(&self.kvm.kvm, &fds[0].lock().unwrap())?;
        // Only the state load or a boot creates them, on one thread, before any vCPU runs.
        let _ = self.msrs.set(msrs);
        if let Some(hz) = vcpu::tsc_hz(&fds[0].lock().unwrap()) {
            let _ = self.tsc_host_hz.set(hz);
        }
        let _ = self.vcpu_fds.set(fds);
        Ok(true)
    }

    /// For vCPU `vcpu`'s thread when its dirty ring filled: its entries are read into the
    /// pending bitmaps (the next sync takes them) and the rings reset, so it can run.
    pub(crate) fn harvest_own_ring(&self, vcpu: usize) -> Result<(), DirtyLogError> {
        let h = self.kvm.harvest_own_ring(vcpu)?;
        self.dirty_limit.charge(vcpu, h.pages, h.since);
        Ok(())
    }

    /// Charges each vCPU for the pages a sync read from its ring (by vCPU id), and kicks those
    /// that now owe a sleep, so that they take it before running on.
    pub(crate) fn charge_dirty(&self, per_vcpu: &[crate::kvm::rings::Harvest]) {
        let owing: Vec<usize> = per_vcpu
            .iter()
            .enumerate()
            .filter(|(v, h)| self.dirty_limit.charge(*v, h.pages, h.since))
            .map(|(v, _)| v)
            .collect();
        if !owing.is_empty() {
            let c = self.control.lock().unwrap();
            if c.vcpus_alive > 0 {
                owing.iter().for_each(|&v| c.kick(v));
            }
        }
    }

    /// Sets each vCPU's dirty limit; without the dirty ring the VMM cannot tell which vCPU
    /// dirtied a page, so it cannot.
    pub(crate) fn set_dirty_limit(
        &self,
        bytes_per_s: Option<u64>,
    ) -> Result<(), ferry_migrate::VmError> {
        if bytes_per_s.is_some() && self.kvm.dirty_rings().is_none() {
            return Err(ferry_migrate::VmError::Unsupported {
                operation: "a per-vCPU dirty limit on a VM without the dirty ring (start the VM with ferry run --dirty-ring 4096)",
            });
        }
        self.dirty_limit.set(bytes_per_s);
        Ok(())
    }

    /// What each vCPU dirtied since the log started, and slept for the dirty limit; empty
    /// without the dirty ring.
    pub(crate) fn vcpu_dirty(&self) -> Vec<ferry_migrate::VcpuDirty> {
        let Some(rings) = self.kvm.dirty_rings() else {
            return Vec::new();
        };
        let slept = self.dirty_limit.slept();
        rings
            .dirtied()
            .into_iter()
            .enumerate()
            .map(|(v, pages)| ferry_migrate::VcpuDirty {
                vcpu: v as u32,
                dirtied_pages: pages,
                limited_ms: slept.get(v).map_or(0.0, |d| d.as_secs_f64() * 1e3),
            })
            .collect()
    }
}
