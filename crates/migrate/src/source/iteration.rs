//! A session's iterative device state, as a value: what is pending, and what went. How the
//! session starts, sends and ends it is in `iterate.rs`.

#![forbid(unsafe_code)]

/// A session's iterative state: what is pending, and what went.
#[derive(Debug, Default)]
pub(super) struct Iteration {
    /// Bytes pending when last asked (at the end of the last pass): changed or never sent.
    /// While the guest runs, a pass sends at most this much.
    pub(super) pending: u64,
    /// Bytes sent in this pass so far, beside its pages.
    pub(super) pass_sent: u64,
    /// Chunks sent, and their data bytes.
    pub(super) chunks: u64,
    pub(super) bytes: u64,
}
