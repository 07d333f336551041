//! The network workload's wire: the frames the built-in guest answers (`net=`) and the echo
//! protocol a host-side sender speaks with it, as pure builders and parsers over byte slices.
//! The guest answers with this code and a test or bench on the host sends and counts with it,
//! so the two can never disagree on a byte.
//!
//! Frames are Ethernet II without a VLAN tag or FCS (what a tap passes), carrying:
//! - IPv4 + UDP: the echo. The IPv4 header checksum is always computed and checked; the UDP
//!   checksum is computed when building (it costs nothing at these sizes) and checked on
//!   receipt unless it is 0 (IPv4's "none", RFC 768). Fragments and IP options are refused
//!   (options are skipped, a fragment is not an echo).
//! - ARP for IPv4 (RFC 826): a request for the guest's address gets a reply.
//! - RARP (ethertype 0x8035, opcode 3): the announce a VMM sends for the guest's MAC after a
//!   migration, byte for byte as QEMU's self-announce sends it, so that a switch learns where
//!   the VM now is; [`build_gratuitous_arp`] is the ARP alternative for a sender that knows
//!   the guest's IPv4 address.
//!
//! The echo: the host sends a UDP datagram to the guest's address and port whose payload is an
//! [`EchoRequest`] (`"FNRQ"`, its sequence number from 1); the guest answers every request,
//! from that port to the sender's, with an [`Echo`] (`"FNEC"`, the same sequence number, the
//! guest's count of echoes sent including this one, and of frames received so far). All
//! little-endian. A request may be longer than [`REQUEST_SIZE`] (a sender padding its frames
//! to a size it measures with); the rest is ignored and the echo stays [`ECHO_SIZE`] bytes.

use core::fmt;

/// EtherTypes (IEEE 802 numbers).
pub const ETHERTYPE_IPV4: u16 = 0x0800;
pub const ETHERTYPE_ARP: u16 = 0x0806;
pub const ETHERTYPE_RARP: u16 = 0x8035;
/// Bytes of an Ethernet II header: destination, source, EtherType.
pub const ETH_HEADER: usize = 14;
/// Bytes of an IPv4 header without options, and of a UDP header.
pub const IPV4_HEADER: usize = 20;
pub const UDP_HEADER: usize = 8;
/// Bytes of an ARP (or RARP) packet for Ethernet and IPv4.
pub const ARP_SIZE: usize = 28;
/// The shortest Ethernet frame without its FCS: shorter ones are padded with zeros to it,
/// as a NIC pads them (IEEE 802.3's 64 bytes less the 4 of the FCS).
pub const MIN_FRAME: usize = 60;
/// The IPv4 protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;
/// The TTL the guest's datagrams leave with (Linux's default).
pub const TTL: u8 = 64;
/// ARP opcodes: request, reply (RFC 826), reverse request (RFC 903, what an announce uses).
pub const ARP_REQUEST: u16 = 1;
pub const ARP_REPLY: u16 = 2;
pub const RARP_REQUEST: u16 = 3;
/// ARP's hardware type for Ethernet.
const ARP_HTYPE_ETHERNET: u16 = 1;
/// The UDP port the guest answers when `net-port=` is not given: echo's (RFC 862).
pub const DEFAULT_PORT: u16 = 7;

/// `"FNRQ"` little-endian: the first word of an echo request.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"FNRQ");
/// `"FNEC"` little-endian: the first word of the guest's echo.
pub const ECHO_MAGIC: u32 = u32::from_le_bytes(*b"FNEC");
/// Bytes of a request's payload: magic `u32`, seq `u64`.
pub const REQUEST_SIZE: usize = 12;
/// Bytes of an echo's payload: magic `u32`, seq, echoes, received (`u64` each).
pub const ECHO_SIZE: usize = 28;

/// A MAC address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    pub const BROADCAST: Mac = Mac([0xff; 6]);
    pub const ZERO: Mac = Mac([0; 6]);
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// An IPv4 address, in network byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ipv4(pub [u8; 4]);

