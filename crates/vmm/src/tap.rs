//! A tap device: a virtual Ethernet interface of the host whose frames this process reads
//! and writes through a descriptor of `/dev/net/tun`, one whole frame per `read` or `write`.
//!
//! Opened by name ([`Tap::open`], `TUNSETIFF`: an existing tap of that name, or a new one
//! that lives while the descriptor is open) or taken over from a descriptor another process
//! opened ([`Tap::from_fd`], checked with `TUNGETIFF`), as a local handover passes it. Either
//! way the descriptor is non-blocking, and the tap is in `IFF_NO_PI` mode without
//! `IFF_VNET_HDR`: a read returns an Ethernet frame and nothing else, so no offload the host
//! negotiated can reach a guest that did not ask for it.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

/// `TUNSETIFF` and `TUNGETIFF` (`_IOW('T', 202, int)`, `_IOR('T', 210, unsigned int)`).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// Bytes of an interface name, with its NUL (`IFNAMSIZ`).
const IFNAMSIZ: usize = 16;

/// `struct ifreq` as the tun driver reads it: the name, then the flags (the rest of the
/// union unused).
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Why a tap could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error(
        "tap name {name:?} is not 1 to 15 bytes of letters, digits, '-', '_' or '.'; give the name of a tap device"
    )]
    BadName { name: String },
    #[error(
        "cannot open /dev/net/tun: {0}; load the tun module (modprobe tun) and run as root or with CAP_NET_ADMIN"
    )]
    Tun(#[source] io::Error),
    #[error(
        "cannot attach to tap {name}: {source}; create it first (ip tuntap add dev {name} mode tap) or check it is a tap in this network namespace, not in use by another process"
    )]
    Attach {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "descriptor {fd} is not a tap device ({source}); pass a descriptor of /dev/net/tun attached to a tap"
    )]
    NotTap {
        fd: RawFd,
        #[source]
        source: io::Error,
    },
    #[error(
        "descriptor {fd} is a tun device (IP packets), not a tap (Ethernet frames); create the device with mode tap"
    )]
    TunNotTap { fd: RawFd },
    #[error("tap {name} gives virtio-net headers (IFF_VNET_HDR); open it without them")]
    VnetHeader { name: String },
}

/// An open tap device.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attaches to the tap named `name` (creating it if none exists, as the tun driver does;
    /// such a tap goes when its last descriptor closes).
    pub fn open(name: &str) -> Result<Tap, TapError> {
        let valid = (1..IFNAMSIZ).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !valid {
            return Err(TapError::BadName { name: name.into() });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::Tun)?;
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads (and may write back) a `struct ifreq`, which `IfReq` lays
        // out with its full 40 bytes; the descriptor is ours and open.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) };
        if rc < 0 {
            return Err(TapError::Attach {
                name: name.into(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(Tap {
            file,
            name: name.into(),
        })
    }

    /// Takes over `fd`, a descriptor of `/dev/net/tun` already attached to a tap (as another
    /// process passed it), and makes it non-blocking.
    pub fn from_fd(fd: OwnedFd) -> Result<Tap, TapError> {
        let raw = fd.as_raw_fd();
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes a `struct ifreq` (40 bytes, as `IfReq`) for a tun
        // descriptor and fails with EBADFD/ENOTTY for any other; `fd` is owned and open.
        if unsafe { libc::ioctl(raw, TUNGETIFF, &mut req) } < 0 {
            return Err(TapError::NotTap {
                fd: raw,
                source: io::Error::last_os_error(),
            });
        }
        let len = req.name.iter().position(|&b| b == 0).unwrap_or(IFNAMSIZ);
        let name = String::from_utf8_lossy(&req.name[..len]).into_owned();
        if req.flags & IFF_TAP == 0 {
            return Err(TapError::TunNotTap { fd: raw });
        }
        if req.flags & IFF_VNET_HDR != 0 {
            return Err(TapError::VnetHeader { name });
        }
        // SAFETY: F_GETFL/F_SETFL on a descriptor we own change only its status flags.
        unsafe {
            let flags = libc::fcntl(raw, libc::F_GETFL);
            if flags < 0 || libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(TapError::NotTap {
                    fd: raw,
                    source: io::Error::last_os_error(),
                });
            }
        }
        Ok(Tap {
            file: File::from(fd),
            name,
        })
    }

    /// Takes over descriptor `fd`, inherited from the process that started this one
    /// (`--net fd=N`), as [`Tap::from_fd`] does.
    pub fn inherited(fd: RawFd) -> Result<Tap, TapError> {
        // SAFETY: the user names a descriptor this process inherited for the NIC's use and
        // nothing else; an fd that is not open fails `fcntl` first and is never wrapped.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(TapError::NotTap {
                fd,
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: as above: open, and the NIC's alone from here on.
        Tap::from_fd(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The interface's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame into `buf`: `Ok(None)` when none is waiting. A frame longer than
    /// `buf` is cut to it (the caller gives room for the largest it passes and drops longer).
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match (&self.file).read(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sends one frame.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        let n = (&self.file).write(frame)?;
        match n == frame.len() {
            true => Ok(()),
            false => Err(io::Error::other(format!(
                "the tap took {n} of a frame's {} bytes",
                frame.len()
            ))),
        }
    }

    /// A second descriptor of the same tap (a local handover passes it).
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.file.as_fd().try_clone_to_owned()
    }
}

/// Waits up to `timeout` for any of `fds` to be ready; whether one is (an interrupted wait
/// counts as none).
pub fn poll(fds: &mut [libc::pollfd], timeout: std::time::Duration) -> bool {
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a live slice of pollfds of its length.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    n > 0
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_a_tap_cannot_have_are_refused_before_any_open() {
        for bad in ["", "a-name-that-is-too-long", "bad name", "x/y"] {
            assert!(
                matches!(Tap::open(bad), Err(TapError::BadName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_descriptor_that_is_not_a_tap_is_refused() {
        let file = File::open("/dev/null").unwrap();
        let err = Tap::from_fd(OwnedFd::from(file)).unwrap_err();
        assert!(matches!(err, TapError::NotTap { .. }), "{err}");
    }
}
