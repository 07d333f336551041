//! The network device driven through the transport's registers by the test driver, over a
//! real tap in a network namespace of the test's own, with a packet socket on the tap's host
//! side: frames out, frames in, the gate, a driver out of buffers, and the state.

use std::time::Duration;

use ferry_migrate_testkit::netns::{Netns, PacketSocket};

use super::device::Receive;
use super::spec::OFFERED;
use super::*;
use crate::devices::virtio::device::VIRTIO_F_VERSION_1;
use crate::devices::virtio::testdriver::Driver;
use crate::devices::virtio::{Negotiated, VirtioDevice};
use crate::tap::Tap;

const ALL: u64 = VIRTIO_F_VERSION_1 | OFFERED;
const RX: usize = 0;
const TX: usize = 1;
const MAC: Mac = Mac([0x02, 0x46, 0x52, 0, 0, 1]);
/// An ethertype for local experiments (IEEE 802), so no stack on the host answers.
const TEST_TYPE: [u8; 2] = [0x88, 0xb5];

fn options(mac: Option<Mac>) -> NetOptions {
    NetOptions {
        tap: TapSource::Name("unused".into()),
        mac,
    }
}

fn frame(tag: u8, len: usize) -> Vec<u8> {
    let mut f = vec![tag; len];
    f[..6].copy_from_slice(&MAC.0);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
    f[12..14].copy_from_slice(&TEST_TYPE);
    f
}

/// The next test frame the packet socket sees, skipping anything else.
fn next_test_frame(s: &PacketSocket) -> Option<Vec<u8>> {
    loop {
        let f = s.recv(Duration::from_secs(2)).unwrap()?;
        if f.get(12..14) == Some(&TEST_TYPE[..]) {
            return Some(f);
        }
    }
}

/// A running device on tap `ft0` of a fresh namespace, and a packet socket on the tap.
fn setup(ns: &Netns) -> (Driver<Net>, PacketSocket) {
    ns.tap("ft0", None);
    // No queueing discipline: a frame the test sends is in the tap's queue when `send`
    // returns, not left for the kernel's transmit softirq, which a loaded host runs late (50
    // ms was once not enough for three frames).
    let tc = std::process::Command::new("tc")
        .args([
            "-n",
            ns.name(),
            "qdisc",
            "replace",
            "dev",
            "ft0",
            "root",
            "noqueue",
        ])
        .output()
        .expect("run tc (iproute2)");
    assert!(
        tc.status.success(),
        "tc: {}",
        String::from_utf8_lossy(&tc.stderr)
    );
    let (tap, sock) = ns.enter(|| {
        (
            Tap::open("ft0").unwrap(),
            PacketSocket::bind("ft0").unwrap(),
        )
    });
    let mut net = Net::deferred(&options(Some(MAC)));
    net.pass_tap(tap);
    net.attach().unwrap();
    net.set_open(true);
    let d = Driver::running(net, ALL);
    (d, sock)
}

/// Gives the driver's receive queue `n` buffers of 2 KiB; returns their addresses.
fn give_rx(d: &mut Driver<Net>, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| {
            let at = d.buffer(&[0xee; 2048]);
            d.add(RX, &[(at, 2048, true)]);
            at
        })
        .collect()
}

#[test]
fn a_frame_the_driver_sends_leaves_on_the_tap_whole() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    let f = frame(0x5a, 200);
    let mut buf = vec![0u8; HEADER];
    buf.extend_from_slice(&f);
    let at = d.buffer(&buf);
    // The header and the frame in two buffers, as a driver may give them.
    d.add(
        TX,
        &[(at, HEADER as u32, false), (at + HEADER as u64, 200, false)],
    );
    d.notify(TX);
    assert_eq!(d.used(TX).len(), 1, "the buffer comes back in the notify");
    assert_eq!(next_test_frame(&sock).unwrap(), f);
    assert_eq!(d.t.device().stats().tx_frames, 1);
}