impl Ipv4 {
    pub const UNSPECIFIED: Ipv4 = Ipv4([0; 4]);

    /// Parses dotted-quad `A.B.C.D`, each a decimal 0–255 without a sign.
    pub fn parse(s: &str) -> Option<Ipv4> {
        let mut out = [0u8; 4];
        let mut parts = s.split('.');
        for byte in &mut out {
            let part = parts.next()?;
            if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            *byte = part
                .bytes()
                .fold(0u16, |acc, b| acc * 10 + u16::from(b - b'0'))
                .try_into()
                .ok()?;
        }
        parts.next().is_none().then_some(Ipv4(out))
    }

    /// An address a host may have: not 0.0.0.0, multicast (224/4) or above (class E and the
    /// broadcast address).
    pub fn is_unicast(self) -> bool {
        self != Ipv4::UNSPECIFIED && self.0[0] < 224
    }
}

impl fmt::Display for Ipv4 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d] = self.0;
        write!(f, "{a}.{b}.{c}.{d}")
    }
}

/// One end of a UDP exchange: the MAC the frame carries, the IPv4 address and the port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub mac: Mac,
    pub ip: Ipv4,
    pub port: u16,
}

/// A UDP datagram in a frame, as [`parse_udp`] found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Udp<'a> {
    pub src: Endpoint,
    pub dst: Endpoint,
    pub payload: &'a [u8],
}

/// An ARP or RARP packet for Ethernet and IPv4, in its Ethernet frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arp {
    /// The frame's destination and source, and its EtherType ([`ETHERTYPE_ARP`] or
    /// [`ETHERTYPE_RARP`]).
    pub eth_dst: Mac,
    pub eth_src: Mac,
    pub ethertype: u16,
    /// [`ARP_REQUEST`], [`ARP_REPLY`], [`RARP_REQUEST`] or another the parser passes on.
    pub op: u16,
    pub sender_mac: Mac,
    pub sender_ip: Ipv4,
    pub target_mac: Mac,
    pub target_ip: Ipv4,
}

/// Why bytes are not the frame a parser looks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Shorter than its headers or than the lengths it states.
    Short { len: usize },
    /// An EtherType the parser does not take.
    EtherType(u16),
    /// An IPv4 header whose version is not 4 or whose length is under 20 bytes.
    BadIpHeader,
    /// The IPv4 header checksum does not hold.
    IpChecksum,
    /// A fragment (more fragments, or an offset): the guest reassembles nothing.
    Fragment,
    /// An IPv4 protocol other than UDP.
    Protocol(u8),
    /// A UDP length that disagrees with the IPv4 packet's.
    UdpLength,
    /// The UDP checksum is neither 0 nor right.
    UdpChecksum,
    /// ARP for other than Ethernet and IPv4 (its hardware or protocol type or lengths).
    NotEthernetIpv4,
}

