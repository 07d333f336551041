//! The network `ferry bench net` makes for itself and what it watches there: one namespace with
//! a bridge carrying the host's address and two taps a VM attaches to ([`Segment`], deleted with
//! everything in it when dropped), the announce frames the bridge sees ([`Announces`]), and a
//! row's stream of numbered echo requests around its moves ([`streamed`]). Nothing leaves the
//! namespace: the stream, the taps, the migrations' loopback TCP are all its own.

use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_guest_abi::net::{ETHERTYPE_RARP, EchoRequest, parse_echo};
use ferry_migrate_testkit::netns::{EchoStream, Netns, PacketSocket, WallToInstant};

use ferry_migrate_testkit::netns::EchoRun;

use super::net_measure::{Figures, Marks, figures, no_move};

/// The bridge, with the host's address; the guest's address and echo port on it.
pub(super) const BRIDGE: &str = "br0";
pub(super) const HOST: &str = "10.99.0.1";
pub(super) const GUEST: &str = "10.99.0.2";
pub(super) const PORT: u16 = 7;
/// The two taps on the bridge a move goes between.
pub(super) const TAPS: [&str; 2] = ["fnet-a", "fnet-b"];
/// How long a row's stream runs before its first move, for the reference round trip: 10,000
/// echoes at the default rate.
pub(super) const WARM: Duration = Duration::from_secs(1);
/// How long after a resume the next move waits: the announce's five rounds (QEMU's and
/// ferry's defaults) end 800 ms after the first, so each move's are all seen before the next.
pub(super) const SETTLE: Duration = Duration::from_secs(1);

/// The bench's namespace with its bridge and taps.
pub(super) struct Segment {
    pub ns: Netns,
}

impl Segment {
    /// Makes the namespace, the bridge with the host's address, and the taps on it.
    pub fn new() -> anyhow::Result<Segment> {
        if !nix::unistd::geteuid().is_root() {
            bail!(
                "ferry bench net makes a network namespace with a bridge and taps, which needs root: run it as root (sudo)"
            );
        }
        if std::process::Command::new("ip").arg("-V").output().is_err() {
            bail!("ferry bench net sets up its network with `ip`: install iproute2");
        }
        // `Netns` panics naming the `ip` command that failed; the namespace made so far is
        // deleted as the panic unwinds.
        let ns = Netns::new();
        ns.ip(&["link", "add", BRIDGE, "type", "bridge"]);
        ns.up(BRIDGE, Some(&format!("{HOST}/24")));
        for tap in TAPS {
            ns.tap(tap, None);
            ns.ip(&["link", "set", tap, "master", BRIDGE]);
        }
        Ok(Segment { ns })
    }

    pub fn name(&self) -> &str {
        self.ns.name()
    }

    /// Waits until the guest at [`GUEST`] answers a probe (a request of its own socket, so
    /// not one of a stream's): what a row whose VMM tells nothing of its guest waits for.
    pub fn wait_answering(&self, within: Duration) -> anyhow::Result<()> {
        let socket = self
            .ns
            .enter(|| UdpSocket::bind(format!("{HOST}:0")))
            .context("a UDP socket in the bench's namespace")?;
        socket.set_read_timeout(Some(Duration::from_millis(100)))?;
        let to: SocketAddrV4 = format!("{GUEST}:{PORT}").parse()?;
        let end = Instant::now() + within;
        let mut buf = [0u8; 2048];
        while Instant::now() < end {
            let _ = socket.send_to(&EchoRequest { seq: 1 }.to_bytes(), to);
            if let Ok(n) = socket.recv(&mut buf)
                && parse_echo(&buf[..n]).is_some()
            {
                return Ok(());
            }
        }
        bail!("the guest at {GUEST} did not answer an echo request within {within:?}")
    }
}

/// Announce frames seen: when, and the MAC each announces.
type Seen = Arc<Mutex<Vec<(Instant, [u8; 6])>>>;

/// The announce frames (RARP) the bridge sees, each with when it came (the kernel's stamp, not
/// when the watching thread got to it: a late stamp would end a move's pause window late) and
/// the MAC it announces,
/// collected on a thread of their own until dropped.
pub(super) struct Announces {
    stop: Arc<AtomicBool>,
    seen: Seen,
    thread: Option<JoinHandle<()>>,
}

impl Announces {
    pub fn watch(segment: &Segment) -> anyhow::Result<Announces> {
        let socket = segment
            .ns
            .enter(|| PacketSocket::bind_ethertype(BRIDGE, ETHERTYPE_RARP))
            .context("a packet socket on the bench's bridge")?;
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Seen = Arc::default();
        let thread = {
            let (stop, seen) = (stop.clone(), seen.clone());
            // Asking for a stamp once turns the kernel's stamping on for every later frame.
            let _ = socket.last_stamp();
            std::thread::spawn(move || {
                let clocks = WallToInstant::now();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(f)) = socket.recv(Duration::from_millis(100))
                        && let Some(mac) = f.get(6..12)
                    {
                        let mac = mac.try_into().expect("six bytes");
                        let at = socket
                            .last_stamp()
                            .map_or_else(|_| Instant::now(), |s| clocks.instant(s));
                        seen.lock().unwrap().push((at, mac));
                    }
                }
            })
        };
        Ok(Announces {
            stop,
            seen,
            thread: Some(thread),
        })
    }

    /// The first announce of `mac` at or after `t`.
    pub fn first_after(&self, mac: [u8; 6], t: Instant) -> Option<Instant> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(at, m)| *m == mac && *at >= t)
            .map(|(at, _)| *at)
            .min()
    }
}

impl Drop for Announces {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `aa:bb:cc:dd:ee:ff` as bytes.
pub(super) fn parse_mac(s: &str) -> anyhow::Result<[u8; 6]> {
    let bytes: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("{s:?} is not a MAC"))?;
    bytes
        .try_into()
        .map_err(|_| anyhow::anyhow!("{s:?} is not a MAC"))
}

/// What one row's stream saw.
pub(super) struct RowRun {
    pub figures: Vec<Figures>,
    /// The echoes' round trip before the first move (median, ms), and frames lost then.
    pub rtt_ms: f64,
    pub lost_before: u64,
    pub sent: usize,
    pub echoes: usize,
}

/// Runs a stream of `rate` requests a second to the guest (which answers already) while
/// `moves` makes the row's moves and returns their marks, then stops it and takes each move's
/// figures, after showing `seen` the run, the marks and the stream's stop (`--trace`). The
/// stream stops whether or not the moves succeeded.
pub(super) fn streamed(
    segment: &Segment,
    rate: u32,
    seen: impl FnOnce(&EchoRun, &[Marks], Instant),
    moves: impl FnOnce() -> anyhow::Result<Vec<Marks>>,
) -> anyhow::Result<RowRun> {
    let stream = EchoStream::start(
        &segment.ns,
        format!("{HOST}:0").parse()?,
        format!("{GUEST}:{PORT}").parse()?,
        rate,
    );
    let marks = moves();
    let end = Instant::now();
    let run = stream.stop();
    let marks = marks?;
    let first = marks.first().map_or(end, |m| m.begun);
    let (rtt_ms, lost_before) = no_move(&run, first);
    seen(&run, &marks, end);
    Ok(RowRun {
        figures: figures(&run, &marks, end),
        rtt_ms,
        lost_before,
        sent: run.sent.len(),
        echoes: run.echoes.len(),
    })
}

/// Sleeps until `t` (at once if it passed).
pub(super) fn sleep_until(t: Instant) {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
}
