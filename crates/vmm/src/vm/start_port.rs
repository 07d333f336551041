//! The vCPU start port (`ferry_guest_abi::smp`): how the guest starts its secondary vCPUs.
//! The vCPU that writes the port records the request under the control mutex and kicks the
//! target's thread, which sets the target's entry state and makes it runnable on its own thread
//! (a `VcpuFd` is used by its thread only while the VM runs); a request whose target had
//! already parked for a pause is carried out by the pause, once every vCPU is parked.

#![forbid(unsafe_code)]

use std::sync::Mutex;

use ferry_guest_abi::smp::{START_SIZE, StartVcpu};

use super::shared::{Control, Shared};
use super::state::StopReason;
use crate::kvm::vcpu::{self, VcpuFd};

/// vCPU `from` asks, through the start port, to start a secondary vCPU
/// (`ferry_guest_abi::smp`): record the request and kick that vCPU's thread, which starts it
/// ([`start_if_asked`]). A malformed request is logged and ignored, as hardware ignores a bad
/// IPI.
pub(super) fn ask(shared: &Shared, from: usize, data: &[u8]) {
    let request = <[u8; 4]>::try_from(data)
        .map_err(|_| format!("a {}-byte write", data.len()))
        .and_then(|w| {
            let gpa = u64::from(u32::from_le_bytes(w));
            let mut b = [0; START_SIZE];
            shared
                .ram
                .read(gpa, &mut b)
                .map_err(|e| format!("a request at {gpa:#x} outside RAM: {e}"))?;
            StartVcpu::from_bytes(&b).ok_or(format!("no request at {gpa:#x} (bad magic)"))
        })
        .and_then(|r| {
            let n = shared.vcpus().len();
            match r.vcpu as usize {
                0 => Err("a request to start vCPU 0, which booted".to_string()),
                k if k >= n => Err(format!("a request for vCPU {k}; the VM has {n}")),
                _ if shared.ram.read(u64::from(r.entry), &mut [0]).is_err() => {
                    Err(format!("an entry point {:#x} outside RAM", r.entry))
                }
                _ => Ok(r),
            }
        });
    match request {
        Ok(r) => {
            let mut c = shared.control.lock().unwrap();
            c.starts[r.vcpu as usize] = Some(r);
            c.kick(r.vcpu as usize);
        }
        Err(why) => tracing::warn!("vCPU {} wrote the start port with {why}; ignored", from),
    }
}

/// Starts vCPU `index` (on its own thread) if the guest asked; a reason when it cannot be.
pub(super) fn start_if_asked(
    shared: &Shared,
    index: usize,
    vcpu: &Mutex<VcpuFd>,
) -> Option<StopReason> {
    let request = shared.control.lock().unwrap().starts[index].take()?;
    let id = index as u8;
    let started = vcpu::start_secondary(&vcpu.lock().unwrap(), id, &request);
    tracing::debug!("vCPU {id} started at {:#x}", request.entry);
    started
        .err()
        .map(|e| StopReason::Failed(format!("vCPU {id}: {e}")))
}

/// Starts the vCPUs the guest asked for that their threads have not started yet: a request
/// made just before a pause, whose target had already parked. With every vCPU parked no
/// thread holds a vCPU's lock, and no guest code can ask for more, so a paused VM is
/// saved with every vCPU it started running.
pub(super) fn start_asked(shared: &Shared, c: &mut Control) {
    for (id, request) in c.starts.iter_mut().enumerate() {
        let Some(r) = request.take() else {
            continue;
        };
        let vcpu = shared.vcpus()[id].lock().unwrap();
        if let Err(e) = vcpu::start_secondary(&vcpu, id as u8, &r) {
            tracing::warn!("vCPU {id} could not be started while paused: {e}");
        }
    }
}
