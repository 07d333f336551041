//! The network workload's answers (`net=`): what the guest sends back for each frame it
//! receives, and what it counts, apart from the driver so it is tested on the host.
//!
//! A frame is for the guest when its destination is the guest's MAC (or broadcast, for ARP).
//! An ARP request for the guest's address gets a reply; an echo request
//! ([`ferry_guest_abi::net`]) to its address and port gets an echo, from that port to the
//! sender's, numbered against the last request seen ([`NetCounters::count_request`]): a
//! duplicate is answered too, so the sender sees every frame the guest was given. Anything
//! else is counted as ignored and left unanswered.

use ferry_guest_abi::net::{
    self, Echo, Endpoint, Ipv4, Mac, build_arp, build_udp, parse_arp, parse_request, parse_udp,
};
use ferry_guest_abi::report::NetCounters;

/// Bytes an answer takes at most: an echo's frame (70), above the 60 of an ARP reply.
pub const ANSWER_MAX: usize = net::udp_frame_len(net::ECHO_SIZE);

/// What the guest sends back for a frame, written into the buffer [`Responder::receive`] was
/// given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Nothing: the frame was not for the guest, or not a request.
    None,
    /// An ARP reply of this many bytes.
    Arp(usize),
    /// An echo of this many bytes.
    Echo(usize),
}

impl Answer {
    /// The answer's frame length, if there is one to send.
    pub fn frame_len(self) -> Option<usize> {
        match self {
            Answer::None => None,
            Answer::Arp(n) | Answer::Echo(n) => Some(n),
        }
    }
}

/// The guest's side of the echo: its MAC, address and port, and its counters.
#[derive(Clone, Copy, Debug)]
pub struct Responder {
    me: Endpoint,
    counters: NetCounters,
}

impl Responder {
    pub fn new(mac: Mac, ip: Ipv4, port: u16) -> Responder {
        Responder {
            me: Endpoint { mac, ip, port },
            counters: NetCounters::default(),
        }
    }

    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    /// Answers as `mac` from now on (a clone's NIC was given a new one).
    pub fn set_mac(&mut self, mac: Mac) {
        self.me.mac = mac;
    }

    /// Takes one received frame and writes the answer to it, if any, into `out` (at least
    /// [`ANSWER_MAX`] bytes). The answer counts as sent once [`Responder::sent`] says so.
    pub fn receive(&mut self, frame: &[u8], out: &mut [u8]) -> Answer {
        self.counters.frames_received += 1;
        let answer = self.answer(frame, out);
        if answer == Answer::None {
            self.counters.ignored += 1;
        }
        answer
    }

    /// The device took `answer` to send.
    pub fn sent(&mut self, answer: Answer) {
        match answer {
            Answer::None => {}
            Answer::Arp(_) => self.counters.arp_replies += 1,
            Answer::Echo(_) => self.counters.echoes_sent += 1,
        }
    }

    /// The device had no room for an answer: it is lost, and counted.
    pub fn not_sent(&mut self) {
        self.counters.tx_errors += 1;
    }

    fn answer(&mut self, frame: &[u8], out: &mut [u8]) -> Answer {
        let Some(to) = net::destination(frame) else {
            return Answer::None;
        };
        match net::ethertype(frame) {
            Some(net::ETHERTYPE_ARP) if to == self.me.mac || to == Mac::BROADCAST => {
                match parse_arp(frame) {
                    Ok(arp) if arp.asks_for(self.me.ip) => {
                        let reply = arp.reply(self.me.mac, self.me.ip);
                        build_arp(&reply, out).map_or(Answer::None, Answer::Arp)
                    }
                    _ => Answer::None,
                }
            }
            Some(net::ETHERTYPE_IPV4) if to == self.me.mac => self.echo(frame, out),
            _ => Answer::None,
        }
    }

    fn echo(&mut self, frame: &[u8], out: &mut [u8]) -> Answer {
        let Ok(udp) = parse_udp(frame) else {
            return Answer::None;
        };
        if udp.dst.ip != self.me.ip || udp.dst.port != self.me.port {
            return Answer::None;
        }
        let Some(request) = parse_request(udp.payload) else {
            return Answer::None;
        };
        self.counters.count_request(request.seq);
        let echo = Echo {
            seq: request.seq,
            echoes: self.counters.echoes_sent + 1,
            received: self.counters.frames_received,
        };
        build_udp(self.me, udp.src, &echo.to_bytes(), out).map_or(Answer::None, Answer::Echo)
    }
}

#[cfg(test)]
mod tests {
    use ferry_guest_abi::net::{
        ARP_REPLY, ARP_REQUEST, Arp, ETHERTYPE_ARP, EchoRequest, build_rarp_announce, parse_echo,
    };

    use super::*;

    const GUEST: Endpoint = Endpoint {
        mac: Mac([0x52, 0x54, 0, 0, 0, 2]),
        ip: Ipv4([10, 9, 0, 2]),
        port: 7,
    };
    const HOST: Endpoint = Endpoint {
        mac: Mac([0x02, 0, 0, 0, 0, 1]),
        ip: Ipv4([10, 9, 0, 1]),
        port: 5555,
    };

    fn request(seq: u64, to: Endpoint) -> ([u8; 128], usize) {
        let mut f = [0u8; 128];
        let n = build_udp(HOST, to, &EchoRequest { seq }.to_bytes(), &mut f).unwrap();
        (f, n)
    }

