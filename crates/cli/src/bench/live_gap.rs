//! The live guest of `ferry bench snapshot` (8 GiB, 4 GiB of random data, a hot 1 GiB of it
//! written at 400 MB/s) migrated over loopback with the same 20 ms downtime limit: the
//! longest write batch the guest timed across the migration, against the longest it timed
//! before. Issue 52's goal holds both a live save's and a migration's longest gap to 20 ms,
//! and the dirty log's start is shared by both. `FERRY_DIRTY_LOG_START=write-protect` in the
//! environment runs both the old way (the log's start write-protects all of memory at once),
//! so a shell loop alternates the two in one session.

use std::time::Duration;

use anyhow::Context;
use serde_json::json;

use super::precopy::{DestinationSetup, Finish, Scenario, migrate_into};

/// Migrates `memory` bytes of guest running `cmdline` (the snapshot bench's live guest) and
/// prints its row.
pub(super) fn migration_row(
    memory: u64,
    cmdline: &str,
    rows: &mut Vec<serde_json::Value>,
) -> anyhow::Result<()> {
    let s = Scenario {
        downtime: Duration::from_millis(20),
        finish: Finish::Careful,
        ..Scenario::new("live migration", memory, cmdline, 1)
    };
    let m = migrate_into(&s, DestinationSetup::default()).context("the live migration")?;
    let st = &m.stats;
    let before_ms = m.source_guest[0].max_batch_ns as f64 / 1e6;
    let stall_ms = m.guest.max_batch_ns as f64 / 1e6;
    println!(
        "  live migration     {:>8.0} ms  {} passes, throttle up to {}%, pause {:.1} ms; the guest's longest write batch {:.1} ms (before: {:.1} ms; dirty log start {:.1} ms, longest dirty sync {:.1} ms)",
        st.total_ms,
        st.passes.len(),
        st.throttle_max_percent,
        m.pause_ms,
        stall_ms,
        before_ms,
        st.dirty_start_ms,
        st.max_sync_ms,
    );
    rows.push(
        json!({"bench": "snapshot", "row": "migrate_live", "total_ms": st.total_ms,
        "passes": st.passes.len(), "guest_pause_ms": m.pause_ms, "guest_stall_ms": stall_ms,
        "guest_stall_before_ms": before_ms, "throttle_max": st.throttle_max_percent,
        "dirty_start_ms": st.dirty_start_ms, "max_sync_ms": st.max_sync_ms,
        "dirty_log_start": dirty_log_start()}),
    );
    Ok(())
}

/// How this run's VMs start their dirty log, as the environment chose.
pub(super) fn dirty_log_start() -> &'static str {
    match ferry_vmm::kvm::log_state::LogStart::from_env() {
        ferry_vmm::kvm::log_state::LogStart::AllSet => "all set",
        ferry_vmm::kvm::log_state::LogStart::WriteProtect => "write-protect",
    }
}
