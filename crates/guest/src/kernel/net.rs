//! The network workload (`net=`): the boot vCPU answers ARP for its address and echoes every
//! numbered UDP request ([`ferry_guest_abi::net`]) that reaches its port through the
//! virtio-net NIC, counting what it saw ([`ferry_guest::echo`]).
//!
//! The guest takes no interrupts, so the workload looks at the receive queue: the main loop
//! calls [`Net::poll`] at every turn, between every 64 pages the memory workload writes (its
//! clock look), every 256 pages a verify pass checks, before each disk request, and instead
//! of sleeping while it waits ([`Net::wait_until`]). A look finds the queue empty with
//! one read of guest memory; an answer is one trap to the VMM (the transmit notify), and a
//! round of frames one more (the receive notify, when the device wants it).

use ferry_guest::echo::{ANSWER_MAX, Answer, Responder};
use ferry_guest_abi::params::{MmioDevice, Params};
use ferry_guest_abi::report::{HaltReason, NetCounters};

use super::clock::Clock;
use super::nic::{Nic, RX_BUFFERS, TxError};

/// Failures named on the serial port, one line each; the counters carry the rest.
const LOGGED_FAILURES: u64 = 8;

#[derive(Debug)]
pub struct Net {
    nic: Nic,
    responder: Responder,
    logged: u64,
}

/// Starts the network workload if `net=` asks for one: `Err` when it cannot run (the reason
/// is on the serial port), `Ok(None)` when none is asked for.
pub fn start(
    p: &Params,
    dev: Option<MmioDevice>,
    clock: &Clock,
) -> Result<Option<Net>, HaltReason> {
    let Some(ip) = p.net else {
        if let Some(dev) = dev {
            crate::sprintln!(
                "ferry-guest: virtio-net NIC at {:#x} left alone: no net= workload",
                dev.addr
            );
        }
        return Ok(None);
    };
    let Some(dev) = dev else {
        crate::sprintln!(
            "ferry-guest: net={ip} but the VM has no virtio-net NIC; give it one or drop net="
        );
        return Err(HaltReason::NoNic);
    };
    let nic = Nic::start(dev, *clock).map_err(|why| {
        crate::sprintln!(
            "ferry-guest: the virtio-net NIC at {:#x} is not usable: {why}",
            dev.addr
        );
        HaltReason::NoNic
    })?;
    crate::sprintln!(
        "ferry-guest: network workload on the virtio-net NIC at {:#x}: {} at {ip}, echoing UDP port {}{}{}",
        dev.addr,
        nic.mac,
        p.net_port,
        match nic.link.status {
            Some(s) if s & ferry_guest_abi::virtio::net::S_LINK_UP == 0 => ", link down",
            _ => "",
        },
        MtuText(nic.link.mtu)
    );
    Ok(Some(Net {
        responder: Responder::new(nic.mac, ip, p.net_port),
        nic,
        logged: 0,
    }))
}

impl Net {
    pub fn counters(&self) -> NetCounters {
        self.responder.counters()
    }

    /// Answers as the NIC's new MAC if its config changed (a clone's); at each heartbeat.
    pub fn look_at_config(&mut self) {
        if let Some(mac) = self.nic.mac_changed() {
            crate::sprintln!("ferry-guest: the NIC's MAC is now {mac}; answering as it");
            self.responder.set_mac(mac);
        }
    }

    /// Answers the frames the device has filled, if any: when none came, one read of guest
    /// memory, inlined where the workload looks.
    #[inline(always)]
    pub fn poll(&mut self) {
        if self.nic.pending() {
            self.answer();
        }
    }

    /// Answers the frames the device has filled, [`RX_BUFFERS`] at most (a round of the
    /// queue, so a flood cannot keep the loop from turning), giving each buffer back at once
    /// and telling the device after the round.
    #[inline(never)]
    fn answer(&mut self) {
        let mut out = [0u8; ANSWER_MAX];
        for _ in 0..RX_BUFFERS {
            let Some(rx) = self.nic.receive() else {
                break;
            };
            let answer = self.responder.receive(self.nic.frame(&rx), &mut out);
            self.nic.give_back(rx);
            let Some(len) = answer.frame_len() else {
                continue;
            };
            match self.nic.queue(&out[..len]) {
                Ok(()) => self.responder.sent(answer),
                Err(e) => self.not_sent(answer, e),
            }
        }
        // One notify for the batch's answers, one for its buffers given back.
        self.nic.flush();
        self.nic.kick();
    }

    /// Polls until `clock` reads `deadline_ns`: what the boot vCPU does instead of sleeping
    /// on its timer while a network workload runs, since a sleeping vCPU answers nothing
    /// (and a wake-up through CPL0 costs ~0.3 ms where CPL0 is emulated, see `timer.rs`).
    pub fn wait_until(&mut self, clock: &Clock, deadline_ns: u64) {
        while clock.now_ns() < deadline_ns {
            self.poll();
            core::hint::spin_loop();
        }
    }

    fn not_sent(&mut self, answer: Answer, e: TxError) {
        self.responder.not_sent();
        if self.logged < LOGGED_FAILURES {
            self.logged += 1;
            crate::sprintln!("ferry-guest: NET ERROR: {answer:?} not sent: {e:?}");
        }
    }
}

/// `, MTU n` when the device states one.
struct MtuText(Option<u16>);

impl core::fmt::Display for MtuText {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0 {
            Some(mtu) => write!(f, ", MTU {mtu}"),
            None => Ok(()),
        }
    }
}

/// The network workload's counters on the serial log line: nothing without one.
pub struct LogText<'a>(pub Option<&'a Net>);

impl core::fmt::Display for LogText<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let Some(net) = self.0 else {
            return Ok(());
        };
        let c = net.counters();
        write!(
            f,
            " net: received={} echoes={} arp={} gaps={} dups={} ignored={} tx-errors={} last={}",
            c.frames_received,
            c.echoes_sent,
            c.arp_replies,
            c.seq_gaps,
            c.duplicates,
            c.ignored,
            c.tx_errors,
            c.last_seq
        )
    }
}
