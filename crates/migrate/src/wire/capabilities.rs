//! The optional protocol features a main hello asks for and its reply grants.

#![forbid(unsafe_code)]

/// Optional protocol features, agreed in the main hello: the source asks for a set and the
/// destination answers with the subset it grants, so that a newer source can talk to an older
/// destination by asking and reading the answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities(pub u64);

impl Capabilities {
    pub const NONE: Capabilities = Capabilities(0);
    /// Bit 0: the source may switch to postcopy (Discard, Postcopy), and the destination then
    /// requests missing pages (PageRequest) and says when it has them all (Done).
    pub const POSTCOPY: Capabilities = Capabilities(1);
    /// Bit 1, with postcopy: a preempt connection (role 3) carries the pages the destination
    /// asked for, so that they never wait behind the data channels' background stream.
    pub const PREEMPT: Capabilities = Capabilities(1 << 1);
    /// Bit 2: a Pages record's payload checksum covers its page data as well as its addresses
    /// (without it, the addresses only). The sender copies each page before it checksums and
    /// sends it, so a page the guest changes meanwhile is sent as checksummed.
    pub const CHECKSUM_PAGES: Capabilities = Capabilities(1 << 2);
    /// Bit 4: the destination sends [`Kind::Received`](super::Kind::Received) records on the main
    /// connection while pages arrive, and the source reads them as it sends.
    pub const PROGRESS: Capabilities = Capabilities(1 << 4);
    /// Bit 5, with postcopy: a connection that breaks in postcopy pauses the migration on both
    /// sides instead of failing it, and a recovery (role 4) resumes it.
    pub const RECOVER: Capabilities = Capabilities(1 << 5);
    /// A [`Kind::VmConfig`](super::Kind::VmConfig) record follows the source's main hello, and the
    /// destination's VMM checks it before answering (refusing with
    /// [`Refusal::Config`](super::Refusal::Config) and an Error record that says what differs).
    pub const CONFIG: Capabilities = Capabilities(1 << 6);
    /// Bit 7, with postcopy on 4 KiB pages: once the destination sent Resumed, the source may
    /// send requested pages as Pages records on the main connection (which carries nothing
    /// else until Complete then), so that without a preempt connection they do not wait
    /// behind the data channels' background stream.
    pub const MAIN_PAGES: Capabilities = Capabilities(1 << 7);
    /// Bit 8: an Error record's count says why it ends the migration:
    /// [`ERROR_FAILED`](super::ERROR_FAILED) (0), or [`ERROR_CANCELLED`](super::ERROR_CANCELLED)
    /// (1, the sayer's operator cancelled it). Without it, every Error has count 0.
    pub const ERROR_CODES: Capabilities = Capabilities(1 << 8);
    /// Bit 9: the source and the destination share a host, and guest RAM is handed over
    /// instead of sent: the source passes its RAM's file descriptors over the Unix socket
    /// (a [`Kind::LocalRam`](super::Kind::LocalRam) record carrying them as `SCM_RIGHTS`), the
    /// destination maps them, and no page moves; only the device state follows, and the
    /// destination resumes the guest only when the source says Go. No data channel connects.
    pub const LOCAL: Capabilities = Capabilities(1 << 9);
    /// Bit 10: the source may send a precopy batch's pages as a
    /// [`Kind::CompressedPages`](super::Kind::CompressedPages) record (one zstd frame).
    pub const COMPRESS: Capabilities = Capabilities(1 << 10);
    /// Bit 11, with [`Capabilities::PROGRESS`]: devices with large state send it in
    /// [`Kind::StateChunk`](super::Kind::StateChunk) records while the guest runs, and the
    /// destination says [`Kind::StateReady`](super::Kind::StateReady) once its devices are
    /// ready for the switchover (on the connection its Received records take).
    pub const ITERATIVE_STATE: Capabilities = Capabilities(1 << 11);
    /// Bit 12, with [`Capabilities::LOCAL`]: the source may pass its devices' descriptors
    /// too (a disk's image, a tap), on a [`Kind::LocalDevices`](super::Kind::LocalDevices)
    /// record after RamAdopted (answered [`Kind::DevicesAdopted`](super::Kind::DevicesAdopted)
    /// before the source pauses), so that the destination's devices take over the source's open
    /// files instead of opening them again. A destination grants it only where its VMM takes
    /// them; without it, the source passes none and the destination opens its devices' files
    /// itself.
    pub const LOCAL_DEVICES: Capabilities = Capabilities(1 << 12);
    /// What this side implements.
    pub const SUPPORTED: Capabilities = Capabilities(
        Capabilities::POSTCOPY.0
            | Capabilities::PREEMPT.0
            | Capabilities::CHECKSUM_PAGES.0
            | Capabilities::PROGRESS.0
            | Capabilities::RECOVER.0
            | Capabilities::CONFIG.0
            | Capabilities::MAIN_PAGES.0
            | Capabilities::ERROR_CODES.0
            | Capabilities::LOCAL.0
            | Capabilities::COMPRESS.0
            | Capabilities::ITERATIVE_STATE.0
            | Capabilities::LOCAL_DEVICES.0,
    );

    /// The protocol version a hello asking for (or granting) these needs: 5 with
    /// [`Capabilities::LOCAL`], 4 without. A hello carries this, not the newest version its
    /// sender speaks, so that a version 4 peer meets version 4 wherever it could take part.
    pub fn version(self) -> u32 {
        match self.contains(Capabilities::LOCAL) {
            true => 5,
            false => super::format::OLDEST_VERSION,
        }
    }

    /// Both sets' bits.
    pub fn with(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    /// Whether every bit of `other` is in `self`.
    pub fn contains(self, other: Capabilities) -> bool {
        other.is_subset(self)
    }

    /// What a destination grants for a request: the bits it also supports.
    pub fn grant(self, supported: Capabilities) -> Capabilities {
        Capabilities(self.0 & supported.0)
    }

    /// Whether every bit of `self` is in `of`.
    pub fn is_subset(self, of: Capabilities) -> bool {
        self.0 & !of.0 == 0
    }
}
