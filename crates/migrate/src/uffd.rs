//! userfaultfd for postcopy's destination: the guest runs before all of its RAM has arrived, a
//! touch of a page that is not there yet stops the touching thread (a vCPU inside `KVM_RUN`, or
//! a VMM thread) and queues a [`Fault`]; the fault path fetches the page from the source, places
//! it atomically with [`Uffd::copy`] (or [`Uffd::zeropage`]), and the kernel lets the thread go.
//!
//! Raw ioctls through `libc`, not the `userfaultfd` crate: that crate's `userfaultfd-sys` runs
//! bindgen (libclang) and a C compiler at build time, which a fresh build machine cannot be
//! assumed to have, and its `copy` reports EEXIST and partial copies as errors for the caller to
//! untangle, while this module's whole job is to turn them into [`CopyOutcome`]s. `libc` gives
//! the syscall number only, so the ABI (eight ioctls, six structs) is written out from
//! `linux/userfaultfd.h` in `abi.rs`, each struct with its size asserted.
//!
//! Invariants and behaviour the rest of postcopy relies on:
//!
//! - **Registration is the `unsafe` step.** [`Uffd::register`] promises that the range
//!   is memory Rust code reaches only through raw pointers (guest RAM). After that, placing a
//!   page is safe: the kernel accepts [`Uffd::copy`] and [`Uffd::zeropage`] only inside ranges
//!   registered with this fd (`ENOENT` elsewhere) and only into missing pages (`EEXIST`
//!   otherwise), so they cannot overwrite a byte anyone has seen.
//! - **A page is placed at most once.** A copy into a page that is already there changes
//!   nothing and answers [`CopyOutcome::AlreadyThere`]: the background stream and the fault
//!   path may race for a page, and the loser learns it without an error.
//! - **Each fault is delivered once.** A [`Fault`] read by [`Uffd::read_faults`] is not queued
//!   again; its thread sleeps until the page is placed with [`Wake::Now`] or [`Uffd::wake`]
//!   covers it. Whoever reads a fault owns getting that page placed.
//! - **Dropping the `Uffd` closes the fd**, which unregisters every range and wakes every
//!   waiting thread; a page still missing then reads as zeros (shmem fills the hole). Drop it
//!   only when every page has been placed or the VM is stopped for good.
//! - **Pages are 4 KiB** ([`PAGE_SIZE`]), the page of shmem (memfd) and anonymous memory,
//!   except for [`Uffd::copy_pages`]: on hugetlbfs the kernel places only whole huge pages
//!   (and has no zeropage), and registration, wake and unregister must cover whole huge pages.
//! - **Minor faults** ([`Uffd::register`] with [`Faults::MissingAndMinor`], shmem only): a page that is in the
//!   file but not mapped in the registered range faults too (`Fault::minor`), and
//!   [`Uffd::continue_range`] maps what the file holds. The file's bytes are written elsewhere
//!   (another mapping of it) before; continuing only maps them, so it places nothing a thread
//!   could see half-written, and never over a page already mapped (`EEXIST`, skipped as a
//!   copy's).
//! - **Balloon removals vs userfaultfd.** `MADV_DONTNEED`/`MADV_REMOVE` on a registered range
//!   makes its pages missing again, so the next touch faults as if the page had never arrived,
//!   and this module does not ask for `UFFD_FEATURE_EVENT_REMOVE`, which would tell it. Postcopy
//!   must keep the balloon from discarding pages while it runs.

use std::io;
use std::mem::{size_of, size_of_val};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::wire::PAGE_SIZE;

mod abi;
mod error;

use abi::*;
use error::MAX_STALLED_RETRIES;
pub use error::UffdError;

/// The unit of every range: a host page of shmem or anonymous memory (x86-64).
const PAGE: usize = PAGE_SIZE as usize;

/// Messages taken per `read`. Each waiting thread has one fault outstanding, so the queue is
/// at most one message per vCPU and VMM thread: 64 (2 KiB of stack) drains a large VM's vCPUs
/// in one call; `read_faults` reads again when a read came back full.
const MSGS_PER_READ: usize = 64;

