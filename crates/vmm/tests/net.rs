//! A VM with a NIC (virtio-net over a tap) on real KVM, in a network namespace the test makes
//! for itself: the NIC's MAC migrates, and the destination announces it on its own tap once
//! the guest runs there; and a guest answering a stream of numbered frames through a
//! migration loses none outside its pause and answers none twice.

mod common;

use std::net::TcpListener;
use std::os::fd::IntoRawFd;
use std::time::{Duration, Instant};

use common::{boot_config, config, forced_request, migrate_into, receive_from};
use ferry_migrate::Phase;
use ferry_migrate_testkit::netns::{EchoStream, Netns, PacketSocket};
use ferry_vmm::devices::virtio::net::{NetOptions, TapSource};
use ferry_vmm::tap::Tap;
use ferry_vmm::vm::Announce;
use ferry_vmm::{Vm, VmConfig};

const MEMORY: u64 = 128 << 20;
const GUEST: &str = "ws=8M rate=20 verify-ms=200 log-ms=0";
/// RARP's ethertype, which the announce sends (as QEMU's self-announce).
const RARP: [u8; 2] = [0x80, 0x35];

/// The tap `dev` of `ns`, opened inside it, as the descriptor a VMM inherits.
fn tap_fd(ns: &Netns, dev: &str) -> NetOptions {
    let fd = ns.enter(|| Tap::open(dev).unwrap().try_clone_fd().unwrap());
    NetOptions {
        tap: TapSource::Fd(fd.into_raw_fd()),
        mac: None,
    }
}

fn with_net(net: NetOptions, serial: &std::path::Path) -> VmConfig {
    VmConfig {
        net: Some(net),
        ..config(MEMORY, GUEST, serial)
    }
}

/// The first `n` announce frames `sock` sees within `within`, each with when this thread read
/// it and when the kernel received it (the latter for the gaps between rounds, which a thread
/// put aside late would shorten).
fn announces(sock: &PacketSocket, n: usize, within: Duration) -> Vec<(Instant, Duration, [u8; 6])> {
    let end = Instant::now() + within;
    let mut seen = Vec::new();
    while let Some(left) = end.checked_duration_since(Instant::now())
        && seen.len() < n
    {
        let Some(f) = sock.recv(left).unwrap() else {
            break;
        };
        if f.get(12..14) == Some(&RARP[..]) {
            let stamp = sock.last_stamp().unwrap();
            seen.push((Instant::now(), stamp, f[6..12].try_into().unwrap()));
        }
    }
    seen
}

#[test]
fn the_nic_keeps_its_mac_across_a_migration_and_the_destination_announces_it() {
    let ns = Netns::new();
    ns.tap("fsrc", None);
    ns.tap("fdst", None);
    let dir = tempfile::tempdir().unwrap();
    let src = boot_config(with_net(
        tap_fd(&ns, "fsrc"),
        &dir.path().join("source.log"),
    ));
    let status = src.handle().status();
    let net = status.net.expect("the VM has a NIC");
    assert_eq!(net.tap.as_deref(), Some("fsrc"));
    let mac = net.mac.clone();

    let sock = ns.enter(|| PacketSocket::bind("fdst").unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(with_net(
        tap_fd(&ns, "fdst"),
        &dir.path().join("destination.log"),
    ))
    .unwrap();
    let rounds = Announce::default().rounds as usize;
    let (received, progress) = std::thread::scope(|s| {
        let seen = s.spawn(|| announces(&sock, rounds, Duration::from_secs(30)));
        let r = receive_from(
            &src.handle(),
            &mut incoming,
            &listener,
            forced_request(&listener),
        );
        let resumed = Instant::now();
        (r, (seen.join().unwrap(), resumed))
    });
    let ((received, progress), (seen, resumed)) = (received, progress);
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let dst = incoming.into_running().expect("resumed");
    let after = dst
        .handle()
        .status()
        .net
        .expect("the destination has a NIC");
    assert_eq!(after.mac, mac, "the guest's MAC moved with it");
    assert_eq!(
        after.tap.as_deref(),
        Some("fdst"),
        "on the destination's own tap"
    );

    let macs: Vec<String> = seen
        .iter()
        .map(|(_, _, m)| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        })
        .collect();
    assert_eq!(macs, vec![mac.clone(); rounds], "{rounds} rounds for {mac}");
    let first = seen[0].0;
    assert!(
        first <= resumed + Duration::from_millis(50),
        "the first round goes at the resume"
    );
    let gaps: Vec<u128> = seen
        .windows(2)
        .map(|w| w[1].1.saturating_sub(w[0].1).as_millis())
        .collect();
    eprintln!("announce: rounds {gaps:?} ms apart");
    for (k, gap) in gaps.iter().enumerate() {
        let want = Announce::default().wait_before(k as u32 + 1).as_millis();
        assert!(
            *gap + 5 >= want,
            "round {} came {gap} ms after the one before, before its {want} ms",
            k + 1
        );
    }
    assert_eq!(after.stats.announces, rounds as u64);
}

