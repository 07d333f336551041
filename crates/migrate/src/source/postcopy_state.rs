//! Postcopy's own state in a session: its settings, the heat the dirty syncs record in
//! precopy for the push's order (`heat.rs`), and after the switch how long the destination's
//! requests waited between the reader and the sending thread. Present only when the migration
//! may switch to postcopy, so precopy alone keeps no history it will not use.

#![forbid(unsafe_code)]

use std::time::Instant;

use super::heat::Heat;
use super::params::Postcopy;
use crate::wire::Latencies;

/// What a session that may switch to postcopy keeps for it.
#[derive(Debug)]
pub(super) struct PostcopyState {
    pub(super) settings: Postcopy,
    /// How recently each 2 MiB was dirtied, for the push's order.
    pub(super) heat: Heat,
    /// Requests, from read to taken by the sending thread (`PostcopyStats::source_handoff`).
    pub(super) handoff: Latencies,
    /// When the background push took its first batch, and the bytes written by then.
    pub(super) push_began: Option<(Instant, u64)>,
}

impl PostcopyState {
    pub(super) fn new(settings: Postcopy) -> PostcopyState {
        PostcopyState {
            settings,
            heat: Heat::default(),
            handoff: Latencies::default(),
            push_began: None,
        }
    }
}
