//! The VM's NIC (virtio-net over a tap): built with the other devices, its tap attached at
//! the state load on an arriving VM (the source's passed in a local handover), its gate
//! opened and closed with the vCPUs, the receive thread, and the announce after a move.
//!
//! The gate (see the module doc of `devices::virtio::net`) follows the run state: closed,
//! under the NIC's lock, by [`Shared::net_gate`] once a pause has parked every vCPU, and
//! opened before they run again; the control lock is taken before the NIC's, never after.

use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use ferry_migrate::{DeviceFd, VmError};
use serde::Serialize;

use super::config::{NET_GSI, NET_MMIO};
use super::shared::Shared;
use crate::devices::irq::IrqLine;
use crate::devices::virtio::MmioTransport;
use crate::devices::virtio::mmio;
use crate::devices::virtio::net::{Mac, Net, NetOptions, NetStats, OpenMarks};
use crate::devices::{BusKind, Devices};
use crate::error::VmmError;
use crate::kvm::{KvmVm, irqchip};
use crate::memory::GuestRam;
use crate::section_ids::VIRTIO_MMIO;
use crate::tap::Tap;

/// The NIC's instance among the virtio-mmio devices' sections (the balloon is 0, the disk 1).
pub(crate) const NET_INSTANCE: u32 = 2;
/// How long the receive thread waits in one poll when nothing wakes it: it looks at the VM
/// again this often (a VM dropped ends the thread).
const RECEIVE_POLL: Duration = Duration::from_millis(200);

/// The NIC as `GET /vm` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct NetStatus {
    pub mac: String,
    /// The tap's name, once attached.
    pub tap: Option<String>,
    pub driver_ok: bool,
    /// Whether received frames pass to the guest (its vCPUs run).
    pub receiving: bool,
    #[serde(flatten)]
    pub stats: NetStats,
    /// What the NIC did first since its gate last opened (a resume), on the host's clock.
    pub since_open: OpenMarks,
}

/// When the announce after a move sends its rounds: QEMU's defaults (`announce-initial` 50
/// ms, `announce-step` 100 ms, `announce-rounds` 5): the first at once, then 50, 150, 250 and
/// 350 ms after the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Announce {
    pub rounds: u32,
    pub initial_ms: u64,
    pub step_ms: u64,
}

impl Default for Announce {
    fn default() -> Self {
        Announce {
            rounds: 5,
            initial_ms: 50,
            step_ms: 100,
        }
    }
}

impl Announce {
    /// The wait before round `k` (0-based): none before the first.
    pub fn wait_before(&self, k: u32) -> Duration {
        match k {
            0 => Duration::ZERO,
            _ => Duration::from_millis(self.initial_ms + self.step_ms * u64::from(k - 1)),
        }
    }
}

/// Builds the NIC and registers it: attached now on a new VM, deferred on an `arriving` one.
pub(super) fn build(
    options: &NetOptions,
    kvm_vm: &KvmVm,
    ram: &Arc<GuestRam>,
    devices: &mut Devices,
    arriving: bool,
) -> Result<Arc<Mutex<MmioTransport<Net>>>, VmmError> {
    let device = match arriving {
        false => Net::open(options)?,
        true => Net::arriving(options)?,
    };
    let line = IrqLine::unconnected().map_err(VmmError::Eventfd)?;
    irqchip::connect(&kvm_vm.vm, &line, NET_GSI)?;
    let net = Arc::new(Mutex::new(MmioTransport::new(device, ram.clone(), line)));
    let at = (BusKind::Mmio, NET_MMIO, mmio::MMIO_SIZE);
    devices.register("virtio-net", NET_INSTANCE, at, net.clone())?;
    Ok(net)
}

impl Shared {
    /// Opens or closes the NIC's gate; the caller holds the control lock (so a pause and a
    /// resume set it in their order).
    pub(super) fn net_gate(&self, open: bool) {
        if let Some(net) = &self.net {
            net.lock().unwrap().set_open(open);
        }
    }

    /// A vCPU leaving a pause (or starting) takes the receive turn the gate's opening asked
    /// for, unless one was taken since: the frames that waited in the tap while the VM was
    /// paused reach the guest as it runs again, not whenever the receive thread is next
    /// scheduled (12 ms after the gate opened, seen by `ferry bench net --trace` on a busy
    /// 2-core host). The control lock is not held: this takes the NIC's.
    pub(super) fn net_first_turn(&self) {
        if let Some(net) = &self.net {
            let mut t = net.lock().unwrap();
            let d = t.device();
            if d.is_open() && d.open_marks().first_turn_ns.is_none() {
                t.receive();
            }
        }
    }

    /// At a migration's save, the vCPUs paused: the frames waiting in the tap go into the
    /// NIC, and with its state to the destination, whose guest gets them first, instead of
    /// being lost with this host's tap. A snapshot takes none: the source runs on and reads
    /// them itself.
    pub(crate) fn take_waiting_frames(&self) {
        if let Some(net) = &self.net {
            let n = net.lock().unwrap().take_waiting();
            if n > 0 {
                tracing::debug!("virtio-net: {n} frames from the tap go with the state");
            }
        }
    }

