//! [`VmHandle`], the one way to control a VM from another thread: pause, resume and stop as a
//! small state machine under the control mutex, the throttle and its ticker thread, status.
//!
//! The controller sets the desired state and kicks the vCPU threads (see `kvm::kick`); each
//! vCPU thread looks at the desired state before every `KVM_RUN`, parks while paused and
//! leaves when stopped (`runner.rs`). `pause` returns only once every vCPU is parked, so a
//! paused VM's memory and registers are still (and a migration may read the vCPU, whose mutex a
//! parked thread does not hold).

#![forbid(unsafe_code)]

pub mod balloon;

use std::sync::{Arc, MutexGuard, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::shared::{Control, Shared};
use super::start_port;
use super::state::{RunState, StopReason};
use crate::devices::telemetry::{self, GuestTelemetry};
use crate::memory::GuestRam;
use crate::throttle;

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
    /// The VM generation ID its guest reads now (`devices::vmgenid`), 32 hex digits: the same
    /// after a live migration, new in each restore of a snapshot.
    pub generation_id: String,
    pub guest: GuestTelemetry,
    /// While the state is `preparing`: what, and how far along.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preparing: Option<ferry_migrate::destination::Preparing>,
    /// While guest RAM is still arriving (an incoming migration, a lazy restore loading):
    /// from where. No migration, handover or snapshot of this VM starts meanwhile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ram_arriving: Option<super::holds::Arrival>,
    /// The disk, if the VM has one: whether its driver runs, and its requests counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<super::DiskStatus>,
    /// The NIC, if the VM has one: its MAC and tap, whether frames pass, and its counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net: Option<super::NetStatus>,
}

impl VmHandle {
    pub(super) fn lock(&self) -> MutexGuard<'_, Control> {
        self.0.control.lock().unwrap()
    }

    /// Pauses all vCPUs; returns once none is running guest code, or fails after
    /// [`PAUSE_TIMEOUT`] with the VM running as before (a vCPU blocked on a postcopy page
    /// cannot stop, and the caller, such as the API's one thread, must not wait for ever).
    pub fn pause(&self) -> Result<(), ControlError> {
        self.pause_within(PAUSE_TIMEOUT)
    }

    pub(super) fn pause_within(&self, timeout: Duration) -> Result<(), ControlError> {
        let mut c = self.lock();
        if let Some(r) = &c.stop_reason {
            return Err(ControlError::Stopped(r.clone()));
        }
        if c.desired == RunState::Incoming {
            return Err(ControlError::Incoming);
        }
        let before = c.desired;
        c.desired = RunState::Paused;
        c.kick_all();
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
        // Every vCPU is parked: no frame reaches guest memory until they run again.
        self.0.net_gate(false);
        start_port::start_asked(&self.0, &mut c);
        Ok(())
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
        self.0.net_gate(true);
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
        c.kick_all();
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
        self.lock().cpu_ns()
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
                self.0.throttle.no_ticker();
                tracing::warn!("could not start the throttle's ticker thread");
            }
        }
        Ok(())
    }

    pub fn throttle_percent(&self) -> u8 {
        self.0.throttle.percent()
    }

    /// Wall time the vCPUs spent in throttle sleeps so far, summed over vCPUs, in ns.
    pub fn throttle_slept_ns(&self) -> u64 {
        self.0.throttle.slept_ns()
    }

    /// The disk's status, if the VM has one.
    pub fn disk(&self) -> Option<super::DiskStatus> {
        self.0.disk_status()
    }

    /// The last copy of this VM's disk (`disk_copy`), while it runs and once it ended.
    pub fn disk_copy(&self) -> Option<super::DiskCopyStatus> {
        self.0.disk_copy_status()
    }

    /// The guest's telemetry, with the TSC frequency KVM gives it beside its calibration.
    pub fn telemetry(&self) -> GuestTelemetry {
        let mut t = self.0.telemetry.lock().unwrap().clone();
        t.tsc_host_hz = self.0.tsc_host_hz.get().copied();
        t
    }

    pub fn ram(&self) -> &GuestRam {
        &self.0.ram
    }

    /// Announces the guest's MAC now, as after a move (`PUT /vm/announce`,
    /// `ferry migrate-announce`).
    pub fn announce(&self, plan: super::Announce) -> Result<(), String> {
        self.0.announce_now(plan)
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
            ram_arriving: self.ram_arriving(),
            disk: self.disk(),
            net: self.0.net_status(),
            stop_reason,
            memory_bytes: self.0.ram.size(),
            memory_allocated_bytes: self.0.ram.allocated_bytes().unwrap_or(0),
            vcpus: self.0.description.vcpus,
            vcpu_threads: self.lock().vcpus_alive,
            uptime_ms: self.0.started.elapsed().as_millis() as u64,
            vcpu_cpu_ms: vcpu_cpu_ns as f64 / 1e6,
            throttle_percent: self.throttle_percent(),
            host_monotonic_ns: telemetry::host_monotonic_ns(),
            generation_id: self.0.generation.lock().unwrap().id().to_string(),
            guest: self.telemetry(),
        }
    }
}

/// The throttle's ticker: kicks every vCPU out of `KVM_RUN` each timeslice while a throttle
/// is set, so that each looks at how long it ran. Holds the VM weakly: a dropped VM ends it.
fn tick(vm: &Weak<Shared>) {
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
        c.kick_all();
    }
}
