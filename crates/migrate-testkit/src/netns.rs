//! Network namespaces a test makes for itself, so that its taps, bridges and frames never
//! leave it: [`Netns`] (named, made with `ip netns add` and deleted on drop, with everything
//! in it), [`Netns::enter`] (runs a closure on a thread inside it: a tap opened or a socket
//! made there stays there, whichever thread uses it later), and [`PacketSocket`] (whole
//! Ethernet frames on one interface, in and out).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Frames a test's tap holds for its reader (the kernel's default is 1,000): a second of a
/// 10,000 frames/s stream, so that a host busy with a test's VMs and builds on two cores drops
/// none before the VMM reads them; what a test measures is the move, not the host's queue.
pub const TAP_QUEUE: u32 = 10_000;

/// A named network namespace, deleted (with its interfaces) when dropped.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Runs `ip` with `args`; panics naming the command and its error if it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    /// A fresh namespace with its loopback up. Panics, saying why, where namespaces cannot
    /// be made (not root).
    pub fn new() -> Netns {
        let name = format!(
            "ferry-t{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip -n NAME args`.
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// A persistent tap `dev` in the namespace, up, with `addr` (CIDR) if given, and a queue
    /// of [`TAP_QUEUE`] frames toward its reader.
    pub fn tap(&self, dev: &str, addr: Option<&str>) {
        self.ip(&["tuntap", "add", "dev", dev, "mode", "tap"]);
        self.ip(&["link", "set", dev, "txqueuelen", &TAP_QUEUE.to_string()]);
        self.up(dev, addr);
    }

    /// Brings `dev` up, with `addr` (CIDR) if given, and its IPv6 off (no router solicitation
    /// or neighbour discovery among a test's frames).
    pub fn up(&self, dev: &str, addr: Option<&str>) {
        let _ = Command::new("ip")
            .args(["netns", "exec", &self.name, "sysctl", "-qw"])
            .arg(format!("net.ipv6.conf.{dev}.disable_ipv6=1"))
            .status();
        if let Some(a) = addr {
            self.ip(&["addr", "add", a, "dev", dev]);
        }
        self.ip(&["link", "set", dev, "up"]);
    }

    /// A permanent neighbour entry: `ip` is at `mac` on `dev`, so that the first frames of a
    /// stream wait for no ARP (the kernel's queue of frames waiting for one can reorder them
    /// with the next ones).
    pub fn neighbour(&self, ip: &str, mac: &str, dev: &str) {
        self.ip(&[
            "neigh",
            "replace",
            ip,
            "lladdr",
            mac,
            "dev",
            dev,
            "nud",
            "permanent",
        ]);
    }

    /// Runs `f` on a thread of its own inside the namespace and returns what it returns.
    pub fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = std::fs::File::open(&path).expect("open the namespace");
                // SAFETY: setns on a descriptor of a network namespace changes only this
                // thread's namespace; the thread ends with the scope.
                let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns: {}", io::Error::last_os_error());
                f()
            })
            .join()
            .expect("the thread in the namespace panicked")
        })
    }
}

impl Default for Netns {
    fn default() -> Self {
        Netns::new()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Whole Ethernet frames on one interface (`AF_PACKET`, every protocol), made inside the
/// interface's namespace.
#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
    ifindex: i32,
}

impl PacketSocket {
    /// Binds to `dev`; call inside its namespace ([`Netns::enter`]).
    pub fn bind(dev: &str) -> io::Result<PacketSocket> {
        PacketSocket::bind_ethertype(dev, libc::ETH_P_ALL as u16)
    }

    /// Binds to `dev` for the frames of one EtherType only (the kernel drops the rest before
    /// they reach the socket: a watcher of announces beside a stream of 10,000 frames/s
    /// wakes only for announces); call inside its namespace.
    pub fn bind_ethertype(dev: &str, ethertype: u16) -> io::Result<PacketSocket> {
        let name = std::ffi::CString::new(dev).expect("an interface name");
        // SAFETY: plain libc calls on a name we own and a socket we make; the descriptor is
        // wrapped at once.
        unsafe {
            let ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
            if ifindex == 0 {
                return Err(io::Error::last_os_error());
            }
            let proto = ethertype.to_be();
            let raw = libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                proto.into(),
            );
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = OwnedFd::from_raw_fd(raw);
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = ifindex;
            let rc = libc::bind(
                raw,
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            );
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(PacketSocket { fd, ifindex })
        }
    }

