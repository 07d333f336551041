//! What the destination acknowledged, as a value the source session holds: whether it may be
//! trusted, the window of its absorption rate and the count last seen. How the session folds
//! and uses it is in `observe.rs`.

#![forbid(unsafe_code)]

use super::bandwidth::BandwidthWindow;
use super::reader::InboundReader;

/// Whether the source may trust acknowledgements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckUse {
    /// The destination does not acknowledge (not granted).
    Unavailable,
    /// It does; in-flight and absorption come from its acknowledgements.
    Live,
    /// It was granted but made no progress through a whole drain: ignored from then on.
    Stalled,
}

/// The source's view of the destination's progress.
#[derive(Debug)]
pub struct Acks {
    pub(super) reader: Option<InboundReader>,
    pub(super) use_: AckUse,
    /// (arrival time, acknowledged bytes), one sample per new acknowledgement.
    pub(super) absorbed: BandwidthWindow,
    /// The acknowledged byte count last seen.
    pub(super) acked: u64,
}

impl Default for Acks {
    fn default() -> Acks {
        Acks {
            reader: None,
            use_: AckUse::Unavailable,
            absorbed: BandwidthWindow::default(),
            acked: 0,
        }
    }
}

impl Acks {
    /// Bytes the destination acknowledged so far.
    pub fn acked(&self) -> u64 {
        self.acked
    }
}
