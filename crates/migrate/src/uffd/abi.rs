//! The userfaultfd kernel ABI, written out from include/uapi/linux/userfaultfd.h (Linux 6.x;
//! every item used here has been there since 4.14): the ioctl numbers and the `#[repr(C)]`
//! structs they take, each with its size asserted. Data only, no calls: `uffd.rs` makes them.
//!
//! The ioctl numbers are the header's `_IOWR`/`_IOR` expansions, checked against a C compile of
//! the header on x86-64 (the literals in the assertions below).

#![forbid(unsafe_code)]

use std::mem::{offset_of, size_of};

/// `UFFD_API`: the only protocol version.
pub(super) const UFFD_API: u64 = 0xAA;
pub(super) const UFFD_FEATURE_MISSING_HUGETLBFS: u64 = 1 << 4;
pub(super) const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
pub(super) const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
pub(super) const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
pub(super) const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
pub(super) const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
pub(super) const UFFD_PAGEFAULT_FLAG_MINOR: u64 = 1 << 2;
pub(super) const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
pub(super) const UFFDIO_REGISTER_MODE_MINOR: u64 = 1 << 2;
/// `UFFDIO_COPY_MODE_DONTWAKE`, `UFFDIO_ZEROPAGE_MODE_DONTWAKE` and
/// `UFFDIO_CONTINUE_MODE_DONTWAKE` (all bit 0).
pub(super) const MODE_DONTWAKE: u64 = 1 << 0;

/// The `_UFFDIO_*` command numbers: the bits of `uffdio_api.ioctls` and
/// `uffdio_register.ioctls` that say which ioctls the kernel offers.
pub(super) const NR_REGISTER: u64 = 0x00;
pub(super) const NR_UNREGISTER: u64 = 0x01;
pub(super) const NR_WAKE: u64 = 0x02;
pub(super) const NR_COPY: u64 = 0x03;
pub(super) const NR_ZEROPAGE: u64 = 0x04;
pub(super) const NR_CONTINUE: u64 = 0x07;
pub(super) const NR_API: u64 = 0x3F;

/// `_IOC(dir, 0xAA, nr, size)` of asm-generic/ioctl.h: dir in bits 30..32, size in 16..30.
const fn uffdio(dir: u64, nr: u64, size: usize) -> libc::c_ulong {
    ((dir << 30) | ((size as u64) << 16) | (0xAA << 8) | nr) as libc::c_ulong
}
const IOC_READ_WRITE: u64 = 3; // _IOWR
const IOC_READ: u64 = 2; // _IOR (UNREGISTER and WAKE: the header's comment says why not _IOW)

pub(super) const UFFDIO_API: libc::c_ulong = uffdio(IOC_READ_WRITE, NR_API, size_of::<UffdioApi>());
pub(super) const UFFDIO_REGISTER: libc::c_ulong =
    uffdio(IOC_READ_WRITE, NR_REGISTER, size_of::<UffdioRegister>());
pub(super) const UFFDIO_UNREGISTER: libc::c_ulong =
    uffdio(IOC_READ, NR_UNREGISTER, size_of::<UffdioRange>());
pub(super) const UFFDIO_WAKE: libc::c_ulong = uffdio(IOC_READ, NR_WAKE, size_of::<UffdioRange>());
pub(super) const UFFDIO_COPY: libc::c_ulong =
    uffdio(IOC_READ_WRITE, NR_COPY, size_of::<UffdioCopy>());
pub(super) const UFFDIO_ZEROPAGE: libc::c_ulong =
    uffdio(IOC_READ_WRITE, NR_ZEROPAGE, size_of::<UffdioZeropage>());
/// `USERFAULTFD_IOC_NEW`, `_IO(0xAA, 0)`: asks /dev/userfaultfd (Linux 6.1+) for a new fd.
pub(super) const UFFDIO_CONTINUE: libc::c_ulong =
    uffdio(IOC_READ_WRITE, NR_CONTINUE, size_of::<UffdioContinue>());
