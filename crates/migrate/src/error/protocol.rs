//! What a peer can send that the protocol forbids, as values a caller can match on: each rule
//! of the record order and of the page accounting is a variant with the figures that broke it,
//! and the sentence a user reads is built only when the error is shown.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::ram::RamError;
use crate::wire::{Kind, SectionId, WireError};

/// The peer sent something the protocol does not allow.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error(transparent)]
    Ram(#[from] RamError),
    /// A record of kind `got` where the record order does not allow it.
    #[error("{}", rule.describe(*got))]
    Misplaced { got: Kind, rule: Rule },
    /// A page the protocol moves once (per pass, per discard list, per postcopy connection)
    /// came again.
    #[error("{}", twice.describe(*gpa))]
    PageTwice { gpa: u64, twice: Twice },
    /// A CompressedPages record whose frame is not its pages.
    #[error("a compressed record of {pages} pages is malformed: {why}")]
    Compressed { pages: u32, why: String },
    #[error(
        "postcopy page {gpa:#x} is not on the discard list: the destination holds its last version"
    )]
    NotDiscarded { gpa: u64 },
    /// A recovering destination lists as missing a page it was never told to drop.
    #[error("the destination lacks page {gpa:#x}, which it was never told to drop")]
    LacksUndropped { gpa: u64 },
    /// Descriptors rode on a record that carries none (only LocalRam and LocalDevices do).
    #[error("file descriptors came with a {got:?} record, which carries none")]
    StrayDescriptors { got: Kind },
    #[error("{id} instance {instance} sent twice")]
    SectionTwice { id: SectionId, instance: u32 },
    /// Passes end in order, on the main channel and on each data channel.
    #[error("end of pass {got} after pass {after}{}", if *data_channel { " on a data channel" } else { "" })]
    PassOrder {
        got: u32,
        after: u32,
        data_channel: bool,
    },
    /// More of something than the protocol bounds.
    #[error("{}", bound.describe(*max))]
    OverBound { bound: Bound, max: u64 },
    #[error(
        "postcopy pages of more than {max} huge pages in progress on one connection (the huge page at {next:#x} would be the next): a source sends each huge page's pages together"
    )]
    OpenHugePages { max: usize, next: u64 },
    #[error("the source closed {connection} with {open} huge pages incomplete")]
    IncompleteHugePages { connection: Connection, open: usize },
    #[error("Postcopy on {connection} but the main channel did not switch within {timeout:?}")]
    PostcopyGate {
        connection: Connection,
        timeout: Duration,
    },
    #[error("the destination granted capabilities {bits:#x} that were not asked for")]
    NotAsked { bits: u64 },
    #[error("the destination's postcopy pages of {pages} wire pages exceed a record")]
    UnitTooLarge { pages: u64 },
    #[error("the destination's received bytes went back from {before} to {now}")]
    ReceivedWentBack { before: u64, now: u64 },
    #[error("page addresses of a record are not strictly increasing")]
    AddressesNotIncreasing,
    #[error(
        "discard run of {pages} pages at {gpa:#x} is not whole {unit_kib} KiB host pages, the unit this destination announced"
    )]
    DiscardMisaligned { gpa: u64, pages: u64, unit_kib: u64 },
    #[error("the destination requested pages outside RAM: {0}")]
    RequestOutsideRam(#[source] RamError),
    #[error("{left} postcopy pages never arrived within {timeout:?}")]
    PagesNeverArrived { left: u64, timeout: Duration },
    /// A sending connection's thread ended without an error before it was told to.
    #[error("{connection} stopped early")]
    StoppedEarly { connection: Connection },
    #[error(
        "a TLS handshake instead of a hello: this destination does not use TLS; start it with ferry run --tls-dir (or the source's migration without it)"
    )]
    TlsInsteadOfHello,
}

/// A rule of the record order (docs/protocol.md), named by what it requires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    // The destination's main channel.
    /// The source's VmConfig comes right after its hello.
    ConfigFirst,
    /// No pass ends after the device state or a discard list.
    NoPassAfterState,
    /// Discard and Postcopy need the postcopy capability.
    NeedsPostcopy,
    /// A discard list comes after a memory pass and before the device state.
    DiscardBetweenPassesAndState,
    /// Postcopy comes after the device state.
    PostcopyAfterState,
    /// The device state comes after a memory pass.
    StateAfterPass,
    /// After a discard list, postcopy starts with Postcopy, not Complete.
    NoCompleteAfterDiscard,
    /// Complete comes after the device state.
    CompleteAfterState,
    /// StateChunk needs the iterative state capability.
    NeedsIterativeState,
    /// State chunks come while the passes run or among the discard lists, before the
    /// device state.
    ChunksBeforeState,
    /// What the main channel carries in precopy.
    MainChannel,
    /// What the main channel carries in postcopy.
    MainChannelInPostcopy,
    /// A local handover starts with the LocalRam record.
    LocalRamFirst,
    /// What the main channel carries in a local handover.
    LocalChannel,
    /// LocalDevices needs the local devices capability.
    NeedsLocalDevices,
    /// Devices' descriptors come once, right after guest RAM was adopted.
    DevicesAfterRam,
    // The destination's data channels.
    /// The preempt connection starts with Postcopy.
    PreemptStartsWithPostcopy,
    /// No pass ends on a data channel after its Postcopy.
    NoPassInPostcopy,
    /// One Postcopy per data channel.
    OnePostcopy,
    /// CompressedPages only in precopy's passes, and only with the capability granted.
    CompressedInPasses,
    /// What a data channel carries.
    DataChannel,
    // What the source hears from the destination.
    /// The record the source waits for, and only it.
    Awaiting(&'static str),
    /// Postcopy records (requests, Done) need the postcopy capability.
    PostcopyRecordsNeedPostcopy,
    /// Page requests come after the switch to postcopy.
    RequestsInPostcopy,
    /// Done comes after Resumed.
    DoneAfterResumed,
    /// One Resumed.
    OneResumed,
    /// Received needs the progress capability.
    ReceivedNeedsProgress,
    /// StateReady needs the iterative state capability, and comes once.
    OneStateReady,
    /// Resumed comes after Complete.
    ResumedAfterComplete,
    /// No Done in precopy.
    NoDoneInPrecopy,
    /// Done comes after every page was sent.
    DoneLast,
    /// What the destination sends in postcopy.
    InPostcopy,
    /// Done, once every page was sent.
    AwaitingDone,
    /// What the destination sends in a recovery's handshake.
    InRecovery,
}