/// What the kernel has beyond the protocol itself (`UFFD_FEATURE_THREAD_ID` is granted on every
/// `Uffd`: [`Uffd::new`] fails without it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// Missing-page faults can be registered on shmem (memfd, tmpfs): guest RAM here.
    pub missing_shmem: bool,
    /// Missing-page faults can be registered on hugetlbfs.
    pub missing_hugetlbfs: bool,
    /// Minor faults can be registered on shmem ([`Faults::MissingAndMinor`]).
    pub minor_shmem: bool,
    /// Every feature bit the kernel reported (`uffdio_api.features`), for diagnostics.
    pub available: u64,
}

/// Which faults a range registered with [`Uffd::register`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Faults {
    /// A touch of a page that is not in memory: what postcopy over copied pages and a lazy
    /// restore wait for.
    Missing,
    /// Those, and a touch of a page that is in the file but not mapped in the range (shmem,
    /// when [`Features::minor_shmem`]), which [`Uffd::continue_range`] maps: postcopy over
    /// memory the destination holds (`ram/alias.rs`).
    MissingAndMinor,
}

/// Which ioctls the kernel offers on a registered range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeIoctls {
    /// `UFFDIO_ZEROPAGE` (shmem and anonymous memory; not hugetlbfs).
    pub zeropage: bool,
    /// `UFFDIO_CONTINUE` (a range registered for minor faults).
    pub continue_: bool,
}

/// A thread touched a page that is not there yet, and waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The host address of the page (page aligned).
    pub addr: usize,
    /// Whether the touch was a write.
    pub write: bool,
    /// A minor fault: the page is in the file, not mapped here ([`Uffd::continue_range`]
    /// maps it); else it is missing from the file too.
    pub minor: bool,
    /// The faulting thread's id (`gettid`), e.g. to tell which vCPU waits.
    pub thread_id: u32,
}

/// Whether placing pages releases the threads waiting on them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// Wake the waiters on the range as soon as its pages are in.
    Now,
    /// Leave them asleep (`*_MODE_DONTWAKE`): the caller places more pages and then wakes a
    /// larger range with one [`Uffd::wake`], e.g. a run of pages for one fault.
    Later,
}

/// What placing a range of pages did. Never an error: a page that is already there was placed
/// by someone else (the other side of a race) or was never missing, and is left as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyOutcome {
    /// Every page was missing and now holds the data.
    Copied,
    /// Every page was already there; nothing changed.
    AlreadyThere,
    /// `copied` bytes of pages were placed; the others were already there and are unchanged.
    Partly { copied: usize },
}

/// An open, initialised userfaultfd (`O_CLOEXEC | O_NONBLOCK`). `Send + Sync`: its ioctls and
/// reads are safe to issue from several threads at once (the kernel does its own locking, and
/// each fault message goes to one reader).
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
    features: Features,
}

const _: () = {
    const fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<Uffd>()
};

/// Which page-filling ioctl a [`Uffd::fill`] issues.
#[derive(Clone, Copy)]
enum Fill<'a> {
    Copy(&'a [u8]),
    Zero,
    Continue,
}

impl<'a> Fill<'a> {
    /// The same fill from `offset` bytes into the range on.
    fn after(self, offset: usize) -> Fill<'a> {
        match self {
            Fill::Copy(src) => Fill::Copy(&src[offset..]),
            Fill::Zero => Fill::Zero,
            Fill::Continue => Fill::Continue,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Fill::Copy(_) => "UFFDIO_COPY",
            Fill::Zero => "UFFDIO_ZEROPAGE",
            Fill::Continue => "UFFDIO_CONTINUE",
        }
    }
}

