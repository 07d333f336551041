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

    /// A persistent tap `dev` in the namespace, up, with `addr` (CIDR) if given.
    pub fn tap(&self, dev: &str, addr: Option<&str>) {
        self.ip(&["tuntap", "add", "dev", dev, "mode", "tap"]);
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
        let name = std::ffi::CString::new(dev).expect("an interface name");
        // SAFETY: plain libc calls on a name we own and a socket we make; the descriptor is
        // wrapped at once.
        unsafe {
            let ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
            if ifindex == 0 {
                return Err(io::Error::last_os_error());
            }
            let proto = (libc::ETH_P_ALL as u16).to_be();
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
}
