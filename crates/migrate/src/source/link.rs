//! What the session knows of its link: the bandwidth limit's pacing, the send rate's window,
//! and what a data page costs on the wire lately. One value the session holds, so that the
//! phases that send and the observation that divides by the rate read the same figures.

#![forbid(unsafe_code)]

use super::bandwidth::BandwidthWindow;
use super::limiter::Limiter;
use crate::compress::WireShare;

/// The link's state in a session.
#[derive(Debug, Default)]
pub(super) struct Link {
    /// `None` without a bandwidth limit.
    pub(super) limiter: Option<Limiter>,
    /// The send rate over the recent busy window (`bandwidth.rs`).
    pub(super) bandwidth: BandwidthWindow,
    /// What a data page costs on the wire lately, with compression (`compress.rs`).
    pub(super) wire: WireShare,
}

impl Link {
    /// A link capped at `max_bandwidth` bytes per second, or not.
    pub(super) fn new(max_bandwidth: Option<u64>) -> Link {
        Link {
            limiter: max_bandwidth.map(Limiter::new),
            ..Link::default()
        }
    }
}