impl Uffd {
    /// Opens a userfaultfd and negotiates the protocol with faulting thread ids.
    ///
    /// Tries the `userfaultfd(2)` syscall, then, if that is not permitted
    /// (`vm.unprivileged_userfaultfd=0` without `CAP_SYS_PTRACE`), `/dev/userfaultfd`, whose
    /// file permissions decide instead. `UFFD_FEATURE_THREAD_ID` is required;
    /// `MISSING_SHMEM` and `MISSING_HUGETLBFS` are read off the kernel's answer rather than
    /// asked for: the header documents them as probes with no effect once `UFFDIO_API`
    /// returns, and asking for one the kernel lacks would fail the whole call.
    pub fn new() -> Result<Uffd, UffdError> {
        let fd = open()?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_THREAD_ID,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes one `uffdio_api`, which `api` is (size asserted
        // above), and it lives across the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            return Err(UffdError::Api {
                source: io::Error::last_os_error(),
            });
        }
        let needed_ioctls = (1 << NR_REGISTER) | (1 << NR_UNREGISTER);
        if api.api != UFFD_API
            || api.features & UFFD_FEATURE_THREAD_ID == 0
            || api.ioctls & needed_ioctls != needed_ioctls
        {
            return Err(UffdError::ApiMismatch {
                api: api.api,
                features: api.features,
                ioctls: api.ioctls,
            });
        }
        let features = Features {
            missing_shmem: api.features & UFFD_FEATURE_MISSING_SHMEM != 0,
            missing_hugetlbfs: api.features & UFFD_FEATURE_MISSING_HUGETLBFS != 0,
            minor_shmem: api.features & UFFD_FEATURE_MINOR_SHMEM != 0,
            available: api.features,
        };
        Ok(Uffd { fd, features })
    }

    /// What the kernel offers beyond the protocol.
    pub fn features(&self) -> Features {
        self.features
    }

    /// Registers `len` bytes at `addr` for missing-page faults: from now on a touch of a page
    /// there that is not in memory queues a [`Fault`] and waits until the page is placed.
    ///
    /// Fails if the kernel cannot place pages in the range (`UFFDIO_COPY` and `UFFDIO_WAKE`);
    /// the answer says whether `UFFDIO_ZEROPAGE` works there too.
    ///
    /// With [`Faults::MissingAndMinor`] (shmem, when [`Features::minor_shmem`]), minor faults
    /// too: a page in the file but not mapped in the range faults as well, and
    /// [`Uffd::continue_range`] maps it (bytes then also appear when it maps what another
    /// mapping of the file wrote).
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be mapped, and for as long as it stays registered with this
    /// `Uffd` no Rust reference (`&`, `&mut`, a slice) to it may exist or be made: the memory
    /// is reached only through raw pointers, as guest RAM is. Once registered, its missing
    /// pages are filled by [`Uffd::copy`] and [`Uffd::zeropage`], which are safe to call, so
    /// bytes appear there without a write the compiler can see (freshly `calloc`ed heap
    /// memory, say, would change under a reference that assumes it zero).
    pub unsafe fn register(
        &self,
        addr: usize,
        len: usize,
        faults: Faults,
    ) -> Result<RangeIoctls, UffdError> {
        check_pages("UFFDIO_REGISTER", addr, len)?;
        let minor = faults == Faults::MissingAndMinor;
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: addr as u64,
                len: len as u64,
            },
            mode: UFFDIO_REGISTER_MODE_MISSING | if minor { UFFDIO_REGISTER_MODE_MINOR } else { 0 },
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one `uffdio_register`, which `reg` is, live
        // across the call. What registration means for the range is this function's contract.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } != 0 {
            return Err(UffdError::Register {
                addr,
                len,
                source: io::Error::last_os_error(),
            });
        }
        let needed = (1 << NR_COPY) | (1 << NR_WAKE) | if minor { 1 << NR_CONTINUE } else { 0 };
        if reg.ioctls & needed != needed {
            // Best effort: the error below is the one to report.
            let _ = self.unregister(addr, len);
            return Err(UffdError::RangeIoctls {
                addr,
                len,
                ioctls: reg.ioctls,
            });
        }
        Ok(RangeIoctls {
            zeropage: reg.ioctls & (1 << NR_ZEROPAGE) != 0,
            continue_: reg.ioctls & (1 << NR_CONTINUE) != 0,
        })
    }

    /// Ends the registration of `len` bytes at `addr`. Threads waiting on pages there are
    /// woken and fault again as if the range had never been registered (a missing shmem page
    /// then reads as zeros).
    pub fn unregister(&self, addr: usize, len: usize) -> Result<(), UffdError> {
        check_pages("UFFDIO_UNREGISTER", addr, len)?;
        self.range_ioctl(UFFDIO_UNREGISTER, addr, len)
            .map_err(|source| UffdError::Unregister { addr, len, source })
    }

    /// Places `src` (whole pages) at `dst` atomically: a thread touching the pages sees either
    /// the fault or all of a page's bytes, never a partial page. Pages already there are left
    /// unchanged ([`CopyOutcome`]). With [`Wake::Now`], every thread waiting on the range is
    /// released when this returns, including waiters on pages that were already there.
    pub fn copy(&self, dst: usize, src: &[u8], wake: Wake) -> Result<CopyOutcome, UffdError> {
        self.fill(dst, src.len(), PAGE, Fill::Copy(src), wake)
    }

    /// [`Uffd::copy`] into memory whose host pages are `page` bytes (hugetlbfs): the kernel
    /// places only whole host pages, so `dst` and `src.len()` must be multiples of `page`, and
    /// a page already there is skipped whole.
    pub fn copy_pages(
        &self,
        dst: usize,
        src: &[u8],
        page: usize,
        wake: Wake,
    ) -> Result<CopyOutcome, UffdError> {
        self.fill(dst, src.len(), page, Fill::Copy(src), wake)
    }

    /// Places zero pages at `dst`, like [`Uffd::copy`] of zeros without the zeros in memory
    /// (shmem and anonymous memory only: hugetlbfs has no `UFFDIO_ZEROPAGE`).
    pub fn zeropage(&self, dst: usize, len: usize, wake: Wake) -> Result<CopyOutcome, UffdError> {
        self.fill(dst, len, PAGE, Fill::Zero, wake)
    }

    /// Maps the file's pages at `dst` (a range registered for minor faults), like
    /// [`Uffd::copy`] without the bytes: they were written into the file through another
    /// mapping. A page already mapped is left as it is ([`CopyOutcome`]).
    pub fn continue_range(
        &self,
        dst: usize,
        len: usize,
        wake: Wake,
    ) -> Result<CopyOutcome, UffdError> {
        self.fill(dst, len, PAGE, Fill::Continue, wake)
    }

    /// Releases the threads waiting on pages in `len` bytes at `addr` (after [`Wake::Later`]).
    /// A woken thread whose page is still missing faults again.
    pub fn wake(&self, addr: usize, len: usize) -> Result<(), UffdError> {
        check_pages("UFFDIO_WAKE", addr, len)?;
        self.range_ioctl(UFFDIO_WAKE, addr, len)
            .map_err(|source| UffdError::Wake { addr, len, source })
    }

    /// Waits up to `timeout` for faults, then appends every fault that is ready to `out` and
    /// returns how many it appended (0: the timeout passed with none). A timeout too large to
    /// add to now (`Duration::MAX`) waits without a bound.
    ///
    /// Only page faults are reported. The kernel sends other events (fork, remap, remove,
    /// unmap) only to an fd that asked for them with `UFFD_FEATURE_EVENT_*`, which this one
    /// never does; if one arrives anyway it is logged and skipped, so that the page faults read
    /// with it are not lost. Several threads may call this at once: each fault goes to one.
    pub fn read_faults(&self, out: &mut Vec<Fault>, timeout: Duration) -> Result<usize, UffdError> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if !self.poll_until(deadline)? {
                return Ok(0);
            }
            let appended = self.read_ready(out)?;
            if appended > 0 {
                return Ok(appended);
            }
            // Readable, but another reader took the messages (or only other events came):
            // wait again for what is left of the timeout.
        }
    }

    /// Waits until the fd is readable (true) or `deadline`, if any, passes (false).
    fn poll_until(&self, deadline: Option<Instant>) -> Result<bool, UffdError> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            let ts = deadline.map(|d| {
                let left = d.saturating_duration_since(Instant::now());
                libc::timespec {
                    tv_sec: left.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
                    tv_nsec: left.subsec_nanos().into(),
                }
            });
            let ts_ptr = ts.as_ref().map_or(std::ptr::null(), std::ptr::from_ref);
            // SAFETY: one `pollfd` and a `timespec` (or null: no timeout), both live across
            // the call; no signal mask (null), so ppoll is poll with a nanosecond timeout.
            let n = unsafe { libc::ppoll(&mut pfd, 1, ts_ptr, std::ptr::null()) };
            match n {
                0 => return Ok(false),
                n if n > 0 => {
                    if pfd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                        return Err(UffdError::Poll {
                            source: io::Error::other(format!(
                                "poll reported revents {:#x} on the userfaultfd",
                                pfd.revents
                            )),
                        });
                    }
                    return Ok(true);
                }
                _ => {
                    let source = io::Error::last_os_error();
                    if source.kind() != io::ErrorKind::Interrupted {
                        return Err(UffdError::Poll { source });
                    }
                }
            }
        }
    }

    /// Reads every message that is ready without blocking and appends the page faults.
    fn read_ready(&self, out: &mut Vec<Fault>) -> Result<usize, UffdError> {
        let before = out.len();
        let mut msgs = [UffdMsg::ZERO; MSGS_PER_READ];
        loop {
            // SAFETY: the kernel writes at most `size_of_val(&msgs)` bytes into `msgs`, a live
            // array of plain integers (any bit pattern is valid), and nothing else.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    msgs.as_mut_ptr().cast(),
                    size_of_val(&msgs),
                )
            };
            if n < 0 {
                let source = io::Error::last_os_error();
                match source.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(UffdError::Read { source }),
                }
            }
            let bytes = n as usize;
            if !bytes.is_multiple_of(size_of::<UffdMsg>()) {
                return Err(UffdError::ShortRead { bytes });
            }
            let count = bytes / size_of::<UffdMsg>();
            for msg in &msgs[..count] {
                if msg.event != UFFD_EVENT_PAGEFAULT {
                    tracing::warn!(
                        event = msg.event,
                        "userfaultfd event not asked for, skipped"
                    );
                    continue;
                }
                out.push(Fault {
                    addr: (msg.pagefault_address & !(PAGE_SIZE - 1)) as usize,
                    write: msg.pagefault_flags & UFFD_PAGEFAULT_FLAG_WRITE != 0,
                    minor: msg.pagefault_flags & UFFD_PAGEFAULT_FLAG_MINOR != 0,
                    thread_id: msg.pagefault_ptid,
                });
            }
            if count < MSGS_PER_READ {
                break;
            }
        }
        Ok(out.len() - before)
    }

    /// UFFDIO_COPY or UFFDIO_ZEROPAGE over `len` bytes at `dst`, to the end of the range: a
    /// partial answer (the kernel stopped early, `EAGAIN`) is retried from where it stopped,
    /// and an `EEXIST` skips the one host page of `page` bytes that is already there (a retry
    /// starts exactly at it).
    fn fill(
        &self,
        dst: usize,
        len: usize,
        page: usize,
        fill: Fill<'_>,
        wake: Wake,
    ) -> Result<CopyOutcome, UffdError> {
        check_aligned(fill.name(), dst, len, page)?;
        let mut done = 0;
        let mut copied = 0;
        let mut stalled = 0;
        while done < len {
            let at = dst + done;
            match self.fill_once(at, len - done, fill.after(done), wake) {
                Ok(n) => {
                    done += n;
                    copied += n;
                    stalled = 0;
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => done += page,
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR))
                        && stalled < MAX_STALLED_RETRIES =>
                {
                    stalled += 1;
                    std::thread::yield_now();
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    return Err(UffdError::Stalled {
                        op: fill.name(),
                        addr: at,
                    });
                }
                Err(source) => {
                    return Err(UffdError::Fill {
                        op: fill.name(),
                        addr: at,
                        len: len - done,
                        source,
                    });
                }
            }
        }
        if copied < len && wake == Wake::Now {
            // The kernel woke only what it placed; a thread may still wait on a page placed
            // by someone who deferred the wake. Waking it is harmless: it finds its page.
            self.wake(dst, len)?;
        }
        Ok(match copied {
            0 => CopyOutcome::AlreadyThere,
            c if c == len => CopyOutcome::Copied,
            c => CopyOutcome::Partly { copied: c },
        })
    }

    /// One UFFDIO_COPY or UFFDIO_ZEROPAGE over `len` bytes at `dst` (a copy's source is
    /// exactly `len` bytes). Returns the bytes placed (a positive number of whole pages), or
    /// the error of the first page it could not place.
    fn fill_once(&self, dst: usize, len: usize, fill: Fill<'_>, wake: Wake) -> io::Result<usize> {
        let mode = match wake {
            Wake::Now => 0,
            Wake::Later => MODE_DONTWAKE,
        };
        let fd = self.fd.as_raw_fd();
        // The kernel's answer convention, the same for both: the ioctl returns 0 when the
        // whole range is placed; otherwise it fails, with the answer field holding the bytes
        // placed (> 0, and errno EAGAIN) or -errno (0 if it failed before trying).
        let (ret, placed) = match fill {
            Fill::Copy(src) => {
                debug_assert_eq!(src.len(), len);
                let mut arg = UffdioCopy {
                    dst: dst as u64,
                    src: src.as_ptr() as u64,
                    len: len as u64,
                    mode,
                    copy: 0,
                };
                // SAFETY: UFFDIO_COPY reads one `uffdio_copy` (live across the call) and `len`
                // bytes from `src`, a live slice of exactly `len` bytes (`fill` takes `len` from
                // the slice and cuts both alike); it writes only into missing pages of ranges
                // registered with this fd, whose registration vouched that no Rust reference
                // reaches them.
                let ret = unsafe { libc::ioctl(fd, UFFDIO_COPY, &mut arg) };
                (ret, arg.copy)
            }
            Fill::Zero => {
                let mut arg = UffdioZeropage {
                    range: UffdioRange {
                        start: dst as u64,
                        len: len as u64,
                    },
                    mode,
                    zeropage: 0,
                };
                // SAFETY: UFFDIO_ZEROPAGE reads and writes one `uffdio_zeropage`, live across
                // the call, and fills only missing pages of ranges registered with this fd
                // (whose registration vouched that no Rust reference reaches them).
                let ret = unsafe { libc::ioctl(fd, UFFDIO_ZEROPAGE, &mut arg) };
                (ret, arg.zeropage)
            }
            Fill::Continue => {
                let mut arg = UffdioContinue {
                    range: UffdioRange {
                        start: dst as u64,
                        len: len as u64,
                    },
                    mode,
                    mapped: 0,
                };
                // SAFETY: UFFDIO_CONTINUE reads and writes one `uffdio_continue`, live across
                // the call, and maps only pages of ranges registered with this fd for minor
                // faults (whose registration vouched that no Rust reference reaches them).
                let ret = unsafe { libc::ioctl(fd, UFFDIO_CONTINUE, &mut arg) };
                (ret, arg.mapped)
            }
        };
        if ret == 0 {
            return Ok(len);
        }
        let err = io::Error::last_os_error();
        if placed > 0 && placed as usize <= len {
            return Ok(placed as usize);
        }
        Err(err)
    }

    /// An ioctl whose argument is one `uffdio_range` (UNREGISTER, WAKE).
    fn range_ioctl(&self, request: libc::c_ulong, addr: usize, len: usize) -> io::Result<()> {
        let mut range = UffdioRange {
            start: addr as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_UNREGISTER and UFFDIO_WAKE (the callers) read one `uffdio_range`,
        // live across the call; neither touches the memory of the range.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), request, &mut range) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Checks that `len` bytes at `addr` are a non-empty run of whole pages, so that the kernel's
/// EINVAL is kept for what only it can know.
fn check_pages(what: &'static str, addr: usize, len: usize) -> Result<(), UffdError> {
    check_aligned(what, addr, len, PAGE)
}

/// [`check_pages`] for host pages of `page` bytes.
fn check_aligned(
    what: &'static str,
    addr: usize,
    len: usize,
    page: usize,
) -> Result<(), UffdError> {
    if len == 0 || !addr.is_multiple_of(page) || !len.is_multiple_of(page) {
        return Err(UffdError::Unaligned {
            what,
            addr,
            len,
            page,
        });
    }
    Ok(())
}

/// A userfaultfd from the syscall or, where that is not permitted, from /dev/userfaultfd.
fn open() -> Result<OwnedFd, UffdError> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: userfaultfd(2) takes flags only and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd >= 0 {
        // SAFETY: a new fd from the kernel that nothing else owns.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) });
    }
    let syscall = io::Error::last_os_error();
    match syscall.raw_os_error() {
        Some(libc::EPERM) => {}
        Some(libc::ENOSYS) => return Err(UffdError::Unsupported { source: syscall }),
        _ => return Err(UffdError::Open { source: syscall }),
    }
    // std opens every file O_CLOEXEC; the device fd is needed only for the one ioctl.
    let device = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .map_err(|device| UffdError::NotPermitted {
            syscall: io::Error::from_raw_os_error(libc::EPERM),
            device,
        })?;
    // SAFETY: USERFAULTFD_IOC_NEW takes the new fd's flags by value and returns a new fd or -1.
    let fd = unsafe { libc::ioctl(device.as_raw_fd(), USERFAULTFD_IOC_NEW, flags) };
    if fd < 0 {
        return Err(UffdError::NotPermitted {
            syscall: io::Error::from_raw_os_error(libc::EPERM),
            device: io::Error::last_os_error(),
        });
    }
    // SAFETY: a new fd from the kernel that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests;
