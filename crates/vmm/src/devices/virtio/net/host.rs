//! The host's calls on the network device through its transport: the receive thread's turn,
//! the gate, and the announce.

#![forbid(unsafe_code)]

use ferry_guest_abi::virtio::net::RX_QUEUE;

use super::device::{Net, Receive};
use crate::devices::virtio::MmioTransport;

/// The RARP frame QEMU's self-announce sends (ethertype 0x8035, "reverse request" for the
/// MAC): from the guest's MAC to broadcast, so every switch on the way learns where it is.
pub fn announce_frame(mac: [u8; 6]) -> [u8; 60] {
    let mut f = [0u8; 60];
    f[..6].fill(0xff);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x8035u16.to_be_bytes());
    // ARP header: Ethernet (1), IPv4 (0x0800), 6, 4, opcode 3 (reverse request).
    f[14..16].copy_from_slice(&1u16.to_be_bytes());
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes());
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&3u16.to_be_bytes());
    f[22..28].copy_from_slice(&mac);
    f[32..38].copy_from_slice(&mac);
    f
}

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

    /// Gives the NIC `mac` (a clone's new one) and tells the driver its config changed.
    pub fn change_mac(&mut self, mac: super::Mac) {
        self.device_mut().set_mac(mac);
        self.config_changed();
    }

    /// Sends one round of announce frames for the guest's MAC on the tap.
    pub fn announce(&mut self) -> std::io::Result<()> {
        let net = self.device_mut();
        let frame = announce_frame(net.mac().0);
        let Some(tap) = net.tap() else {
            return Err(std::io::Error::other("the NIC has no tap attached yet"));
        };
        tap.send(&frame)?;
        net.count_announce();
        Ok(())
    }
}