/// A bridge `br0` in `ns` with the host's address, and taps `taps` on it.
fn segment(ns: &Netns, taps: &[&str]) {
    ns.ip(&["link", "add", "br0", "type", "bridge"]);
    ns.up("br0", Some("10.99.0.1/24"));
    for t in taps {
        ns.tap(t, None);
        ns.ip(&["link", "set", t, "master", "br0"]);
    }
}

const GUEST_IP: &str = "10.99.0.2";
/// Frames a second the host sends: the stream.
const RATE: u32 = 10_000;

/// Waits until the guest says it has sent `n` echoes.
fn wait_echoes(vm: &ferry_vmm::VmHandle, n: u64, what: &str) {
    common::wait_for_telemetry(vm, what, Duration::from_secs(30), |g| {
        g.net.as_ref().is_some_and(|c| c.echoes_sent >= n)
    });
}

#[test]
fn a_guest_answering_a_frame_stream_loses_none_outside_its_pause_and_answers_none_twice() {
    let ns = Netns::new();
    segment(&ns, &["fsrc", "fdst"]);
    let dir = tempfile::tempdir().unwrap();
    let guest = format!("{GUEST} net={GUEST_IP}");
    let with = |net, log: &str| VmConfig {
        net: Some(net),
        ..config(MEMORY, &guest, &dir.path().join(log))
    };
    let src = boot_config(with(tap_fd(&ns, "fsrc"), "source.log"));
    let mac = src.handle().status().net.unwrap().mac;
    ns.neighbour(GUEST_IP, &mac, "br0");
    wait_echoes(&src.handle(), 0, "the guest's network workload");
    let stream = EchoStream::start(
        &ns,
        "10.99.0.1:0".parse().unwrap(),
        format!("{GUEST_IP}:7").parse().unwrap(),
        RATE,
    );
    wait_echoes(&src.handle(), 2000, "the guest answers on the source");
    let incoming = Vm::incoming(with(tap_fd(&ns, "fdst"), "destination.log")).unwrap();
    let before = Instant::now();
    let (dst, progress) = migrate_into(&src.handle(), incoming, |_| {});
    let after = Instant::now();
    let answered = src.handle().telemetry().net.map_or(0, |c| c.echoes_sent);
    wait_echoes(
        &dst.handle(),
        answered + 5000,
        "the guest answers on the destination",
    );
    let run = stream.stop();
    let downtime = progress.stats.as_ref().unwrap().downtime.total_ms;
    let lost = run.lost();
    let span = run.lost_span().unwrap_or_default();
    eprintln!(
        "echo: {} sent, {} echoes, {} lost (sent over {:.1} ms), {} duplicated; downtime {downtime:.1} ms",
        run.sent.len(),
        run.echoes.len(),
        lost.len(),
        span.as_secs_f64() * 1e3,
        run.duplicates()
    );
    assert_eq!(run.duplicates(), 0, "no frame answered twice");
    assert!(
        run.lost_between(run.start, before).len() + run.lost_between(after, Instant::now()).len()
            == 0,
        "no frame lost before the migration or after it ended: {} lost, the first {:?}",
        lost.len(),
        &lost[..lost.len().min(20)]
    );
    assert!(
        span.as_secs_f64() * 1e3 <= downtime + 20.0,
        "the frames lost were sent within the pause (and the announce's first round): {:.1} ms of them against {downtime:.1} ms of downtime",
        span.as_secs_f64() * 1e3
    );
    let g = dst
        .handle()
        .telemetry()
        .net
        .expect("the guest's Net report");
    assert_eq!(g.duplicates, 0, "the guest saw no number twice: {g:?}");
}
