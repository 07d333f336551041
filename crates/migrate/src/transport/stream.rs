//! The byte streams a migration runs over and the listeners a destination waits on, as the
//! engine speaks to them ([`Stream`], [`Listener`]), with TCP and Unix sockets as the two
//! built in. The floor of `transport`: TLS and the addresses stand on it.

#![forbid(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// A connection of a migration.
pub trait Stream: Read + Write + Send + std::fmt::Debug {
    /// A second handle to the same connection (one thread reads while another writes).
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>>;
    /// Shuts down one or both directions; a blocked read on any handle returns.
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    /// Bounds every later read (`None`: no bound).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Bounds every later write on any handle of the connection (`None`: no bound): a peer
    /// that stops reading cannot hold a writer forever.
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Who is on the other end, for logs and progress.
    fn peer(&self) -> String;
    /// Sends small writes at once (TCP: no Nagle delay); records are already written whole
    /// through a buffer, and a pass end or a Resumed must not wait for an acknowledgement.
    fn set_low_latency(&self) -> io::Result<()>;
    /// Marks the connection's packets urgent for the queues that look: `SO_PRIORITY` 6
    /// (`TC_PRIO_INTERACTIVE`, what a `prio` qdisc serves first) and DSCP EF (expedited
    /// forwarding, for routers that honour it). Postcopy's preempt connection.
    fn set_urgent(&self) -> io::Result<()>;
    /// Notices a peer that vanished without a word (no FIN, no reset: a cable pulled, a host
    /// gone) within about `within` even while nothing is written: TCP keepalive probes and
    /// `TCP_USER_TIMEOUT`. `None`, or a connection that is not TCP: nothing to do.
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        let _ = within;
        Ok(())
    }
    /// Whether the peer closed the connection (or it broke), judged without blocking and
    /// without consuming anything: for a side that waits elsewhere while it is not reading.
    fn hung_up(&self) -> bool {
        false
    }
    /// Whether [`Stream::send_with_fds`] and [`Stream::recv_with_fds`] work here.
    fn carries_fds(&self) -> bool {
        false
    }
    /// Sends some of `bytes` (returns how many) with `fds` attached (`SCM_RIGHTS`), at most
    /// [`crate::wire::MAX_LOCAL_FDS`]: a Unix socket can, and no other stream.
    fn send_with_fds(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
        let _ = (bytes, fds);
        Err(no_descriptors())
    }
    /// Receives into `buf` (returns how many bytes) and adds the descriptors that came with
    /// those bytes to `fds`, unbuffered.
    fn recv_with_fds(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
        let _ = (buf, fds);
        Err(no_descriptors())
    }
    /// Who is on the other end, as the kernel says (`SO_PEERCRED`): what a local handover
    /// checks before a descriptor moves (`peer.rs`). Only a Unix socket knows.
    fn peer_credentials(&self) -> io::Result<PeerCred> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "only a Unix socket knows its peer's credentials",
        ))
    }
}

/// A peer's credentials as the kernel recorded them (`SO_PEERCRED`): its effective ids at its
/// `connect` or `listen`. Here, below the streams that report them; `peer.rs` judges them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// 0 when the peer is in a pid namespace this process cannot see into.
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// What a stream that cannot carry descriptors says.
fn no_descriptors() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "only a Unix socket carries file descriptors (--local needs a unix: address)",
    )
}

/// Descriptors one message may carry: a LocalRam record's.
const MAX_LOCAL_FDS: usize = crate::wire::MAX_LOCAL_FDS;

/// `sendmsg` with `fds` as `SCM_RIGHTS` on a Unix socket.
fn send_fds(socket: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_LOCAL_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} descriptors in one message; at most {MAX_LOCAL_FDS}",
                fds.len()
            ),
        ));
    }
    loop {
        match sendmsg(
            socket,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            sent => return Ok(sent?),
        }
    }
}

/// `recvmsg` on a Unix socket, the descriptors that came owned (close-on-exec).
fn recv_fds(socket: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, recvmsg};
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_LOCAL_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = recvmsg(
        socket,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received);
        }
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::other(format!(
            "the peer sent more than {MAX_LOCAL_FDS} descriptors with one message"
        )));
    }
    Ok(msg.bytes)
}

/// A socket's end of file or error, seen by peeking one byte without waiting.
fn socket_hung_up(fd: std::os::fd::RawFd) -> bool {
    use nix::sys::socket::{MsgFlags, recv};
    let mut byte = [0u8; 1];
    match recv(fd, &mut byte, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e != nix::errno::Errno::EAGAIN && e != nix::errno::Errno::EINTR,
    }
}

/// `SO_PRIORITY` of urgent traffic: `TC_PRIO_INTERACTIVE`, the highest an unprivileged socket
/// may set, which the default priomap of a `prio` qdisc puts in band 0.
pub(super) const URGENT_PRIORITY: i32 = 6;
/// DSCP EF (46) in the TOS byte: the per-hop behaviour for low-latency traffic (RFC 3246).
const URGENT_TOS: i32 = 46 << 2;

/// Where a destination waits for connections.
pub trait Listener: Send + Sync + std::fmt::Debug {
    /// The next connection, or `None` when none arrived within `wait`.
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>>;
    /// The address sources connect to, as a user would write it.
    fn local(&self) -> String;
}

