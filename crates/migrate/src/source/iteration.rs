//! A session's iterative device state, as a value: what is pending, and what went. How the
//! session starts, sends and ends it is in `iterate.rs`.

#![forbid(unsafe_code)]

/// A session's iterative state: what is pending, and what went.
#[derive(Debug, Default)]
pub(super) struct Iteration {
    /// Bytes pending when last asked: changed or never sent.
    pub(super) pending: u64,
    /// Chunks sent, and their data bytes.
    pub(super) chunks: u64,
    pub(super) bytes: u64,
}