pub(super) const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xAA00;
const _: () = assert!(UFFDIO_API == 0xc018_aa3f);
const _: () = assert!(UFFDIO_REGISTER == 0xc020_aa00);
const _: () = assert!(UFFDIO_UNREGISTER == 0x8010_aa01);
const _: () = assert!(UFFDIO_WAKE == 0x8010_aa02);
const _: () = assert!(UFFDIO_COPY == 0xc028_aa03);
const _: () = assert!(UFFDIO_ZEROPAGE == 0xc020_aa04);
const _: () = assert!(UFFDIO_CONTINUE == 0xc020_aa07);

/// `struct uffdio_api`.
#[repr(C)]
pub(super) struct UffdioApi {
    pub(super) api: u64,
    pub(super) features: u64,
    pub(super) ioctls: u64,
}
const _: () = assert!(size_of::<UffdioApi>() == 24);

/// `struct uffdio_range`.
#[repr(C)]
pub(super) struct UffdioRange {
    pub(super) start: u64,
    pub(super) len: u64,
}
const _: () = assert!(size_of::<UffdioRange>() == 16);

/// `struct uffdio_register`.
#[repr(C)]
pub(super) struct UffdioRegister {
    pub(super) range: UffdioRange,
    pub(super) mode: u64,
    pub(super) ioctls: u64,
}
const _: () = assert!(size_of::<UffdioRegister>() == 32);

/// `struct uffdio_copy`; `copy` is the kernel's answer (bytes copied, or `-errno`).
#[repr(C)]
pub(super) struct UffdioCopy {
    pub(super) dst: u64,
    pub(super) src: u64,
    pub(super) len: u64,
    pub(super) mode: u64,
    pub(super) copy: i64,
}
const _: () = assert!(size_of::<UffdioCopy>() == 40);

/// `struct uffdio_zeropage`; `zeropage` is the answer, as `uffdio_copy.copy`.
#[repr(C)]
pub(super) struct UffdioZeropage {
    pub(super) range: UffdioRange,
    pub(super) mode: u64,
    pub(super) zeropage: i64,
}
const _: () = assert!(size_of::<UffdioZeropage>() == 32);

/// `struct uffdio_continue`; `mapped` is the answer, as `uffdio_copy.copy`.
#[repr(C)]
pub(super) struct UffdioContinue {
    pub(super) range: UffdioRange,
    pub(super) mode: u64,
    pub(super) mapped: i64,
}
const _: () = assert!(size_of::<UffdioContinue>() == 32);

/// `struct uffd_msg` seen through its `pagefault` arm, the only one this module reads (the
/// other arms overlay the same 24 bytes after the header). The C struct is `packed`, but every
/// field is at its natural alignment anyway, so `repr(C)` gives the same layout.
#[derive(Clone, Copy)]
#[repr(C)]
pub(super) struct UffdMsg {
    pub(super) event: u8,
    pub(super) reserved1: u8,
    pub(super) reserved2: u16,
    pub(super) reserved3: u32,
    pub(super) pagefault_flags: u64,
    pub(super) pagefault_address: u64,
    /// `feat.ptid`: the faulting thread's id, with `UFFD_FEATURE_THREAD_ID`.
    pub(super) pagefault_ptid: u32,
    pub(super) pad: u32,
}
const _: () = assert!(size_of::<UffdMsg>() == 32);
const _: () = assert!(offset_of!(UffdMsg, pagefault_address) == 16);
const _: () = assert!(offset_of!(UffdMsg, pagefault_ptid) == 24);

impl UffdMsg {
    pub(super) const ZERO: UffdMsg = UffdMsg {
        event: 0,
        reserved1: 0,
        reserved2: 0,
        reserved3: 0,
        pagefault_flags: 0,
        pagefault_address: 0,
        pagefault_ptid: 0,
        pad: 0,
    };
}