impl Rule {
    /// The sentence for a record of kind `got` that broke this rule.
    pub fn describe(self, got: Kind) -> String {
        use Rule as R;
        match self {
            R::ConfigFirst => {
                format!("expected the source VM's configuration after its hello, got {got:?}")
            }
            R::NoPassAfterState => "EndOfPass record after device state or a discard list".into(),
            R::NeedsPostcopy => format!("{got:?} record without the postcopy capability"),
            R::DiscardBetweenPassesAndState => {
                "a discard list must come after a memory pass and before the device state".into()
            }
            R::PostcopyAfterState => "Postcopy without any device state".into(),
            R::StateAfterPass => "device state before any memory pass".into(),
            R::NoCompleteAfterDiscard => {
                "Complete after a discard list: postcopy must start with Postcopy".into()
            }
            R::CompleteAfterState => "Complete without any device state".into(),
            R::NeedsIterativeState => {
                format!("{got:?} record without the iterative state capability")
            }
            R::ChunksBeforeState => "a state chunk after the device state began".into(),
            R::MainChannel => format!("{got:?} record on the main channel"),
            R::MainChannelInPostcopy => {
                format!("{got:?} record on the main channel during postcopy")
            }
            R::LocalRamFirst => {
                format!("expected LocalRam first in a local handover, got {got:?}")
            }
            R::LocalChannel => format!("{got:?} record in a local handover"),
            R::NeedsLocalDevices => {
                format!("{got:?} record without the local devices capability")
            }
            R::DevicesAfterRam => {
                "devices' descriptors must come once, right after guest RAM was adopted".into()
            }
            R::PreemptStartsWithPostcopy => {
                format!("{got:?} on the preempt connection before Postcopy")
            }
            R::NoPassInPostcopy => "EndOfPass on a data channel after postcopy started".into(),
            R::OnePostcopy => "a second Postcopy on a data channel".into(),
            R::CompressedInPasses => {
                "CompressedPages outside precopy's passes or without the compress capability".into()
            }
            R::DataChannel => format!("{got:?} record on a data channel"),
            R::Awaiting(what) => format!("expected {what} from the destination, got {got:?}"),
            R::PostcopyRecordsNeedPostcopy => {
                "the destination sent a postcopy record without the postcopy capability".into()
            }
            R::RequestsInPostcopy => {
                "the destination sent a page request before the source switched to postcopy".into()
            }
            R::DoneAfterResumed => "the destination sent Done before it resumed the guest".into(),
            R::OneResumed => "the destination sent Resumed twice".into(),
            R::ReceivedNeedsProgress => {
                "the destination sent Received without the progress capability".into()
            }
            R::OneStateReady => {
                "the destination sent StateReady twice, or without the iterative state capability"
                    .into()
            }
            R::ResumedAfterComplete => "the destination sent Resumed before Complete".into(),
            R::NoDoneInPrecopy => "the destination sent Done during precopy".into(),
            R::DoneLast => "the destination said Done before every page was sent".into(),
            R::InPostcopy => format!("unexpected {got:?} from the destination during postcopy"),
            R::AwaitingDone => format!("expected Done from the destination, got {got:?}"),
            R::InRecovery => format!("{got:?} from the destination during a recovery"),
        }
    }
}

/// Where a page came a second time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Twice {
    /// In one precopy pass (across its data channels).
    InPass,
    /// In the discard lists.
    Discarded,
    /// In postcopy, on one connection.
    OnConnection,
}

impl Twice {
    fn describe(self, gpa: u64) -> String {
        match self {
            Twice::InPass => format!("page {gpa:#x} sent twice in one pass"),
            Twice::Discarded => format!("page {gpa:#x} discarded twice"),
            Twice::OnConnection => {
                format!("postcopy page {gpa:#x} arrived twice on one connection")
            }
        }
    }
}

/// What the protocol bounds (docs/protocol.md's caps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Page requests the source holds queued.
    QueuedRequests,
    /// Device-state sections in one migration.
    Sections,
    /// Device-state bytes in all.
    StateBytes,
}

impl Bound {
    fn describe(self, max: u64) -> String {
        match self {
            Bound::QueuedRequests => {
                format!("the destination has more than {max} page requests outstanding")
            }
            Bound::Sections => format!("more than {max} device-state sections"),
            Bound::StateBytes => format!("device state exceeds {max} bytes in all"),
        }
    }
}

/// A connection of a migration other than the main one, as its messages name it:
/// [`PREEMPT_CHANNEL`](crate::wire::PREEMPT_CHANNEL) is the preempt connection, 1 and up the
/// data channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connection(pub u16);

impl std::fmt::Display for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            crate::wire::PREEMPT_CHANNEL => f.write_str("the preempt connection"),
            c => write!(f, "data channel {c}"),
        }
    }
}
