//! The destination's half: [`ferry_migrate::DestinationVm`] on an [`IncomingVm`], and
//! [`receive`], which waits for a source and takes its guest while RAM is held as arriving.

use std::time::{Duration, Instant};

use ferry_migrate::destination::{self, ReceiveStats};
use ferry_migrate::ram::RamRegion;
use ferry_migrate::transport::Listener;
use ferry_migrate::{DestinationVm, MigrateError, PageLanding, Section, VmError};

use super::regions::ram_regions;
use crate::sections;
use crate::vm::Arrival;
use crate::vm::build::IncomingVm;
use crate::vm::state::StopReason;

// SAFETY: as for SourceAdapter: the mappings live as long as `shared`; the vCPU thread is not
// started before `resume`, so nothing runs while the engine writes guest memory; `fd` is the
// read-write memfd the mappings are made from, so pages written through it show in them. A
// mapped restore (`map_file`) ends that: RAM is then the snapshot file's, and the engine's
// restore writes none of it; the VM it makes is never a destination, and its outgoing copies
// are refused (`StartError::Mapped`), so no one is handed the memfd as RAM's file after it.
unsafe impl DestinationVm for IncomingVm {
    fn check_config(&self, config: &[u8]) -> Result<(), VmError> {
        self.shared
            .description
            .accepts(config)
            .map_err(|m| VmError::failed("check the source VM's configuration", m))
    }

    fn ram(&self) -> Vec<RamRegion> {
        ram_regions(&self.shared.ram)
    }

    /// The source's memfd mapped over this VM's RAM (`GuestRam::adopt`): KVM's slots and the
    /// devices keep their addresses, and the vCPUs, created when this VM was, wait for the
    /// state.
    fn adopt_ram(
        &mut self,
        regions: &[ferry_migrate::wire::LocalRegion],
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(), VmError> {
        let shared = &self.shared;
        let t = Instant::now();
        // Most of the time is KVM's: its MMU notifier walks the slots' reverse maps as the old
        // mapping goes, about 0.38 ms per GiB here (195 ms at 508 GiB, where the same
        // replacement without KVM takes 0.01 ms), before the source pauses. Taking the slots
        // out and back in instead measured 752 ms at 511 GiB (their metadata made anew).
        shared
            .ram
            .adopt(regions, fds)
            .map_err(|e| VmError::failed("adopting the source's guest RAM", e))?;
        tracing::debug!(
            "adopted {} of guest RAM in {:.2} ms",
            crate::memory::Size(shared.ram.size()),
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// A mapped restore: the snapshot file mapped copy-on-write over this VM's RAM
    /// (`memory/mapped.rs`), as `adopt_ram` maps a memfd.
    fn map_file(
        &mut self,
        file: std::os::fd::BorrowedFd<'_>,
        regions: &[ferry_migrate::FileRegion],
    ) -> Result<(), VmError> {
        let t = Instant::now();
        self.shared
            .ram
            .map_file(file, regions)
            .map_err(|e| VmError::failed("mapping guest RAM from the snapshot", e))?;
        tracing::debug!(
            "mapped {} of guest RAM from the snapshot in {:.2} ms",
            crate::memory::Size(self.shared.ram.size()),
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// The disk takes the source's open image in a local handover (`vm/disk.rs`).
    fn takes_device_fds(&self) -> bool {
        self.shared.disk.is_some() || self.shared.net.is_some()
    }

    /// Kept for the state load, which attaches the disk from it (`Block::pass_image`).
    fn adopt_device_fds(&mut self, fds: Vec<ferry_migrate::DeviceFd>) -> Result<(), VmError> {
        self.shared.adopt_device_fds(fds)
    }

    /// Preallocated RAM, or several channels, take a copy into the mapping; one channel into
    /// sparse RAM writes through the memfd (measured in `PageLanding`'s doc).
    fn page_landing(&self, channels: u16) -> PageLanding {
        self.landing
            .unwrap_or_else(|| match self.shared.ram.host_pages() {
                // hugetlbfs has no write(): huge pages land through the mapping.
                crate::memory::HostPages::Huge2M => PageLanding::Mapping,
                crate::memory::HostPages::Small => {
                    crate::landing::landing_for(self.shared.ram.is_populated(), channels)
                }
            })
    }

    /// Also opens the disk's image, or takes over the one a local handover passed (the source
    /// has flushed it and stopped writing), and draws
    /// a new VM generation ID for a clone (`Identity::Renewed`), after the state (which
    /// carries the snapshot's) and before the guest runs.
    fn load_state(&mut self, sections: &[Section]) -> Result<(), VmError> {
        let parts =
            sections::load(&self.shared, sections).map_err(|e| VmError::failed("load_state", e))?;
        self.shared.attach_disk()?;
        self.shared
            .attach_net(self.identity == crate::vm::build::Identity::Renewed)?;
        *self.shared.state_parts.lock().unwrap() = parts;
        if self.identity == crate::vm::build::Identity::Renewed {
            self.shared
                .generation
                .lock()
                .unwrap()
                .renew()
                .map_err(|e| VmError::failed("load_state", e))?;
        }
        Ok(())
    }

    /// The chunks of a disk no host shares (`disk_copy`).
    fn load_state_chunk(&mut self, chunk: &Section) -> Result<(), VmError> {
        self.shared.take_disk_chunk(chunk)
    }

    /// A VM with a disk takes a copy of it, and is ready for the switchover once what
    /// arrived of it is nearly all on storage (`vm/disk.rs`); the source counts what is left
    /// of the disk as left to send.
    fn state_ready(&self) -> Result<bool, VmError> {
        match self.shared.disk {
            Some(_) => Ok(self.shared.disk_ready()),
            None => Err(VmError::Unsupported {
                operation: "iterative device state (the VM has no disk)",
            }),
        }
    }

    fn resume(&mut self) -> Result<Duration, VmError> {
        let t = Instant::now();
        let step = self.start().map_err(|e| VmError::failed("resume", e))?;
        let took = t.elapsed();
        self.shared.announce(self.announce);
        self.shared
            .state_parts
            .lock()
            .unwrap()
            .push(ferry_migrate::StatePart {
                name: step.into(),
                ms: took.as_secs_f64() * 1e3,
                bytes: 0,
            });
        Ok(took)
    }

    fn state_parts(&self) -> Vec<ferry_migrate::StatePart> {
        self.shared.state_parts.lock().unwrap().clone()
    }

    fn abandon(&mut self, why: &str) {
        self.handle().stop(StopReason::Failed(format!(
            "postcopy failed after the guest resumed here, so its memory is incomplete: {why}"
        )));
    }
}

/// Waits for a source on `listener` while `keep_waiting()` says so (and until the VM's
/// incoming control is cancelled), screening every connection, then receives the migration
/// into `vm`, which runs afterwards. Until the migration has ended its RAM is arriving
/// (`vm/holds.rs`): no outgoing copy starts and the balloon gives no page back to the host (in
/// postcopy a page punched out of guest RAM would be a hole the guest faults on and the source
/// is asked for).
pub fn receive(
    vm: &mut IncomingVm,
    listener: &dyn Listener,
    keep_waiting: &dyn Fn() -> bool,
) -> Result<ReceiveStats, MigrateError> {
    let control = vm.control();
    let shared = vm.shared.clone();
    let _arriving = shared.holds.arrival(Arrival::IncomingMigration);
    destination::listen(vm, listener, &control, keep_waiting)
}
