//! Failures that are ferry's own (a thread that panicked, state that cannot be), or that the
//! host's userfaultfd reported while postcopy ran: nothing a user's request or a peer caused.

#![forbid(unsafe_code)]

use super::protocol::Connection;
use crate::uffd::UffdError;

#[derive(Debug, thiserror::Error)]
pub enum Internal {
    #[error("{thread} panicked")]
    Panicked { thread: &'static str },
    /// A receiver thread that panicked, found when it was joined.
    #[error("{connection}: its receiver panicked")]
    ReceiverPanicked { connection: Connection },
    /// A receiver thread that panicked, as its siblings are told while it unwinds.
    #[error("{connection}: the receiver thread panicked (a bug in ferry)")]
    ReceiverUnwound { connection: Connection },
    #[error("postcopy: {0}")]
    Userfault(#[from] UffdError),
    /// A state chunk for a target that did not agree to take them (the session starts an
    /// iteration only when it did).
    #[error("a state chunk for a target that takes none (a bug in ferry)")]
    ChunkNotAgreed,
    #[error("postcopy: guest RAM mixes host page sizes")]
    MixedHostPages,
    #[error("a fault at host address {addr:#x} outside guest RAM")]
    FaultOutsideRam { addr: usize },
}