#[test]
fn a_frame_from_the_tap_fills_one_buffer_after_a_zeroed_header() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    let bufs = give_rx(&mut d, 4);
    d.notify(RX);
    let f = frame(0x33, 100);
    sock.send(&f).unwrap();
    let mut got = Vec::new();
    for _ in 0..200 {
        d.t.receive();
        got = d.used(RX);
        if !got.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(got, vec![(0, (HEADER + 100) as u32)]);
    let mut b = vec![0u8; HEADER + 100];
    d.ram.read(bufs[0], &mut b).unwrap();
    assert_eq!(&b[..10], &[0; 10]);
    assert_eq!(u16::from_le_bytes([b[10], b[11]]), 1, "num_buffers");
    assert_eq!(&b[HEADER..], &f[..]);
}

#[test]
fn a_closed_gate_leaves_frames_in_the_tap_until_it_opens() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    give_rx(&mut d, 4);
    d.t.set_open(false);
    for tag in 1..=3 {
        sock.send(&frame(tag, 64)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    d.notify(RX);
    assert_eq!(d.t.receive(), Some(Receive::Closed));
    assert!(
        d.used(RX).is_empty(),
        "nothing reaches the guest while closed"
    );
    d.t.set_open(true);
    assert_eq!(d.t.receive(), Some(Receive::TapEmpty { used: true }));
    assert_eq!(d.used(RX).len(), 3, "all three, in order, none lost");
}

#[test]
fn the_gate_opening_starts_its_marks_again_and_the_first_turn_and_frame_set_them() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    give_rx(&mut d, 2);
    sock.send(&frame(1, 64)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(d.t.receive(), Some(Receive::TapEmpty { used: true }));
    let before = d.t.device().open_marks().clone();
    d.t.set_open(false);
    d.t.set_open(true);
    let m = d.t.device().open_marks().clone();
    assert!(m.opened_ns.is_some() && m.opened_ns >= before.first_rx_ns);
    assert_eq!(
        (m.first_turn_ns, m.first_rx_ns, m.first_tx_ns),
        (None, None, None)
    );
    sock.send(&frame(2, 64)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(d.t.receive().is_some_and(Receive::used));
    let m = d.t.device().open_marks().clone();
    assert!(m.first_turn_ns >= m.opened_ns && m.first_rx_ns >= m.first_turn_ns);
    assert!(
        m.first_rx_on.is_some(),
        "the thread that gave the frame is named"
    );
}

#[test]
fn frames_wait_in_the_tap_for_buffers_and_arrive_at_the_notify() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    give_rx(&mut d, 1);
    for tag in 1..=3 {
        sock.send(&frame(tag, 64)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(d.t.receive(), Some(Receive::NoBuffer { used: true }));
    assert_eq!(d.used(RX).len(), 1);
    let bufs = give_rx(&mut d, 4);
    d.notify(RX);
    assert_eq!(d.used(RX).len(), 2, "the rest at the driver's notify");
    let mut b = vec![0u8; HEADER + 64];
    d.ram.read(bufs[1], &mut b).unwrap();
    assert_eq!(
        b[HEADER + 20],
        3,
        "the third frame in the second new buffer"
    );
    assert_eq!(d.t.device().stats().rx_frames, 3);
}

#[test]
fn a_buffer_too_small_drops_the_frame_and_is_returned_empty() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    let at = d.buffer(&[0; 64]);
    d.add(RX, &[(at, 64, true)]);
    sock.send(&frame(9, 500)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    d.notify(RX);
    assert_eq!(d.used(RX), vec![(0, 0)]);
    assert_eq!(d.t.device().stats().rx_dropped, 1);
}

#[test]
fn config_holds_the_mac_link_up_and_mtu() {
    let ns = Netns::new();
    let (mut d, _sock) = setup(&ns);
    let mut c = [0u8; 12];
    for (i, b) in c.iter_mut().enumerate() {
        let mut one = [0u8; 1];
        d.t.device().read_config(i as u64, &mut one);
        *b = one[0];
    }
    assert_eq!(&c[..6], &MAC.0);
    assert_eq!(u16::from_le_bytes([c[6], c[7]]), 1);
    assert_eq!(u16::from_le_bytes([c[10], c[11]]), 1500);
    assert_eq!(d.config32(0) & 0xff, 0x02);
}

#[test]
fn state_round_trips_bit_exact_and_a_cut_one_is_refused() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    give_rx(&mut d, 2);
    sock.send(&frame(1, 80)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    d.notify(RX);
    let saved = d.t.device().save();
    let negotiated = Negotiated {
        features: ALL,
        ready_sizes: &[64, 64],
    };
    ns.tap("ft1", None);
    let t1 = ns.enter(|| Tap::open("ft1").unwrap());
    let mut fresh = Net::deferred(&options(None));
    fresh.pass_tap(t1);
    fresh.restore(&saved, &negotiated).unwrap();
    assert_eq!(fresh.save(), saved, "bit-exact");
    assert_eq!(fresh.mac(), MAC);
    assert!(NetState::decode(&saved[..saved.len() - 1]).is_err());
}

#[test]
fn frames_waiting_in_the_tap_at_the_save_reach_the_destinations_guest_first() {
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    d.t.set_open(false);
    for tag in 1..=3 {
        sock.send(&frame(tag, 64 + usize::from(tag))).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(d.t.take_waiting(), 3);
    let saved = d.t.device().save();
    assert_eq!(NetState::decode(&saved).unwrap().pending.len(), 3);
    // The destination: its own tap, which holds a frame of its own already.
    ns.tap("ft1", None);
    let (t1, sock1) = ns.enter(|| {
        (
            Tap::open("ft1").unwrap(),
            PacketSocket::bind("ft1").unwrap(),
        )
    });
    let mut fresh = Net::deferred(&options(None));
    fresh.pass_tap(t1);
    fresh.attach().unwrap();
    fresh.set_open(true);
    let mut dst = Driver::running(fresh, ALL);
    sock1.send(&frame(9, 64)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let negotiated = Negotiated {
        features: ALL,
        ready_sizes: &[64, 64],
    };
    dst.t.device_mut().restore(&saved, &negotiated).unwrap();
    let bufs = give_rx(&mut dst, 8);
    dst.notify(RX);
    let used = dst.used(RX);
    assert_eq!(used.len(), 4, "three carried, then the tap's own");
    let tags: Vec<u8> = bufs[..4]
        .iter()
        .map(|&at| {
            let mut b = [0u8; HEADER + 20];
            dst.ram.read(at, &mut b).unwrap();
            b[HEADER + 19]
        })
        .collect();
    assert_eq!(tags, vec![1, 2, 3, 9], "in order, the carried ones first");
    assert!(
        NetState::decode(&dst.t.device().save())
            .unwrap()
            .pending
            .is_empty(),
        "none carried twice"
    );
}

/// A backlog of full-size frames in the source's tap at the save: the device takes what fits
/// its bound, and the whole NIC section (transport and device) stays within what a destination
/// takes for one section. (The bound was 2 MiB: past about 690 full-size frames, the section
/// was one a destination refuses, at the switchover.)
#[test]
fn a_backlog_of_full_size_frames_at_the_save_fits_one_section() {
    use crate::devices::device::Device;
    let ns = Netns::new();
    let (mut d, sock) = setup(&ns);
    d.t.set_open(false);
    for k in 0..1024 {
        sock.send(&frame(k as u8, MAX_FRAME)).unwrap();
    }
    let taken = d.t.take_waiting();
    assert_eq!(
        taken,
        spec::MAX_PENDING_BYTES / MAX_FRAME,
        "as many as the bytes bound takes"
    );
    let section = Device::save(&d.t);
    assert!(
        section.len() as u64 <= ferry_migrate::wire::MAX_SECTION_BYTES,
        "{} bytes",
        section.len()
    );
    let pending = NetState::decode(&d.t.device().save()).unwrap().pending;
    assert_eq!(pending.len(), taken);
    assert!(pending.iter().all(|f| f.len() == MAX_FRAME));
}
