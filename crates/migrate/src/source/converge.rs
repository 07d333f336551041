//! What the session did to make precopy converge: the stall count the policy reads, and the
//! throttle and dirty limit in force, which the session lifts when it concludes, however it
//! ends.

#![forbid(unsafe_code)]

/// The convergence state of a session.
#[derive(Debug, Default)]
pub(super) struct Convergence {
    /// Passes in a row that dirtied more than half of what they sent (`policy::stall_count`).
    pub(super) stalled_passes: u32,
    /// The auto-converge throttle in force, percent; lifted when the session concludes.
    pub(super) throttle: u8,
    /// The per-vCPU dirty limit in force, bytes per second; lifted when the session
    /// concludes.
    pub(super) dirty_limit: Option<u64>,
}
