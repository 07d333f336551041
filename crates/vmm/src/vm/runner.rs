//! A vCPU's thread: wait while the VM is paused or throttled, `KVM_RUN`, dispatch the exit
//! (port and MMIO accesses to the devices, the start port, the exit port), until the VM
//! stops; the vCPU that stops it kicks the others out of `KVM_RUN`.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_guest_abi::smp::START_PORT;

use super::shared::Shared;
use super::start_port;
use super::state::{RunState, StopReason};
use crate::kvm::kick;
use crate::kvm::vcpu::{self, VcpuFd};

/// A vCPU thread's view of the VM.
pub(super) struct VcpuRunner {
    pub(super) shared: Arc<Shared>,
    /// Which vCPU (its id).
    pub(super) index: usize,
}

impl VcpuRunner {
    pub(super) fn run(self) {
        let vcpu = self.shared.vcpus()[self.index].clone();
        let immediate_exit = vcpu::immediate_exit(&mut vcpu.lock().unwrap());
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
        c.kick_all();
        self.shared.changed.notify_all();
    }

    /// Runs until the VM must stop, and says why.
    fn run_loop(&self, vcpu: &Mutex<VcpuFd>) -> StopReason {
        // When the vCPU last started running after a wait, and until when it sleeps now.
        let mut running_since = Instant::now();
        let mut asleep_until = None;
        // Whether the sleep being taken is the dirty limit's (else the throttle's).
        let mut limited = false;
        let mut first = true;
        loop {
            // Before parking: a vCPU started just before a pause must be saved started.
            if let Some(reason) = start_port::start_if_asked(&self.shared, self.index, vcpu) {
                return reason;
            }
            let asleep = asleep_until.take();
            let parked_at = Instant::now();
            let parked = match self.wait_while_paused(asleep, &mut running_since) {
                Ok(parked) => parked,
                Err(reason) => return reason,
            };
            if parked || first {
                // Leaving a pause (or starting): the frames that waited in the tap go to the
                // guest now, not when the receive thread next runs.
                self.shared.net_first_turn();
                first = false;
            }
            if asleep.is_some() {
                let slept = parked_at.elapsed();
                match limited {
                    true => self.shared.dirty_limit.add_slept(self.index, slept),
                    false => self.shared.throttle.add_slept(slept),
                }
            }
            // A vCPU that dirtied past its limit sleeps what it owes first.
            let owed = self.shared.dirty_limit.owed(self.index);
            limited = !owed.is_zero();
            if limited {
                asleep_until = Some(Instant::now() + owed);
                continue;
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
            let mut wrote_disk = false;
            match vcpu::run(&mut vcpu) {
                vcpu::Exit::IoOut(ferry_guest_abi::EXIT_PORT, _) => return self.halted(&vcpu),
                vcpu::Exit::IoOut(START_PORT, data) => {
                    start_port::ask(&self.shared, self.index, data)
                }
                vcpu::Exit::IoOut(port, data) => devices.io_out(port, data),
                vcpu::Exit::IoIn(port, data) => devices.io_in(port, data),
                vcpu::Exit::MmioRead(addr, data) => devices.mmio_read(addr, data),
                vcpu::Exit::MmioWrite(addr, data) => {
                    devices.mmio_write(addr, data);
                    wrote_disk = self.shared.is_disk_register(addr);
                }
                vcpu::Exit::Interrupted => vcpu::clear_immediate_exit(&mut vcpu),
                vcpu::Exit::DirtyRingFull => {
                    if let Err(why) = self.shared.harvest_own_ring(self.index) {
                        return StopReason::Failed(format!("vCPU {}: {why}", self.index));
                    }
                }
                vcpu::Exit::Fatal(why) => {
                    let regs = vcpu::describe_registers(&vcpu);
                    return StopReason::Failed(format!("vCPU {}: {why}\n{regs}", self.index));
                }
            }
            if wrote_disk {
                drop(vcpu);
                self.shared.hold_disk_writer();
            }
        }
    }

    /// Parks while the VM is paused, and while running until `asleep_until` (a throttle's
    /// sleep, which counts as parked, so that a pause does not wait for it to end); returns a
    /// reason when it must stop. A vCPU that parked starts its next timeslice when it leaves
    /// (`running_since`), so time paused is never taken for time run. Says whether it parked.
    fn wait_while_paused(
        &self,
        asleep_until: Option<Instant>,
        running_since: &mut Instant,
    ) -> Result<bool, StopReason> {
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
                    return Err(c
                        .stop_reason
                        .clone()
                        .unwrap_or(StopReason::Requested("stop".into())));
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
        Ok(parked)
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
