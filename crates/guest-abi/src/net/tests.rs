//! The frame codecs' tests: round trips, known bytes, and every refusal.

use super::*;

const HOST: Endpoint = Endpoint {
    mac: Mac([0x02, 0, 0, 0, 0, 1]),
    ip: Ipv4([10, 0, 0, 1]),
    port: 40_000,
};
const GUEST: Endpoint = Endpoint {
    mac: Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]),
    ip: Ipv4([10, 0, 0, 2]),
    port: DEFAULT_PORT,
};

fn request_frame(seq: u64) -> ([u8; 128], usize) {
    let mut out = [0u8; 128];
    let payload = EchoRequest { seq }.to_bytes();
    let len = build_udp(HOST, GUEST, &payload, &mut out).unwrap();
    (out, len)
}

#[test]
fn the_ipv4_checksum_of_a_known_header() {
    // A header with its checksum field zeroed, and the checksum it has (b861).
    let mut h = [
        0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8, 0x00,
        0x01, 0xc0, 0xa8, 0x00, 0xc7,
    ];
    assert_eq!(checksum(&h), 0xb861);
    h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
    assert_eq!(
        checksum(&h),
        0,
        "a header with its checksum sums to all ones"
    );
    assert_eq!(
        checksum(&[0xff]),
        !0xff00,
        "an odd byte is the high half of a word"
    );
}

#[test]
fn a_request_round_trips_through_a_padded_frame() {
    let (frame, len) = request_frame(42);
    assert_eq!(len, MIN_FRAME, "54 bytes of frame padded to 60");
    assert_eq!(udp_frame_len(REQUEST_SIZE), 54);
    assert_eq!(&frame[12..14], &[0x08, 0x00]);
    assert_eq!(checksum(&frame[ETH_HEADER..ETH_HEADER + IPV4_HEADER]), 0);
    let udp = parse_udp(&frame[..len]).unwrap();
    assert_eq!((udp.src, udp.dst), (HOST, GUEST));
    assert_eq!(
        udp.payload.len(),
        REQUEST_SIZE,
        "the padding is not payload"
    );
    assert_eq!(parse_request(udp.payload), Some(EchoRequest { seq: 42 }));
    assert_eq!(&udp.payload[..4], b"FNRQ");
    assert_eq!(destination(&frame), Some(GUEST.mac));
}

#[test]
fn an_echo_round_trips_and_its_layout_is_fixed() {
    let echo = Echo {
        seq: 7,
        echoes: 5,
        received: 9,
    };
    let b = echo.to_bytes();
    assert_eq!(&b[..4], b"FNEC");
    assert_eq!(&b[4..12], &7u64.to_le_bytes());
    assert_eq!(&b[12..20], &5u64.to_le_bytes());
    assert_eq!(&b[20..28], &9u64.to_le_bytes());
    assert_eq!(parse_echo(&b), Some(echo));
    let mut out = [0u8; 128];
    let len = build_udp(GUEST, HOST, &b, &mut out).unwrap();
    assert_eq!(len, 70);
    let udp = parse_udp(&out[..len]).unwrap();
    assert_eq!(parse_echo(udp.payload), Some(echo));
    assert_eq!(parse_echo(&b[..27]), None);
    assert_eq!(parse_echo(&EchoRequest { seq: 7 }.to_bytes()), None);
    let mut wrong = b;
    wrong[0] = b'X';
    assert_eq!(parse_echo(&wrong), None);
}

#[test]
fn a_longer_request_is_a_request_and_a_short_or_foreign_one_is_not() {
    let mut long = [0u8; 100];
    long[..REQUEST_SIZE].copy_from_slice(&EchoRequest { seq: 3 }.to_bytes());
    assert_eq!(parse_request(&long), Some(EchoRequest { seq: 3 }));
    assert_eq!(parse_request(&long[..11]), None);
    assert_eq!(parse_request(&Echo::default().to_bytes()), None);
}

#[test]
fn a_zero_udp_checksum_is_none_and_a_wrong_one_is_refused() {
    let (mut frame, len) = request_frame(1);
    let sum_at = ETH_HEADER + IPV4_HEADER + 6;
    assert_ne!(
        &frame[sum_at..sum_at + 2],
        &[0, 0],
        "the builder fills it in"
    );
    frame[sum_at..sum_at + 2].copy_from_slice(&[0, 0]);
    assert!(parse_udp(&frame[..len]).is_ok());
    frame[sum_at + 1] = 1;
    assert_eq!(parse_udp(&frame[..len]), Err(FrameError::UdpChecksum));
}

