//! What the destination acknowledged, as a value the source session holds: whether it may be
//! trusted, the window of its absorption rate and the count last seen. How the session folds
//! and uses it is in `observe.rs`.

#![forbid(unsafe_code)]

use std::time::Instant;

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

    /// Folds a new acknowledgement, if one came, into the absorption window.
    pub(super) fn note(&mut self) {
        let Some(reader) = &self.reader else {
            return;
        };
        let acked = reader.acked().bytes;
        if acked != self.acked {
            self.acked = acked;
            self.absorbed.record(Instant::now(), acked);
        }
    }

    /// Of `committed` bytes sent or queued, those not acknowledged; 0 unless
    /// acknowledgements are trusted.
    pub(super) fn in_flight(&self, committed: u64) -> u64 {
        match self.use_ {
            AckUse::Live => committed.saturating_sub(self.acked),
            AckUse::Unavailable | AckUse::Stalled => 0,
        }
    }

    /// The rate the destination absorbs data at, once trusted acknowledgements measured one.
    pub(super) fn absorbed_rate(&self) -> Option<f64> {
        let rate = self.absorbed.rate();
        (self.use_ == AckUse::Live && rate > 0.0).then_some(rate)
    }
}
