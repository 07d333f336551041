//! What a connection is for ([`Role`]) and what a record is ([`Kind`]), each with `Invalid = 0`.

#![forbid(unsafe_code)]

use super::wire_enum::wire_enum;

wire_enum! {
    /// What a connection is for. `Invalid = 0` so that zeroed bytes never pass as a role.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Role: u16 {
        Invalid = 0,
        /// Control and device state; opened first.
        Main = 1,
        /// Page batches; `channel` is 1..=channels, as announced in the main hello.
        Data = 2,
        /// Postcopy's requested pages, ahead of the data channels' background stream; `channel`
        /// is 0. Only with [`Capabilities::PREEMPT`](super::Capabilities::PREEMPT) granted, and
        /// at most one.
        Preempt = 3,
        /// The main connection of a postcopy recovery: names a migration in postcopy-paused on
        /// the destination by its uuid; `channel` is 0. Only with
        /// [`Capabilities::RECOVER`](super::Capabilities::RECOVER) granted.
        Resume = 4,
    }
}

wire_enum! {
    /// Record kinds. `Invalid = 0`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind: u16 {
        Invalid = 0,
        /// `count` pages: `count` guest addresses (u64), then `count` × 4096 bytes of data.
        Pages = 1,
        /// `count` runs of zero pages, each `gpa:u64 pages:u64`.
        ZeroRuns = 2,
        /// End of precopy pass `count` (1-based). No payload.
        EndOfPass = 3,
        /// A device-state section: payload = a [`SectionHeader`](super::SectionHeader), then the
        /// section's data.
        DeviceState = 4,
        /// Source → destination: everything was sent; load, resume and acknowledge. No payload.
        Complete = 5,
        /// Either direction: the sender gives up; payload = UTF-8 message.
        Error = 6,
        /// Destination → source: the guest runs on the destination. Payload:
        /// [`RESUMED_SIZE`](super::RESUMED_SIZE) bytes, the destination's load, resume and CPU
        /// times (ns, u64 each).
        Resumed = 7,
        /// Destination → source, only when
        /// [`Capabilities::PROGRESS`](super::Capabilities::PROGRESS) was granted: how much the
        /// destination has taken in so far. Payload: a [`Received`](super::Received)
        /// ([`RECEIVED_SIZE`](super::RECEIVED_SIZE) bytes).
        Received = 8,
        /// Source → destination, main, postcopy only: `count` runs `gpa:u64 pages:u64` of pages
        /// the source will send after the switch; whatever the destination holds for them is
        /// stale.
        Discard = 9,
        /// Source → destination, postcopy only. On the main connection, after the device state:
        /// load and resume the guest now, the remaining pages follow. On a data connection, after
        /// its last EndOfPass: the page records that follow are postcopy pages. No payload.
        Postcopy = 10,
        /// Destination → source, main, postcopy only: `count` runs `gpa:u64 pages:u64` of pages a
        /// vCPU waits for.
        PageRequest = 11,
        /// Destination → source, main, postcopy only: every page is in place. Payload: the
        /// destination's request latencies, a [`Latencies`](super::Latencies)
        /// ([`DONE_SIZE`](super::DONE_SIZE) bytes).
        Done = 12,
        /// Destination → source, on a recovery's main connection: `count` runs `gpa:u64
        /// pages:u64` of listed pages the destination still lacks (it holds every other page).
        Missing = 13,
        /// Destination → source, on a recovery's main connection: the Missing list is complete;
        /// reconnect the data channels and send the missing pages. No payload.
        Resume = 14,
        /// Source → destination, main, right after the hello when
        /// [`Capabilities::CONFIG`](super::Capabilities::CONFIG) is requested: the VM's
        /// configuration as the source VMM describes it (opaque to the engine, at most
        /// [`MAX_CONFIG_BYTES`](super::MAX_CONFIG_BYTES)). The destination VMM compares it with
        /// its own before it answers the hello, so a VM that cannot take this guest is refused
        /// before anything is sent, let alone the guest paused.
        VmConfig = 15,
        /// Source → destination, main, first after the hello when
        /// [`Capabilities::LOCAL`](super::Capabilities::LOCAL) was granted: guest RAM's layout
        /// as `count` [`LocalRegion`](super::LocalRegion)s, each naming one of the file
        /// descriptors that ride on this record's bytes (`SCM_RIGHTS`), at most
        /// [`MAX_LOCAL_REGIONS`](super::MAX_LOCAL_REGIONS) and
        /// [`MAX_LOCAL_FDS`](super::MAX_LOCAL_FDS).
        LocalRam = 16,
        /// Destination → source, local only: guest RAM is mapped here from the descriptors
        /// received; the source may pause its guest. No payload.
        RamAdopted = 17,
        /// Destination → source, local only, after Complete: the device state is loaded and
        /// the vCPUs wait; the guest resumes here on Go and nowhere if Go never comes. No
        /// payload.
        Loaded = 18,
        /// Source → destination, local only, after Loaded: resume the guest. From the moment
        /// the source sends it, it never runs the guest again. No payload.
        Go = 19,
        /// Source → destination, data channel, precopy passes only, when
        /// [`Capabilities::COMPRESS`](super::Capabilities::COMPRESS) was granted: `count` pages
        /// as `count` guest addresses (u64), then one zstd frame that decodes to exactly
        /// `count` × 4096 bytes of page data. The payload is never longer than the Pages
        /// record it replaces, and its checksum covers all of it.
        CompressedPages = 20,
        /// Source → destination, main, while the passes run (and in the pause before the
        /// device state, or among postcopy's discard lists), when
        /// [`Capabilities::ITERATIVE_STATE`](super::Capabilities::ITERATIVE_STATE) was granted:
        /// a chunk of a device's large state, sent while the guest runs. Payload as
        /// DeviceState's: a [`SectionHeader`](super::SectionHeader), then the chunk (at most
        /// [`MAX_SECTION_BYTES`](super::MAX_SECTION_BYTES)), opaque to the engine; the device
        /// on each side gives the chunks their meaning.
        StateChunk = 21,
        /// Destination → source, main, once, when
        /// [`Capabilities::ITERATIVE_STATE`](super::Capabilities::ITERATIVE_STATE) was granted:
        /// every device with iterative state loaded what came so far and says it is ready for
        /// the switchover (QEMU's switchover-ack). The source does not pause the guest for a
        /// switchover before it came. No payload.
        StateReady = 22,
        /// Source → destination, main, local only, once, right after the destination's
        /// RamAdopted and before the device state, when
        /// [`Capabilities::LOCAL_DEVICES`](super::Capabilities::LOCAL_DEVICES) was granted and
        /// the source's VMM passes any: `count` [`LocalDevice`](super::LocalDevice)s, each
        /// naming the device (by its state section's id and instance) one of the descriptors
        /// riding on this record's bytes (`SCM_RIGHTS`) belongs to, at most
        /// [`MAX_LOCAL_DEVICES`](super::MAX_LOCAL_DEVICES). The destination's VMM uses them
        /// only once the state is loaded.
        LocalDevices = 23,
        /// Destination → source, local only, the answer to LocalDevices: the devices took
        /// the descriptors (kept for the state load); the source may pause its guest. No
        /// payload.
        DevicesAdopted = 24,
    }
}

impl Kind {
    /// The kind with value `v`; [`Kind::Invalid`] for a value no kind has.
    pub fn from_u16(v: u16) -> Kind {
        Kind::try_from(v).unwrap_or(Kind::Invalid)
    }
}