#[test]
fn broken_frames_name_what_is_wrong() {
    let (good, len) = request_frame(1);
    let ip = ETH_HEADER;
    let with = |at: usize, byte: u8| {
        let mut f = good;
        f[at] = byte;
        f
    };
    // Each change that breaks the header also breaks its checksum, so the order of the
    // checks is what is under test: the first wrong thing is named.
    assert_eq!(
        parse_udp(&good[..ETH_HEADER + 10]),
        Err(FrameError::Short { len: 24 })
    );
    assert_eq!(parse_udp(&good[..10]), Err(FrameError::Short { len: 10 }));
    assert_eq!(
        parse_udp(&with(12, 0x86)),
        Err(FrameError::EtherType(0x8600))
    );
    assert_eq!(parse_udp(&with(ip, 0x65)), Err(FrameError::BadIpHeader));
    assert_eq!(parse_udp(&with(ip, 0x44)), Err(FrameError::BadIpHeader));
    assert_eq!(parse_udp(&with(ip + 8, 1)), Err(FrameError::IpChecksum));
    assert_eq!(
        parse_udp(&with(ip + 3, 200)[..len]),
        Err(FrameError::Short { len })
    );
    let reheader = |mut f: [u8; 128]| {
        f[ip + 10..ip + 12].copy_from_slice(&[0, 0]);
        let sum = checksum(&f[ip..ip + IPV4_HEADER]);
        f[ip + 10..ip + 12].copy_from_slice(&sum.to_be_bytes());
        f
    };
    assert_eq!(
        parse_udp(&reheader(with(ip + 6, 0x20))[..len]),
        Err(FrameError::Fragment)
    );
    assert_eq!(
        parse_udp(&reheader(with(ip + 9, 6))[..len]),
        Err(FrameError::Protocol(6))
    );
    let udp_len = ip + IPV4_HEADER + 5;
    assert_eq!(
        parse_udp(&with(udp_len, 21)[..len]),
        Err(FrameError::UdpLength)
    );
}

#[test]
fn a_header_with_options_is_skipped_over() {
    // The request again with four bytes of IPv4 options (NOPs), header length 6 words.
    let (good, len) = request_frame(9);
    let ip = ETH_HEADER;
    let mut f = [0u8; 128];
    f[..ip + IPV4_HEADER].copy_from_slice(&good[..ip + IPV4_HEADER]);
    f[ip + IPV4_HEADER..ip + 24].copy_from_slice(&[1, 1, 1, 1]);
    f[ip + 24..len + 4].copy_from_slice(&good[ip + IPV4_HEADER..len]);
    f[ip] = 0x46;
    f[ip + 3] += 4;
    f[ip + 10..ip + 12].copy_from_slice(&[0, 0]);
    let sum = checksum(&f[ip..ip + 24]);
    f[ip + 10..ip + 12].copy_from_slice(&sum.to_be_bytes());
    let udp = parse_udp(&f[..len + 4]).unwrap();
    assert_eq!(parse_request(udp.payload), Some(EchoRequest { seq: 9 }));
}

