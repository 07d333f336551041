//! What can go wrong with userfaultfd, each error naming the call, the range and the fix; and
//! the bound on retries that [`UffdError::Stalled`] reports.

#![forbid(unsafe_code)]

use std::io;

use super::abi::UFFD_API;

/// How often a copy may make no progress with `EAGAIN` before it fails. That answer means the
/// mm is changing under a non-cooperative event (fork, mremap, remove, unmap) the kernel is
/// delivering, which needs `UFFD_FEATURE_EVENT_*` flags this module never asks for; so it is
/// not expected at all, and the bound turns a kernel surprise into an error, not a spin. 1000
/// yields is a few milliseconds on an idle core.
pub(super) const MAX_STALLED_RETRIES: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    #[error(
        "userfaultfd: not permitted (syscall: {syscall}; /dev/userfaultfd: {device}) — run with \
         CAP_SYS_PTRACE, set sysctl vm.unprivileged_userfaultfd=1, or give the user read-write \
         access to /dev/userfaultfd (Linux 6.1+). A user-mode-only fd, which unprivileged \
         users may open, would not do: KVM takes the guest's faults on its RAM in the kernel"
    )]
    NotPermitted {
        syscall: io::Error,
        #[source]
        device: io::Error,
    },
    #[error(
        "userfaultfd is not available: {source} — the kernel needs CONFIG_USERFAULTFD (Linux \
         4.14 or newer)"
    )]
    Unsupported {
        #[source]
        source: io::Error,
    },
    #[error("opening a userfaultfd failed: {source}")]
    Open {
        #[source]
        source: io::Error,
    },
    #[error(
        "UFFDIO_API (protocol {UFFD_API:#x} with UFFD_FEATURE_THREAD_ID) failed: {source} — the \
         kernel is too old, Linux 4.14 or newer is needed"
    )]
    Api {
        #[source]
        source: io::Error,
    },
    #[error(
        "UFFDIO_API answered protocol {api:#x}, features {features:#x}, ioctls {ioctls:#x}: \
         not the protocol {UFFD_API:#x} with thread ids, REGISTER and UNREGISTER this module needs"
    )]
    ApiMismatch {
        api: u64,
        features: u64,
        ioctls: u64,
    },
    #[error("{what} at {addr:#x} of {len} bytes: not a non-empty run of whole {page}-byte pages")]
    Unaligned {
        what: &'static str,
        addr: usize,
        len: usize,
        page: usize,
    },
    #[error(
        "registering {len} bytes at {addr:#x} for missing-page faults failed: {source} — the \
         range must be mapped anonymous, shmem (memfd, Linux 4.11+) or hugetlbfs memory not \
         registered with another userfaultfd"
    )]
    Register {
        addr: usize,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error(
        "{len} bytes at {addr:#x} registered, but the kernel offers ioctls {ioctls:#x} there, \
         without COPY and WAKE: faults in this range could not be served"
    )]
    RangeIoctls {
        addr: usize,
        len: usize,
        ioctls: u64,
    },
    #[error("unregistering {len} bytes at {addr:#x} failed: {source}")]
    Unregister {
        addr: usize,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error(
        "{op} of {len} bytes at {addr:#x} failed: {source} (ENOENT: the range is not registered \
         with this userfaultfd; ESRCH or ENOMEM: the process is exiting)"
    )]
    Fill {
        op: &'static str,
        addr: usize,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error(
        "{op} at {addr:#x} made no progress in {MAX_STALLED_RETRIES} tries (EAGAIN): the \
         address space kept changing under it"
    )]
    Stalled { op: &'static str, addr: usize },
    #[error("UFFDIO_WAKE of {len} bytes at {addr:#x} failed: {source}")]
    Wake {
        addr: usize,
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("waiting for userfaultfd messages failed: {source}")]
    Poll {
        #[source]
        source: io::Error,
    },
    #[error("reading userfaultfd messages failed: {source}")]
    Read {
        #[source]
        source: io::Error,
    },
    #[error("a read of the userfaultfd returned {bytes} bytes, not whole 32-byte messages")]
    ShortRead { bytes: usize },
}
