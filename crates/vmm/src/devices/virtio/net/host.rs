//! The host's calls on the network device through its transport: the receive thread's turn,
//! the gate, and the announce.

#![forbid(unsafe_code)]

use ferry_guest_abi::net;
use ferry_guest_abi::virtio::net::RX_QUEUE;

use super::device::{Net, Receive};
use crate::devices::virtio::MmioTransport;

impl MmioTransport<Net> {
    /// The receive thread's turn: frames waiting in the tap into the driver's buffers, while
    /// the driver runs and the gate is open. `None`: the driver is not running.
    pub fn receive(&mut self) -> Option<Receive> {
        let mut out = None;
        self.run_on_queue(usize::from(RX_QUEUE), |net, queue, ram| {
            let r = net.receive(queue, ram.memory())?;
            out = Some(r);
            Ok(r.used())
        });
        out
    }

    /// Opens (the vCPUs run) or closes (they are paused) the gate received frames pass.
    pub fn set_open(&mut self, open: bool) {
        self.device_mut().set_open(open);
    }

    /// Takes the frames waiting in the tap into the device, for the state to carry (see
    /// `Net::take_waiting`); returns how many.
    pub fn take_waiting(&mut self) -> usize {
        self.device_mut().take_waiting()
    }

    /// Gives the NIC `mac` (a clone's new one) and tells the driver its config changed.
    pub fn change_mac(&mut self, mac: super::Mac) {
        self.device_mut().set_mac(mac);
        self.config_changed();
    }

    /// Sends one round of announce frames for the guest's MAC on the tap.
    pub fn announce(&mut self) -> std::io::Result<()> {
        let mut frame = [0u8; net::MIN_FRAME];
        let len = net::build_rarp_announce(net::Mac(self.device().mac().0), &mut frame)
            .expect("a minimum frame holds a RARP announce");
        let net = self.device_mut();
        let Some(tap) = net.tap() else {
            return Err(std::io::Error::other("the NIC has no tap attached yet"));
        };
        tap.send(&frame[..len])?;
        net.count_announce();
        Ok(())
    }
}
