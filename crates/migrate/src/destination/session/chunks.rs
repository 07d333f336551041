//! Iterative device state on the destination: each StateChunk is loaded into the VM as it
//! comes, while the guest still runs on the source, and once the VM says its devices are
//! ready for the switchover the acknowledger tells the source (StateReady), once.

#![forbid(unsafe_code)]

use super::Session;
use crate::error::MigrateError;
use crate::vm::Section;
use crate::wire::SectionHeader;

impl Session<'_> {
    /// Loads the StateChunk record's `payload` (a section header and the chunk), then asks
    /// the VM whether it is ready for the switchover, until it first says so.
    pub(super) fn load_chunk(&mut self, payload: &[u8]) -> Result<(), MigrateError> {
        let (h, data) = SectionHeader::decode(payload)?;
        let chunk = Section {
            id: h.id,
            instance: h.instance,
            version: h.version,
            data: data.to_vec(),
        };
        self.vm.load_state_chunk(&chunk)?;
        self.stats.state_chunks += 1;
        self.stats.state_chunk_bytes += chunk.data.len() as u64;
        self.check_state_ready()
    }

    /// After a chunk, and at every pass end (a device may get ready with no chunk coming):
    /// asks the VM whether its devices are ready for the switchover, until it first says so.
    pub(super) fn check_state_ready(&mut self) -> Result<(), MigrateError> {
        if self.stats.state_chunks > 0 && !self.control.state_ready() && self.vm.state_ready()? {
            self.control.say_state_ready();
        }
        Ok(())
    }
}
