//! The guest's free memory (`free=`) and its balloon driver as the telemetry shows them: the
//! words of its latest heartbeat that carry them, in 2 MiB blocks.

use ferry_guest_abi::report;
use serde::Serialize;

/// The guest's free memory (`free=`) and balloon driver, from its latest heartbeat, in 2 MiB
/// blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuestFreeMemory {
    /// Hint rounds the guest's driver answered, and blocks it hinted over all of them.
    pub hint_rounds: u32,
    pub blocks_hinted: u32,
    /// Blocks held after hinting until the host says DONE.
    pub blocks_held: u32,
    /// Blocks given to the host by inflating the balloon.
    pub blocks_ballooned: u32,
    pub blocks_free: u32,
    /// Blocks the churn workload holds now, and has written, verified and freed so far.
    pub blocks_in_use: u32,
    pub blocks_churned: u64,
}

impl GuestFreeMemory {
    pub(super) fn from_heartbeat(d: &[u64; report::DETAIL_WORDS]) -> GuestFreeMemory {
        use report::heartbeat::*;
        let hi = |w: u64| (w >> 32) as u32;
        let lo = |w: u64| w as u32;
        GuestFreeMemory {
            hint_rounds: hi(d[HINTS]),
            blocks_hinted: lo(d[HINTS]),
            blocks_held: lo(d[HELD_BALLOONED]),
            blocks_ballooned: hi(d[HELD_BALLOONED]),
            blocks_free: lo(d[FREE_USED]),
            blocks_in_use: hi(d[FREE_USED]),
            blocks_churned: d[CHURNED],
        }
    }
}