impl Stream for TcpStream {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
    fn peer(&self) -> String {
        self.peer_addr()
            .map_or_else(|_| "tcp:?".into(), |a| format!("tcp:{a}"))
    }
    fn set_low_latency(&self) -> io::Result<()> {
        self.set_nodelay(true)
    }
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        let Some(within) = within else {
            return Ok(());
        };
        // Idle for a third of the bound, then a probe every sixth, four unanswered ending it;
        // unacknowledged data ends it after the whole bound.
        let secs = within.as_secs().max(3);
        let idle = u32::try_from(secs / 3).unwrap_or(u32::MAX).max(1);
        let interval = u32::try_from(secs / 6).unwrap_or(u32::MAX).max(1);
        setsockopt(self, sockopt::KeepAlive, &true)?;
        setsockopt(self, sockopt::TcpKeepIdle, &idle)?;
        setsockopt(self, sockopt::TcpKeepInterval, &interval)?;
        setsockopt(self, sockopt::TcpKeepCount, &4)?;
        let ms = u32::try_from(within.as_millis()).unwrap_or(u32::MAX);
        setsockopt(self, sockopt::TcpUserTimeout, &ms)?;
        Ok(())
    }
    fn set_urgent(&self) -> io::Result<()> {
        use nix::sys::socket::{setsockopt, sockopt};
        // The TOS first: setting it also sets the priority from its bits, which the explicit
        // priority then overrides.
        match self.local_addr()? {
            std::net::SocketAddr::V4(_) => setsockopt(self, sockopt::Ipv4Tos, &URGENT_TOS)?,
            std::net::SocketAddr::V6(_) => setsockopt(self, sockopt::Ipv6TClass, &URGENT_TOS)?,
        }
        setsockopt(self, sockopt::Priority, &URGENT_PRIORITY)?;
        Ok(())
    }
    fn hung_up(&self) -> bool {
        socket_hung_up(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

impl Stream for UnixStream {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
    fn peer(&self) -> String {
        "unix:(local peer)".into()
    }
    fn carries_fds(&self) -> bool {
        true
    }
    fn send_with_fds(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
        send_fds(self, bytes, fds)
    }
    fn recv_with_fds(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
        recv_fds(self, buf, fds)
    }
    fn peer_credentials(&self) -> io::Result<PeerCred> {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        let c = getsockopt(self, PeerCredentials)?;
        Ok(PeerCred {
            pid: c.pid(),
            uid: c.uid(),
            gid: c.gid(),
        })
    }
    fn set_low_latency(&self) -> io::Result<()> {
        Ok(()) // a Unix socket delivers every write at once
    }
    fn set_urgent(&self) -> io::Result<()> {
        Ok(()) // no queue to jump
    }
    fn hung_up(&self) -> bool {
        socket_hung_up(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

impl Stream for Box<dyn Stream> {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        (**self).try_clone_stream()
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        (**self).shutdown(how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_read_timeout(timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_write_timeout(timeout)
    }
    fn peer(&self) -> String {
        (**self).peer()
    }
    fn set_low_latency(&self) -> io::Result<()> {
        (**self).set_low_latency()
    }
    fn set_urgent(&self) -> io::Result<()> {
        (**self).set_urgent()
    }
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        (**self).set_keepalive(within)
    }
    fn hung_up(&self) -> bool {
        (**self).hung_up()
    }
    fn carries_fds(&self) -> bool {
        (**self).carries_fds()
    }
    fn send_with_fds(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
        (**self).send_with_fds(bytes, fds)
    }
    fn recv_with_fds(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
        (**self).recv_with_fds(buf, fds)
    }
    fn peer_credentials(&self) -> io::Result<PeerCred> {
        (**self).peer_credentials()
    }
}

/// How often a listener looks for a new connection while it waits: a connection waits at most
/// this long to be taken, and an idle destination wakes 200 times a second (no measurable CPU).
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// Non-blocking accepts, polled until `wait` has passed.
fn accept_polling<S>(
    wait: Duration,
    mut accept: impl FnMut() -> io::Result<S>,
) -> io::Result<Option<S>> {
    let deadline = Instant::now() + wait;
    loop {
        match accept() {
            Ok(s) => return Ok(Some(s)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(ACCEPT_POLL.min(deadline - now));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// An accepted connection made blocking again (it inherits the polling listener's mode).
fn blocking<S: Stream + 'static>(
    got: Option<S>,
    set_nonblocking: fn(&S, bool) -> io::Result<()>,
) -> io::Result<Option<Box<dyn Stream>>> {
    got.map(|s| {
        set_nonblocking(&s, false)?;
        Ok(Box::new(s) as Box<dyn Stream>)
    })
    .transpose()
}

impl Listener for TcpListener {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        self.set_nonblocking(true)?;
        let got = accept_polling(wait, || self.accept().map(|(s, _)| s))?;
        blocking(got, TcpStream::set_nonblocking)
    }
    fn local(&self) -> String {
        self.local_addr()
            .map_or_else(|_| "tcp:?".into(), |a| format!("tcp:{a}"))
    }
}

impl Listener for UnixListener {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        self.set_nonblocking(true)?;
        let got = accept_polling(wait, || self.accept().map(|(s, _)| s))?;
        blocking(got, UnixStream::set_nonblocking)
    }
    fn local(&self) -> String {
        self.local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(|p| format!("unix:{}", p.display())))
            .unwrap_or_else(|| "unix:?".into())
    }
}

impl<L: Listener + ?Sized> Listener for Box<L> {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        (**self).accept_within(wait)
    }
    fn local(&self) -> String {
        (**self).local()
    }
}
