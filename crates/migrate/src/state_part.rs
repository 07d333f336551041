//! One timed part of a device state save or load: what the source's VMM reports, the Resumed
//! record carries back from the destination ([`crate::wire`]) and the figures keep
//! ([`crate::stats`]). Plain data, below both.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// One part of a VMM's state save or load: a vCPU, a device, the VM clock, or a step of its
/// own (creating vCPUs, waking their threads), named by the VMM.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatePart {
    pub name: String,
    pub ms: f64,
    /// Bytes of state it saved or loaded (0 for a step).
    pub bytes: u64,
}
