//! A migration request that cannot work as given, each refusal a variant with the values that
//! broke it; the message names the fix (the CLI's flag where there is one).

#![forbid(unsafe_code)]

/// A request that cannot work as given.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Address(#[from] crate::transport::AddressError),
    #[error("{asked} channels requested; use 1 to {max}")]
    Channels { asked: u16, max: u16 },
    #[error(
        "a peer timeout of 0 would fail the first write that waits; give a positive timeout, or none to wait for ever"
    )]
    ZeroPeerTimeout,
    /// A timeout action of postcopy without postcopy itself.
    #[error("a timeout action of postcopy was given without enabling postcopy; add --postcopy")]
    TimeoutNeedsPostcopy,
    #[error("postcopy after 0 passes: the switch comes after a pass ends; give 1 or more")]
    PostcopyAfterZeroPasses,
    #[error(
        "a postcopy prefetch window of {pages} pages is over the largest, {max} (16 MiB); give 0 to {max}"
    )]
    Prefetch { pages: u64, max: u64 },
    #[error("packet size of {pages} pages is outside 1..={max} (4 KiB to 2 MiB)")]
    PacketSize { pages: u32, max: u32 },
    #[error(
        "a bandwidth limit of 0 bytes/s would never send a page; give a positive limit, or none for an unlimited link"
    )]
    ZeroBandwidth,
    #[error(
        "a dirty limit of {asked} bytes/s is below the floor of {floor} bytes/s: a vCPU held lower sleeps for seconds on every page it writes; give at least {floor}, or none"
    )]
    DirtyLimitBelowFloor { asked: u64, floor: u64 },
    #[error("a timeout of 0 would end the migration at once; give a positive timeout, or none")]
    ZeroTimeout,
    #[error(
        "auto-converge throttle of {initial}% rising to {max}%: use an initial throttle of 1 or more, at most the cap, and a cap under 100"
    )]
    Throttle { initial: u8, max: u8 },
    /// A snapshot restored into a VM of another RAM layout.
    #[error(
        "the snapshot holds {} of guest RAM in {file_regions} region(s) and this VM has {} in {here_regions}; restore it into a VM of the snapshot's size (ferry run --restore sizes the VM from the file)",
        crate::ram::Size(*file),
        crate::ram::Size(*here)
    )]
    SnapshotRam {
        file: u64,
        file_regions: usize,
        here: u64,
        here_regions: usize,
    },
    #[error(
        "the snapshot's VM has {file} vCPUs and this one {here}; restore it into a VM with {file} vCPUs (ferry run --restore takes them from the file)"
    )]
    SnapshotVcpus { file: u32, here: u32 },
    #[error(
        "a lazy restore places 4 KiB pages, and this VM's RAM is on huge pages; restore it without --lazy"
    )]
    LazyHugePages,
    #[error(
        "this kernel's userfaultfd cannot serve shared memory (no UFFD_FEATURE_MISSING_SHMEM); restore without --lazy"
    )]
    LazyUnsupported,
    #[error(
        "a local handover hands guest RAM's descriptors over a Unix socket, and {to} is not one; give --to unix:PATH (the destination's --incoming), or migrate without --local"
    )]
    LocalNeedsUnix { to: String },
    #[error(
        "a local handover passes descriptors over the Unix socket itself, which TLS cannot carry (and on one host TLS protects nothing the socket's permissions do not); migrate --local without TLS"
    )]
    LocalWithTls,
    #[error(
        "the destination did not agree to a local handover (it listens on TCP or TLS, or it is an older ferry); migrate without --local"
    )]
    LocalNotGranted,
    #[error(
        "guest RAM's descriptors did not arrive with the LocalRam record: the source is not on this host (a Unix socket forwarded between hosts carries bytes only); migrate without --local"
    )]
    LocalNoDescriptors,
    /// The VMM's configuration record is larger than the protocol carries.
    #[error("the VMM's configuration of {bytes} bytes exceeds the protocol's {max}")]
    VmConfigTooLarge { bytes: u64, max: u64 },
}