    pub fn ifindex(&self) -> i32 {
        self.ifindex
    }

    /// Sends one frame out of the interface.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: sends from a slice we hold on a socket we own.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        match n < 0 {
            true => Err(io::Error::last_os_error()),
            false => Ok(()),
        }
    }

    /// The next frame that arrives within `timeout`, `None` if none did. Frames this socket
    /// sent itself are seen too (outgoing), so a test filters by what it expects.
    pub fn recv(&self, timeout: Duration) -> io::Result<Option<Vec<u8>>> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: polls one pollfd we hold.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready < 0 {
            return Err(io::Error::last_os_error());
        }
        if ready == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; 65536];
        // SAFETY: receives into a buffer we own, of its length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(n as usize);
        Ok(Some(buf))
    }

    /// When the kernel received the frame [`PacketSocket::recv`] returned last (its
    /// `CLOCK_REALTIME`, from `SIOCGSTAMPNS`): the gap between two frames as they arrived,
    /// whenever the test's thread got to read them.
    pub fn last_stamp(&self) -> io::Result<Duration> {
        socket_stamp(self.fd.as_raw_fd())
    }
}

/// When the kernel received the last datagram or frame read from socket `fd` (its
/// `CLOCK_REALTIME`, from `SIOCGSTAMPNS`; the first read asks the kernel to stamp, so it has
/// none).
fn socket_stamp(fd: std::os::fd::RawFd) -> io::Result<Duration> {
    /// `SIOCGSTAMPNS` on x86_64 (`asm-generic/sockios.h`'s old-time variant).
    const SIOCGSTAMPNS: libc::c_ulong = 0x8907;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: the ioctl writes one timespec into `ts`, which we own, for a socket the caller holds.
    let r = unsafe { libc::ioctl(fd, SIOCGSTAMPNS, &mut ts) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// A `CLOCK_REALTIME` stamp as an `Instant` (`CLOCK_MONOTONIC`), by the clocks' offset taken
/// when made.
#[derive(Clone, Copy, Debug)]
pub struct WallToInstant(Duration, std::time::Instant);

impl WallToInstant {
    pub fn now() -> WallToInstant {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        WallToInstant(wall, std::time::Instant::now())
    }

    pub fn instant(&self, stamp: Duration) -> std::time::Instant {
        match stamp >= self.0 {
            true => self.1 + (stamp - self.0),
            false => self.1 - (self.0 - stamp),
        }
    }
}

/// A stream of numbered echo requests (`ferry_guest_abi::net`) from a UDP socket made inside a
/// namespace to the built-in guest's network workload, and the echoes that come back, each
/// timed: what a test needs to say which frames a move lost or doubled, and when.
#[derive(Debug)]
pub struct EchoStream {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sender: std::thread::JoinHandle<(Vec<std::time::Instant>, Vec<std::time::Instant>)>,
    receiver: std::thread::JoinHandle<Vec<(u64, std::time::Instant)>>,
    start: std::time::Instant,
}

/// What an [`EchoStream`] saw: when each request went (request `seq` at index `seq - 1`), and
/// each echo's number and arrival, in arrival order.
#[derive(Debug)]
pub struct EchoRun {
    pub start: std::time::Instant,
    /// Just before each request's `send_to`, and just after it returned: the kernel passed
    /// the request to the bridge in between (a thread the host put aside after the call, at
    /// its return to user space, would otherwise stamp the request late by as long).
    pub sent: Vec<std::time::Instant>,
    pub sent_done: Vec<std::time::Instant>,
    /// Each echo and when the kernel received it (not when the reading thread got to it).
    pub echoes: Vec<(u64, std::time::Instant)>,
}

impl EchoStream {
    /// Sends `rate` requests a second from `from` (an address of the namespace's) to the
    /// guest at `to`, and collects the echoes, until [`EchoStream::stop`].
    pub fn start(
        ns: &Netns,
        from: std::net::SocketAddrV4,
        to: std::net::SocketAddrV4,
        rate: u32,
    ) -> EchoStream {
        use std::sync::atomic::AtomicBool;
        let socket = ns.enter(|| std::net::UdpSocket::bind(from).expect("bind the sender"));
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        deep_receive_buffer(&socket);
        let rx = socket.try_clone().unwrap();
        // Asking for a stamp once turns the kernel's stamping on for every later echo.
        let _ = socket_stamp(rx.as_raw_fd());
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let start = std::time::Instant::now();
        let receiver = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut echoes = Vec::new();
                let mut buf = [0u8; 2048];
                let mut quiet_since = None;
                let clocks = WallToInstant::now();
                loop {
                    match rx.recv(&mut buf) {
                        Ok(n) => {
                            quiet_since = None;
                            // When the kernel took the echo, not when this thread got to it.
                            let at = socket_stamp(rx.as_raw_fd())
                                .map_or_else(|_| std::time::Instant::now(), |s| clocks.instant(s));
                            if let Some(e) = ferry_guest_abi::net::parse_echo(&buf[..n]) {
                                echoes.push((e.seq, at));
                            }
                        }
                        Err(_) if stop.load(Ordering::Relaxed) => {
                            // Stragglers: 300 ms of quiet after the stop ends the wait.
                            let since = *quiet_since.get_or_insert_with(std::time::Instant::now);
                            if since.elapsed() > Duration::from_millis(300) {
                                return echoes;
                            }
                        }
                        Err(_) => {}
                    }
                }
            })
        };
        let sender = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut sent, mut sent_done) = (Vec::new(), Vec::new());
                let period = Duration::from_secs(1) / rate.max(1);
                while !stop.load(Ordering::Relaxed) {
                    let seq = sent.len() as u64 + 1;
                    let due = start + period * (seq as u32 - 1);
                    let now = std::time::Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    let req = ferry_guest_abi::net::EchoRequest { seq }.to_bytes();
                    sent.push(std::time::Instant::now());
                    // A refusal (no neighbour yet) is a request the guest never saw.
                    let _ = socket.send_to(&req, to);
                    sent_done.push(std::time::Instant::now());
                }
                (sent, sent_done)
            })
        };
        EchoStream {
            stop,
            sender,
            receiver,
            start,
        }
    }

    /// Echoes received so far are not visible until the stop; this says how long it runs.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Stops sending, waits for the last echoes, and returns what was seen.
    pub fn stop(self) -> EchoRun {
        self.stop.store(true, Ordering::Relaxed);
        let (sent, sent_done) = self.sender.join().expect("the sender");
        let echoes = self.receiver.join().expect("the receiver");
        EchoRun {
            start: self.start,
            sent,
            sent_done,
            echoes,
        }
    }
}

