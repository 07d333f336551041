//! A live snapshot: a migration session whose target is a file (`FileTarget`, `target.rs`). The transfer
//! core is the migration's (pass 1 over populated memory, dirty passes decided by the same
//! policy, auto-converge, free page hints, the pause and the final pass, the statistics and
//! [`Control`]); the file agrees to precopy alone, takes pages through its writer threads, and
//! takes the device state once the guest runs again (`source/keep.rs`).
//!
//! Invariants:
//! - The guest resumes after a failure or a cancel whatever the phase, and after a success
//!   unless [`SaveParams::after`] is [`AfterSave::Stop`]; the throttle is lifted and dirty
//!   logging stopped either way.
//! - Nothing that reads as a snapshot exists until the state, the hot set and the CRC table are
//!   on disk (`Writer::finish`); a failed save removes its `.partial` file (the Writer's drop),
//!   and the file lands only where [`FileOptions::replace`] allows.

#![forbid(unsafe_code)]

use std::path::Path;

use super::file::{FileOptions, Writer};
use super::target::{AfterSave, BATCH_PAGES, FileTarget};
use crate::control::{Control, Phase};
use crate::error::MigrateError;
use crate::policy::Policy;
use crate::ram::Ram;
use crate::source::{self, SourceParams};
use crate::stats::MigrationStats;
use crate::vm::{SourceVm, VmError};

/// The default [`SaveParams::staging_limit`]: 256 MiB. A guest that dirtied more than this
/// since the last pass would have its pause set by the file's rate anyway (at 1-2 GB/s of page
/// cache, 128-256 ms), and a snapshot must not double the VMM's memory (issue 48: a 2 GiB guest
/// writing 1.5 GiB flat out took the VMM from 1,544 to 3,097 MiB with an unbounded stage).
pub const DEFAULT_STAGING_LIMIT: u64 = 256 << 20;

/// How to save.
#[derive(Clone, Debug)]
pub struct SaveParams {
    /// Threads writing pages into the file at once.
    pub writers: u16,
    /// When to stop iterating and pause (the migration's policy; its bandwidth is the rate
    /// the file took the last pass at).
    pub policy: Policy,
    /// The VM's vCPU count, recorded in the header (a restore refuses a VM with another).
    pub vcpus: u32,
    /// The snapshot's identity, recorded in the header.
    pub uuid: [u8; 16],
    /// Whether the guest runs on once the snapshot is complete. A failed or cancelled save
    /// resumes it whatever this says.
    pub after: AfterSave,
    /// Most memory the final pass is staged in before it is written ([`DEFAULT_STAGING_LIMIT`]);
    /// the rest of the final pass is written to the file during the pause.
    pub staging_limit: u64,
    /// How the file is created: direct I/O (the file system must allow it), its mode, what
    /// it may replace.
    pub file: FileOptions,
}

impl SaveParams {
    /// The session's parameters: the migration's defaults, with the writers as its channels
    /// and the largest batches.
    fn session(&self) -> SourceParams {
        SourceParams {
            channels: self.writers,
            packet_pages: BATCH_PAGES as u32,
            peer_timeout: None,
            ..SourceParams::new(self.policy, self.uuid)
        }
    }
}

/// Saves `vm` into a snapshot at `path` while it runs; returns the statistics, as a migration
/// does (the downtime is the pause the guest saw). See the module doc for what a failure
/// leaves.
pub fn save(
    vm: &mut dyn SourceVm,
    path: &Path,
    params: &SaveParams,
    control: &Control,
) -> Result<MigrationStats, MigrateError> {
    let session = params.session();
    match open(vm, path, params, &session, control) {
        Ok(target) => source::keep::keep(vm, target, &session, control),
        Err(e) => {
            control.update(|p| {
                p.phase = Phase::Failed;
                p.error = Some(e.to_string());
            });
            Err(e)
        }
    }
}

/// Checks the parameters, creates the file and starts its writers.
fn open<'c>(
    vm: &mut dyn SourceVm,
    path: &Path,
    params: &SaveParams,
    session: &SourceParams,
    control: &'c Control,
) -> Result<FileTarget<'c>, MigrateError> {
    session.check()?;
    let config = match vm.config() {
        Ok(c) => c,
        Err(VmError::Unsupported { .. }) => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    let ram = Ram::new(vm.ram())?;
    let writer = Writer::create(
        path,
        params.vcpus,
        params.uuid,
        &ram.layout(),
        &config,
        &params.file,
    )?;
    FileTarget::start(
        ram,
        writer,
        params.writers,
        params.after,
        params.staging_limit,
        control,
    )
}