/// The internet checksum's running sum (RFC 1071) over `bytes`, added to `sum`.
fn sum_words(mut sum: u32, bytes: &[u8]) -> u32 {
    let mut words = bytes.chunks_exact(2);
    for w in &mut words {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

/// Folds a running sum to the ones' complement of its 16-bit ones' complement sum.
fn finish(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The internet checksum of `bytes` (RFC 1071); 0 over a header whose checksum field holds.
pub fn checksum(bytes: &[u8]) -> u16 {
    finish(sum_words(0, bytes))
}

/// The UDP checksum (RFC 768) of `udp` (header and payload, its checksum field included)
/// between `src` and `dst`: 0 when a filled-in checksum holds.
fn udp_checksum(src: Ipv4, dst: Ipv4, udp: &[u8]) -> u16 {
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&src.0);
    pseudo[4..8].copy_from_slice(&dst.0);
    pseudo[9] = IPPROTO_UDP;
    pseudo[10..12].copy_from_slice(&(udp.len() as u16).to_be_bytes());
    finish(sum_words(sum_words(0, &pseudo), udp))
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn mac_at(b: &[u8], at: usize) -> Mac {
    Mac(b[at..at + 6].try_into().unwrap())
}

fn ip_at(b: &[u8], at: usize) -> Ipv4 {
    Ipv4(b[at..at + 4].try_into().unwrap())
}

/// Writes the Ethernet header.
fn put_eth(out: &mut [u8], dst: Mac, src: Mac, ethertype: u16) {
    out[0..6].copy_from_slice(&dst.0);
    out[6..12].copy_from_slice(&src.0);
    out[12..14].copy_from_slice(&ethertype.to_be_bytes());
}

/// The EtherType of `frame`, if it has a whole Ethernet header.
pub fn ethertype(frame: &[u8]) -> Option<u16> {
    (frame.len() >= ETH_HEADER).then(|| be16(frame, 12))
}

/// The destination MAC of `frame`, if it has a whole Ethernet header.
pub fn destination(frame: &[u8]) -> Option<Mac> {
    (frame.len() >= ETH_HEADER).then(|| mac_at(frame, 0))
}

/// Bytes of the frame that carries `payload` in UDP over IPv4 (before padding to
/// [`MIN_FRAME`]).
pub const fn udp_frame_len(payload: usize) -> usize {
    ETH_HEADER + IPV4_HEADER + UDP_HEADER + payload
}

/// Builds an Ethernet + IPv4 + UDP frame from `src` to `dst` carrying `payload` into `out`,
/// padded to [`MIN_FRAME`]; returns its length, or `None` when `out` is too short or the
/// payload too long for one IPv4 packet.
pub fn build_udp(src: Endpoint, dst: Endpoint, payload: &[u8], out: &mut [u8]) -> Option<usize> {
    let ip_len = u16::try_from(IPV4_HEADER + UDP_HEADER + payload.len()).ok()?;
    let len = udp_frame_len(payload.len()).max(MIN_FRAME);
    let out = out.get_mut(..len)?;
    out.fill(0);
    put_eth(out, dst.mac, src.mac, ETHERTYPE_IPV4);
    let ip = &mut out[ETH_HEADER..];
    ip[0] = 0x45; // version 4, 5 words of header
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = TTL;
    ip[9] = IPPROTO_UDP;
    ip[12..16].copy_from_slice(&src.ip.0);
    ip[16..20].copy_from_slice(&dst.ip.0);
    let sum = checksum(&ip[..IPV4_HEADER]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let udp = &mut ip[IPV4_HEADER..usize::from(ip_len)];
    udp[0..2].copy_from_slice(&src.port.to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port.to_be_bytes());
    udp[4..6].copy_from_slice(&((UDP_HEADER + payload.len()) as u16).to_be_bytes());
    udp[UDP_HEADER..].copy_from_slice(payload);
    // A computed 0 is sent as all ones: 0 means "no checksum" (RFC 768).
    let sum = match udp_checksum(src.ip, dst.ip, udp) {
        0 => 0xffff,
        s => s,
    };
    udp[6..8].copy_from_slice(&sum.to_be_bytes());
    Some(len)
}

/// Parses an Ethernet + IPv4 + UDP frame, checking both checksums (the UDP one unless 0).
/// The IPv4 total length, not the frame's, bounds the datagram (a short frame is padded).
pub fn parse_udp(frame: &[u8]) -> Result<Udp<'_>, FrameError> {
    let short = FrameError::Short { len: frame.len() };
    match ethertype(frame) {
        None => return Err(short),
        Some(ETHERTYPE_IPV4) => {}
        Some(other) => return Err(FrameError::EtherType(other)),
    }
    let ip = &frame[ETH_HEADER..];
    if ip.len() < IPV4_HEADER {
        return Err(short);
    }
    let header = usize::from(ip[0] & 0xf) * 4;
    if ip[0] >> 4 != 4 || header < IPV4_HEADER {
        return Err(FrameError::BadIpHeader);
    }
    let total = usize::from(be16(ip, 2));
    if total < header + UDP_HEADER || total > ip.len() {
        return Err(short);
    }
    if checksum(&ip[..header]) != 0 {
        return Err(FrameError::IpChecksum);
    }
    if be16(ip, 6) & 0x3fff != 0 {
        return Err(FrameError::Fragment);
    }
    if ip[9] != IPPROTO_UDP {
        return Err(FrameError::Protocol(ip[9]));
    }
    let (src_ip, dst_ip) = (ip_at(ip, 12), ip_at(ip, 16));
    let udp = &ip[header..total];
    if usize::from(be16(udp, 4)) != udp.len() {
        return Err(FrameError::UdpLength);
    }
    if be16(udp, 6) != 0 && udp_checksum(src_ip, dst_ip, udp) != 0 {
        return Err(FrameError::UdpChecksum);
    }
    Ok(Udp {
        src: Endpoint {
            mac: mac_at(frame, 6),
            ip: src_ip,
            port: be16(udp, 0),
        },
        dst: Endpoint {
            mac: mac_at(frame, 0),
            ip: dst_ip,
            port: be16(udp, 2),
        },
        payload: &udp[UDP_HEADER..],
    })
}

/// Builds the frame of `arp` into `out`, padded to [`MIN_FRAME`]; returns its length, or
/// `None` when `out` is shorter than that.
pub fn build_arp(arp: &Arp, out: &mut [u8]) -> Option<usize> {
    let out = out.get_mut(..MIN_FRAME)?;
    out.fill(0);
    put_eth(out, arp.eth_dst, arp.eth_src, arp.ethertype);
    let a = &mut out[ETH_HEADER..];
    a[0..2].copy_from_slice(&ARP_HTYPE_ETHERNET.to_be_bytes());
    a[2..4].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    a[4] = 6;
    a[5] = 4;
    a[6..8].copy_from_slice(&arp.op.to_be_bytes());
    a[8..14].copy_from_slice(&arp.sender_mac.0);
    a[14..18].copy_from_slice(&arp.sender_ip.0);
    a[18..24].copy_from_slice(&arp.target_mac.0);
    a[24..28].copy_from_slice(&arp.target_ip.0);
    Some(MIN_FRAME)
}

/// Parses an ARP or RARP frame for Ethernet and IPv4.
pub fn parse_arp(frame: &[u8]) -> Result<Arp, FrameError> {
    let ethertype = ethertype(frame).ok_or(FrameError::Short { len: frame.len() })?;
    if ethertype != ETHERTYPE_ARP && ethertype != ETHERTYPE_RARP {
        return Err(FrameError::EtherType(ethertype));
    }
    let a = frame
        .get(ETH_HEADER..ETH_HEADER + ARP_SIZE)
        .ok_or(FrameError::Short { len: frame.len() })?;
    if be16(a, 0) != ARP_HTYPE_ETHERNET || be16(a, 2) != ETHERTYPE_IPV4 || a[4] != 6 || a[5] != 4 {
        return Err(FrameError::NotEthernetIpv4);
    }
    Ok(Arp {
        eth_dst: mac_at(frame, 0),
        eth_src: mac_at(frame, 6),
        ethertype,
        op: be16(a, 6),
        sender_mac: mac_at(a, 8),
        sender_ip: ip_at(a, 14),
        target_mac: mac_at(a, 18),
        target_ip: ip_at(a, 24),
    })
}

impl Arp {
    /// Whether this is an ARP request asking who has `ip`.
    pub fn asks_for(&self, ip: Ipv4) -> bool {
        self.ethertype == ETHERTYPE_ARP && self.op == ARP_REQUEST && self.target_ip == ip
    }

    /// The reply of the host at `mac`, `ip` to this request: sent to the asker only.
    pub fn reply(&self, mac: Mac, ip: Ipv4) -> Arp {
        Arp {
            eth_dst: self.sender_mac,
            eth_src: mac,
            ethertype: ETHERTYPE_ARP,
            op: ARP_REPLY,
            sender_mac: mac,
            sender_ip: ip,
            target_mac: self.sender_mac,
            target_ip: self.sender_ip,
        }
    }
}

/// The announce a VMM sends for a guest's `mac` after a migration, as QEMU's self-announce
/// does (`qemu_announce_self`'s frame): a broadcast RARP reverse request whose sender and
/// target hardware addresses are the MAC and whose protocol addresses are 0, padded to 60
/// bytes. It needs no IPv4 address, which a VMM does not know. Returns the frame's length.
pub fn build_rarp_announce(mac: Mac, out: &mut [u8]) -> Option<usize> {
    build_arp(
        &Arp {
            eth_dst: Mac::BROADCAST,
            eth_src: mac,
            ethertype: ETHERTYPE_RARP,
            op: RARP_REQUEST,
            sender_mac: mac,
            sender_ip: Ipv4::UNSPECIFIED,
            target_mac: mac,
            target_ip: Ipv4::UNSPECIFIED,
        },
        out,
    )
}

/// A gratuitous ARP for `mac` at `ip`: a broadcast request from `ip` for `ip` (RFC 5227's
/// announcement), what a sender that knows the guest's address may send instead of RARP.
pub fn build_gratuitous_arp(mac: Mac, ip: Ipv4, out: &mut [u8]) -> Option<usize> {
    build_arp(
        &Arp {
            eth_dst: Mac::BROADCAST,
            eth_src: mac,
            ethertype: ETHERTYPE_ARP,
            op: ARP_REQUEST,
            sender_mac: mac,
            sender_ip: ip,
            target_mac: Mac::ZERO,
            target_ip: ip,
        },
        out,
    )
}

/// A host's numbered request: the payload of the datagram it sends to the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EchoRequest {
    /// The host's number for it, from 1.
    pub seq: u64,
}

impl EchoRequest {
    pub fn to_bytes(&self) -> [u8; REQUEST_SIZE] {
        let mut b = [0u8; REQUEST_SIZE];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        b
    }
}

/// The request in a datagram's payload, if it is one (longer payloads are requests too).
pub fn parse_request(payload: &[u8]) -> Option<EchoRequest> {
    let b = payload.get(..REQUEST_SIZE)?;
    (u32::from_le_bytes(b[0..4].try_into().unwrap()) == REQUEST_MAGIC).then(|| EchoRequest {
        seq: u64::from_le_bytes(b[4..12].try_into().unwrap()),
    })
}

/// The guest's answer to one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Echo {
    /// The request's number, copied.
    pub seq: u64,
    /// Echoes the guest has sent, this one included.
    pub echoes: u64,
    /// Frames the guest has received, the request included (ARP and frames it ignored too).
    pub received: u64,
}

impl Echo {
    pub fn to_bytes(&self) -> [u8; ECHO_SIZE] {
        let mut b = [0u8; ECHO_SIZE];
        b[0..4].copy_from_slice(&ECHO_MAGIC.to_le_bytes());
        for (i, w) in [self.seq, self.echoes, self.received].iter().enumerate() {
            b[4 + 8 * i..12 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }
}

/// The echo in a datagram's payload, if it is exactly one.
pub fn parse_echo(payload: &[u8]) -> Option<Echo> {
    let b: &[u8; ECHO_SIZE] = payload.try_into().ok()?;
    let word = |i: usize| u64::from_le_bytes(b[4 + 8 * i..12 + 8 * i].try_into().unwrap());
    (u32::from_le_bytes(b[0..4].try_into().unwrap()) == ECHO_MAGIC).then(|| Echo {
        seq: word(0),
        echoes: word(1),
        received: word(2),
    })
}

#[cfg(test)]
mod tests;