/// Bytes the echo socket may hold before the kernel drops an echo: 16 MiB, seconds of the
/// stream, so that a receiving thread a busy host put aside loses none (the default, about
/// 200 KiB, is a few hundred small datagrams: 30 ms at 10,000 frames/s).
const ECHO_RECEIVE_BUFFER: libc::c_int = 16 << 20;

/// Sets the socket's receive buffer to [`ECHO_RECEIVE_BUFFER`] (`SO_RCVBUFFORCE`, past the
/// host's `rmem_max`, as root; else as much as `SO_RCVBUF` gives).
fn deep_receive_buffer(socket: &std::net::UdpSocket) {
    let size = ECHO_RECEIVE_BUFFER;
    for option in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on a socket we own with a c_int of its size.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&size as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            return;
        }
    }
}

impl EchoRun {
    /// Requests that got no echo, in order.
    pub fn lost(&self) -> Vec<u64> {
        let mut got = vec![false; self.sent.len() + 1];
        for &(seq, _) in &self.echoes {
            if let Some(g) = got.get_mut(seq as usize) {
                *g = true;
            }
        }
        (1..=self.sent.len() as u64)
            .filter(|&s| !got[s as usize])
            .collect()
    }

    /// Echoes beyond the first for any request.
    pub fn duplicates(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.echoes
            .iter()
            .filter(|(seq, _)| !seen.insert(*seq))
            .count() as u64
    }

    /// Lost requests sent at or after `from` and before `to`.
    pub fn lost_between(&self, from: std::time::Instant, to: std::time::Instant) -> Vec<u64> {
        self.lost()
            .into_iter()
            .filter(|&s| {
                let t = self.sent[s as usize - 1];
                t >= from && t < to
            })
            .collect()
    }

    /// The span of send times from the first lost request to the last, if any was lost.
    pub fn lost_span(&self) -> Option<Duration> {
        let lost = self.lost();
        let (first, last) = (lost.first()?, lost.last()?);
        Some(self.sent[*last as usize - 1] - self.sent[*first as usize - 1])
    }

    /// The first echo that arrived at or after `t`.
    pub fn first_echo_after(&self, t: std::time::Instant) -> Option<std::time::Instant> {
        self.echoes.iter().map(|e| e.1).filter(|&e| e >= t).min()
    }
}
