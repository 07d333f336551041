//! What state a VM is in, and why it stopped: plain values the API serves.

#![forbid(unsafe_code)]

use serde::Serialize;

/// Why a VM stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum StopReason {
    /// The guest halted; the text is its stated reason when it gave one.
    GuestHalted(String),
    /// Someone asked (API, Ctrl-C, the owning program).
    Requested(String),
    /// The VM cannot go on: triple fault, KVM error, unknown exit. Holds the explanation and
    /// a register dump.
    Failed(String),
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::GuestHalted(why) => write!(f, "guest halted ({why})"),
            StopReason::Requested(who) => write!(f, "stopped on request ({who})"),
            StopReason::Failed(why) => write!(f, "VM failed: {why}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// An empty VM readying itself for a migration before it listens (populating its RAM):
    /// a state the API reports, never one the VM is told to be in.
    Preparing,
    /// An empty VM waiting for (or receiving) a migration; no vCPU has run.
    Incoming,
    Running,
    Paused,
    Stopped,
}
