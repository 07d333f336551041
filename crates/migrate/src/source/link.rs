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
    /// Bytes written on all connections when the limit was set: the limiter counts from there
    /// (`Session::pace`).
    pub(super) limit_base: u64,
    /// The send rate over the recent busy window (`bandwidth.rs`).
    pub(super) bandwidth: BandwidthWindow,
    /// The walk's rate, in page bytes the senders finished (data or zero) over the same busy
    /// clock: what a pass's remaining pages go at, where the send rate of a guest of zeros
    /// is a few KB/s of runs.
    pub(super) walk: BandwidthWindow,
    /// Pages handed to the senders so far (the walk's count is these less those pending).
    pub(super) handed_pages: u64,
    /// The walk's count when last taken, in page bytes (it only grows).
    pub(super) walked: u64,
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