    fn guest() -> Responder {
        Responder::new(GUEST.mac, GUEST.ip, GUEST.port)
    }

    /// Sends request `seq` and returns the echo the guest sent back.
    fn exchange(r: &mut Responder, seq: u64) -> Echo {
        let (f, n) = request(seq, GUEST);
        let mut out = [0u8; ANSWER_MAX];
        let answer = r.receive(&f[..n], &mut out);
        let Answer::Echo(len) = answer else {
            panic!("no echo for {seq}: {answer:?}");
        };
        r.sent(answer);
        let udp = parse_udp(&out[..len]).unwrap();
        assert_eq!(
            (udp.src, udp.dst),
            (GUEST, HOST),
            "back from the port asked"
        );
        parse_echo(udp.payload).unwrap()
    }

    #[test]
    fn every_request_is_echoed_with_the_guests_counts() {
        let mut r = guest();
        for seq in 1..=3 {
            let echo = exchange(&mut r, seq);
            assert_eq!((echo.seq, echo.echoes, echo.received), (seq, seq, seq));
        }
        // 4 and 5 lost on the way; 3 given again; then 6.
        assert_eq!(exchange(&mut r, 6).echoes, 4);
        let dup = exchange(&mut r, 3);
        assert_eq!((dup.seq, dup.echoes, dup.received), (3, 5, 5));
        let c = r.counters();
        assert_eq!((c.seq_gaps, c.duplicates, c.last_seq), (2, 1, 6));
        assert_eq!((c.echoes_sent, c.frames_received, c.ignored), (5, 5, 0));
    }

    #[test]
    fn arp_for_the_guests_address_is_answered_and_other_arp_is_not() {
        let mut r = guest();
        let ask = |target_ip| Arp {
            eth_dst: Mac::BROADCAST,
            eth_src: HOST.mac,
            ethertype: ETHERTYPE_ARP,
            op: ARP_REQUEST,
            sender_mac: HOST.mac,
            sender_ip: HOST.ip,
            target_mac: Mac::ZERO,
            target_ip,
        };
        let mut f = [0u8; 64];
        let n = build_arp(&ask(GUEST.ip), &mut f).unwrap();
        let mut out = [0u8; ANSWER_MAX];
        let answer = r.receive(&f[..n], &mut out);
        let Answer::Arp(len) = answer else {
            panic!("{answer:?}");
        };
        r.sent(answer);
        let reply = parse_arp(&out[..len]).unwrap();
        assert_eq!(reply.op, ARP_REPLY);
        assert_eq!((reply.sender_mac, reply.sender_ip), (GUEST.mac, GUEST.ip));
        assert_eq!(reply.eth_dst, HOST.mac);
        let n = build_arp(&ask(Ipv4([10, 9, 0, 3])), &mut f).unwrap();
        assert_eq!(r.receive(&f[..n], &mut out), Answer::None);
        let n = build_rarp_announce(HOST.mac, &mut f).unwrap();
        assert_eq!(r.receive(&f[..n], &mut out), Answer::None);
        let c = r.counters();
        assert_eq!((c.arp_replies, c.ignored, c.frames_received), (1, 2, 3));
    }

    #[test]
    fn frames_for_others_or_broken_are_ignored_and_counted() {
        let mut r = guest();
        let mut out = [0u8; ANSWER_MAX];
        let other_mac = Endpoint {
            mac: Mac([0x52, 0x54, 0, 0, 0, 9]),
            ..GUEST
        };
        let other_ip = Endpoint {
            ip: Ipv4([10, 9, 0, 9]),
            ..GUEST
        };
        let other_port = Endpoint { port: 8, ..GUEST };
        let broadcast = Endpoint {
            mac: Mac::BROADCAST,
            ..GUEST
        };
        for to in [other_mac, other_ip, other_port, broadcast] {
            let (f, n) = request(1, to);
            assert_eq!(r.receive(&f[..n], &mut out), Answer::None, "{to:?}");
        }
        let (mut f, n) = request(1, GUEST);
        f[net::ETH_HEADER + 8] ^= 1; // the TTL: the IPv4 checksum no longer holds
        assert_eq!(r.receive(&f[..n], &mut out), Answer::None);
        let not_a_request = build_udp(HOST, GUEST, b"hello", &mut f).unwrap();
        assert_eq!(r.receive(&f[..not_a_request], &mut out), Answer::None);
        assert_eq!(r.receive(&f[..5], &mut out), Answer::None, "a runt");
        let c = r.counters();
        assert_eq!((c.ignored, c.frames_received, c.last_seq), (7, 7, 0));
        assert_eq!(c.duplicates, 0, "an ignored request is not counted");
    }

    #[test]
    fn an_answer_the_device_had_no_room_for_is_an_error_and_not_an_echo() {
        let mut r = guest();
        let (f, n) = request(1, GUEST);
        let mut out = [0u8; ANSWER_MAX];
        assert!(matches!(r.receive(&f[..n], &mut out), Answer::Echo(_)));
        r.not_sent();
        assert_eq!(
            exchange(&mut r, 2).echoes,
            1,
            "the lost echo is not counted"
        );
        let c = r.counters();
        assert_eq!((c.tx_errors, c.echoes_sent, c.last_seq), (1, 1, 2));
    }
}
