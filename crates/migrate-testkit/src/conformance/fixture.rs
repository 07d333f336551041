//! What a VMM provides to run the suite on itself: its VMs, and what only it can do or see (a
//! write by the VMM itself, writes by the guest, whether a destination's guest runs or has
//! stopped). The engine cannot know any of these; every check reaches the VMM through them.

use std::ops::Range;

use ferry_migrate::{DestinationVm, SourceVm};

/// What a VMM provides to run the suite on itself.
pub trait Fixture {
    type Source: SourceVm;
    type Destination: DestinationVm;

    /// A new running source VM. Its guest may write memory while it runs; the suite pauses it
    /// when it needs quiet. If the VMM hints free pages ([`SourceVm::start_hints`]), its guest
    /// holds some memory free and hints it when asked, so that the check of hinting sees hints
    /// arrive.
    fn source(&mut self) -> Self::Source;

    /// A new destination VM configured as [`Fixture::source`]'s (memory size, vCPUs, devices:
    /// one that can take a source's guest), not started.
    fn destination(&mut self) -> Self::Destination;

    /// Writes `byte` at `gpa` of `vm`'s RAM the way the VMM itself writes guest memory (a
    /// device model, a loader), so that the write must show in `fetch_dirty` while tracking.
    /// Called while `vm` is paused too.
    fn vmm_write(&mut self, vm: &mut Self::Source, gpa: u64, byte: u8);

    /// Lets `vm`'s guest (which the suite has just resumed) write memory by its own means,
    /// vCPUs through the hypervisor for a real VMM, and returns once it has: guest address
    /// ranges at least one of whose pages it wrote. The suite pauses `vm` afterwards, or lets
    /// it write on. The guest writes faster than the engine's lowest dirty limit
    /// ([`DIRTY_LIMIT_FLOOR`](ferry_migrate::policy::DIRTY_LIMIT_FLOOR)), so that a vCPU held
    /// to it is seen to sleep.
    fn guest_writes(&mut self, vm: &mut Self::Source) -> Vec<Range<u64>>;

    /// Returns once `vm`'s guest, which the suite has resumed with a paused source's memory
    /// and state (as a restore does), has run guest code since: for a real VMM, progress its
    /// guest reports. Panics, saying what it waited for, if it sees none within seconds.
    fn destination_runs(&mut self, vm: &mut Self::Destination);

    /// Waits, a few seconds at most, until `vm`'s guest has stopped for good (no vCPU runs
    /// guest code, or will again), and returns the reason the VMM gives its user for it;
    /// `None` if it has not stopped.
    fn destination_stopped(&mut self, vm: &mut Self::Destination) -> Option<String>;
}
