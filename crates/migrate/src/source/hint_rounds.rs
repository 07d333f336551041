//! Where free page hinting stands in one migration, as a value the source session holds: the
//! state of the rounds, pass 1's skip bitmap and the ranges buffer. The rule that orders hints
//! against the dirty sync, and the session's steps, are in `hints.rs`.

#![forbid(unsafe_code)]

use crate::bitmap::DirtyBitmap;

/// Where hinting stands in one migration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum State {
    /// Not asked yet: the first round will find out whether the VMM and guest can hint.
    #[default]
    Untried,
    /// Switched off, unsupported, or failed once: every page is sent.
    Off,
    /// Rounds happened and none runs now.
    Between,
    /// A round runs: hints may arrive.
    Round,
    /// `finish_hints` was called: no more rounds.
    Finished,
}

/// The hinting side of a source session.
#[derive(Debug, Default)]
pub(super) struct Hints {
    pub(super) state: State,
    /// Pages hinted during pass 1, which the walk over populated memory skips.
    pub(super) skip: Option<DirtyBitmap>,
    /// Ranges taken from the VMM, reused between takes.
    pub(super) ranges: Vec<(u64, u64)>,
}

impl Hints {
    /// Hints off for this migration (the user asked for it).
    pub(super) fn off() -> Hints {
        Hints {
            state: State::Off,
            ..Hints::default()
        }
    }

    /// Whether pass 1's walk should skip the page at `gpa`.
    pub(super) fn skips(&self, gpa: u64) -> bool {
        self.skip.as_ref().is_some_and(|s| s.contains(gpa))
    }

    /// Pass 1 is over: its skip bitmap is not needed again.
    pub(super) fn first_pass_done(&mut self) {
        self.skip = None;
    }
}