    /// At the state load: checks the MAC the state carries against the one the user gave,
    /// and attaches the tap (the one a local handover passed, else its own). A migrated guest
    /// keeps its MAC, and a `mac=` that differs is refused; a clone (`renewed`, a restore) gets
    /// the one given, or a new random one, and its driver a config change.
    pub(crate) fn attach_net(&self, renewed: bool) -> Result<(), VmError> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let mut t = net.lock().unwrap();
        let (carried, given) = (t.device().mac(), t.device().given_mac());
        match (renewed, given) {
            (false, Some(given)) if given != carried => {
                return Err(VmError::failed(
                    "load the NIC's state",
                    format!(
                        "the source's NIC has MAC {carried}, this one was given mac={given}; give the source's MAC or none"
                    ),
                ));
            }
            (false, _) => {}
            (true, given) => {
                let mac = given.unwrap_or_else(Mac::random);
                if mac != carried {
                    t.change_mac(mac);
                }
            }
        }
        t.device_mut()
            .attach()
            .map_err(|e| VmError::failed("attach the NIC's tap", e))
    }

    /// The tap's descriptor for a local handover (a `dup`), named as the NIC's state is.
    pub(crate) fn net_descriptors(&self) -> Result<Vec<DeviceFd>, VmError> {
        let Some(net) = &self.net else {
            return Ok(Vec::new());
        };
        let t = net.lock().unwrap();
        let Some(tap) = t.device().tap() else {
            return Ok(Vec::new());
        };
        let fd = tap
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| VmError::failed("pass the NIC's tap", e))?;
        Ok(vec![DeviceFd {
            id: VIRTIO_MMIO,
            instance: NET_INSTANCE,
            fd,
        }])
    }

    /// Takes the tap a local handover's source passed, if `d` is the NIC's; gives `d` back
    /// otherwise.
    pub(crate) fn adopt_net_fd(&self, d: DeviceFd) -> Result<Option<DeviceFd>, VmError> {
        match &self.net {
            Some(net) if (d.id, d.instance) == (VIRTIO_MMIO, NET_INSTANCE) => {
                let tap =
                    Tap::from_fd(d.fd).map_err(|e| VmError::failed("take the source's tap", e))?;
                net.lock().unwrap().device_mut().pass_tap(tap);
                Ok(None)
            }
            _ => Ok(Some(d)),
        }
    }

    pub(crate) fn net_status(&self) -> Option<NetStatus> {
        let net = self.net.as_ref()?;
        let t = net.lock().unwrap();
        let d = t.device();
        Some(NetStatus {
            mac: d.mac().to_string(),
            tap: d.tap().map(|t| t.name().to_string()),
            driver_ok: t.driver_ok(),
            receiving: d.is_open(),
            stats: d.stats(),
            since_open: d.open_marks().clone(),
        })
    }

    /// Sends the announce's rounds for the guest's MAC on a thread of their own (the first
    /// before this returns); returns at once without a NIC.
    pub(crate) fn announce(self: &Arc<Self>, plan: Announce) {
        if self.net.is_none() || plan.rounds == 0 {
            return;
        }
        let round = |vm: &Shared| {
            if let Some(net) = &vm.net
                && let Err(e) = net.lock().unwrap().announce()
            {
                tracing::warn!("virtio-net: announce: {e}");
            }
        };
        round(self);
        let vm = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("net-announce".into())
            .spawn(move || {
                for k in 1..plan.rounds {
                    std::thread::sleep(plan.wait_before(k));
                    match vm.upgrade() {
                        Some(vm) => round(&vm),
                        None => return,
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("virtio-net: no thread for the announce's later rounds: {e}");
        }
    }
}

impl Shared {
    /// Announces the guest's MAC now, as after a move: refused, naming the fix, for a VM
    /// without a NIC or whose tap is not attached yet.
    pub(crate) fn announce_now(self: &Arc<Self>, plan: Announce) -> Result<(), String> {
        let Some(net) = &self.net else {
            return Err("this VM has no NIC; start it with --net tap=NAME".into());
        };
        if net.lock().unwrap().device().tap().is_none() {
            return Err("the NIC's tap is attached when the guest's state arrives; announce once the guest runs here".into());
        }
        self.announce(plan);
        Ok(())
    }
}

/// Starts the NIC's receive thread, which holds the VM weakly and ends when it is dropped.
pub(super) fn start_receiver(vm: &Arc<Shared>) -> Result<(), VmmError> {
    let Some(net) = &vm.net else {
        return Ok(());
    };
    let wake = net.lock().unwrap().device().wake_fd();
    let vm = Arc::downgrade(vm);
    std::thread::Builder::new()
        .name("net-rx".into())
        .spawn(move || receive(&vm, &wake))
        .map_err(VmmError::Thread)?;
    Ok(())
}

/// The receive thread: waits for a frame on the tap (while the guest has buffers and the gate
/// is open) or for a wake (the driver gave buffers, the gate opened, the tap attached), and
/// fills the guest's buffers.
fn receive(vm: &Weak<Shared>, wake: &vmm_sys_util::eventfd::EventFd) {
    use crate::devices::virtio::net::Receive;
    use std::os::fd::AsRawFd;
    let mut waiting_for_buffers = true;
    loop {
        let tap = {
            let Some(vm) = vm.upgrade() else { return };
            let net = vm.net.as_ref().expect("a receive thread has its NIC");
            let t = net.lock().unwrap();
            t.device().tap().cloned().filter(|_| t.device().is_open())
        };
        let mut fds = vec![libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        if let Some(tap) = &tap
            && !waiting_for_buffers
        {
            fds.push(libc::pollfd {
                fd: tap.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        if !crate::tap::poll(&mut fds, RECEIVE_POLL) {
            continue;
        }
        let _ = wake.read();
        let Some(vm) = vm.upgrade() else { return };
        let net = vm.net.as_ref().expect("a receive thread has its NIC");
        let got = net.lock().unwrap().receive();
        waiting_for_buffers = matches!(got, None | Some(Receive::NoBuffer { .. }));
    }
}