#[test]
fn an_arp_request_gets_the_reply_a_host_expects() {
    let ask = Arp {
        eth_dst: Mac::BROADCAST,
        eth_src: HOST.mac,
        ethertype: ETHERTYPE_ARP,
        op: ARP_REQUEST,
        sender_mac: HOST.mac,
        sender_ip: HOST.ip,
        target_mac: Mac::ZERO,
        target_ip: GUEST.ip,
    };
    let mut out = [0u8; 64];
    assert_eq!(build_arp(&ask, &mut out), Some(MIN_FRAME));
    let parsed = parse_arp(&out[..MIN_FRAME]).unwrap();
    assert_eq!(parsed, ask);
    assert!(parsed.asks_for(GUEST.ip));
    assert!(!parsed.asks_for(HOST.ip));
    let reply = parsed.reply(GUEST.mac, GUEST.ip);
    assert_eq!(reply.op, ARP_REPLY);
    assert_eq!((reply.eth_dst, reply.eth_src), (HOST.mac, GUEST.mac));
    assert_eq!((reply.sender_mac, reply.sender_ip), (GUEST.mac, GUEST.ip));
    assert_eq!((reply.target_mac, reply.target_ip), (HOST.mac, HOST.ip));
    assert!(!reply.asks_for(GUEST.ip));
    assert_eq!(build_arp(&reply, &mut [0u8; 59]), None);
    let mut not_ipv4 = out;
    not_ipv4[ETH_HEADER + 2] = 0x86;
    assert_eq!(parse_arp(&not_ipv4), Err(FrameError::NotEthernetIpv4));
    assert_eq!(parse_arp(&out[..40]), Err(FrameError::Short { len: 40 }));
    let (udp, _) = request_frame(1);
    assert_eq!(parse_arp(&udp), Err(FrameError::EtherType(ETHERTYPE_IPV4)));
}

#[test]
fn the_announce_is_qemus_frame_byte_for_byte() {
    let mac = Mac([0x52, 0x54, 0x00, 0xab, 0xcd, 0xef]);
    let mut out = [0xaau8; 64];
    assert_eq!(build_rarp_announce(mac, &mut out), Some(60));
    // qemu_announce_self's announce_self_create(), written out.
    let mut want = [0u8; 60];
    want[0..6].copy_from_slice(&[0xff; 6]);
    want[6..12].copy_from_slice(&mac.0);
    want[12..22].copy_from_slice(&[0x80, 0x35, 0, 1, 0x08, 0, 6, 4, 0, 3]);
    want[22..28].copy_from_slice(&mac.0);
    want[32..38].copy_from_slice(&mac.0);
    assert_eq!(out[..60], want);
    let arp = parse_arp(&out[..60]).unwrap();
    assert_eq!((arp.ethertype, arp.op), (ETHERTYPE_RARP, RARP_REQUEST));
    assert_eq!((arp.sender_mac, arp.target_mac), (mac, mac));
    assert!(
        !arp.asks_for(Ipv4::UNSPECIFIED),
        "an announce asks for nothing"
    );

    let ip = Ipv4([192, 168, 7, 9]);
    assert_eq!(build_gratuitous_arp(mac, ip, &mut out), Some(60));
    let arp = parse_arp(&out[..60]).unwrap();
    assert_eq!((arp.ethertype, arp.op), (ETHERTYPE_ARP, ARP_REQUEST));
    assert_eq!((arp.sender_ip, arp.target_ip), (ip, ip));
    assert_eq!((arp.eth_dst, arp.target_mac), (Mac::BROADCAST, Mac::ZERO));
}

#[test]
fn addresses_parse_and_print() {
    assert_eq!(Ipv4::parse("10.0.0.2"), Some(Ipv4([10, 0, 0, 2])));
    assert_eq!(Ipv4::parse("255.255.255.255"), Some(Ipv4([255; 4])));
    for bad in [
        "",
        "10.0.0",
        "10.0.0.2.1",
        "10.0.0.256",
        "10.0.0.-1",
        "10..0.2",
        "a.b.c.d",
        "0010.0.0.2",
        "10.0.0.2 ",
    ] {
        assert_eq!(Ipv4::parse(bad), None, "{bad}");
    }
    assert!(Ipv4([10, 0, 0, 2]).is_unicast());
    for not in [[0, 0, 0, 0], [224, 0, 0, 1], [255, 255, 255, 255]] {
        assert!(!Ipv4(not).is_unicast(), "{not:?}");
    }
    extern crate std;
    assert_eq!(std::format!("{}", GUEST.ip), "10.0.0.2");
    assert_eq!(std::format!("{}", GUEST.mac), "52:54:00:12:34:56");
}

#[test]
fn a_frame_too_big_for_the_buffer_is_not_built() {
    let mut small = [0u8; 60];
    assert_eq!(build_udp(HOST, GUEST, &[0; 30], &mut small), None);
    let mut big = [0u8; 2048];
    assert_eq!(
        build_udp(HOST, GUEST, &[7; 1472], &mut big),
        Some(1514),
        "the largest datagram in a 1500-byte MTU"
    );
    assert!(parse_udp(&big[..1514]).is_ok());
}
