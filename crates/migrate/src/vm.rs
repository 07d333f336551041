//! What a VMM implements to be migrated by ferry: [`SourceVm`] on the sending side,
//! [`DestinationVm`] on the receiving side. Device state travels as opaque, versioned
//! [`Section`]s the VMM encodes and validates itself.
//!
//! Methods a VMM cannot support return [`VmError::Unsupported`]; the engine never assumes a
//! silent success.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use crate::bitmap::DirtyBitmap;
use crate::ram::RamRegion;
use crate::state_part::StatePart;
use crate::stats::VcpuDirty;
use crate::wire::{LocalRegion, SectionHeader, SectionId};

/// A device's open file handed over with guest RAM in a local handover (a disk's image, a
/// tap): named by the device's state section, `id` and `instance`, as its state travels, so
/// that the engine carries it without knowing what the device is.
#[derive(Debug)]
pub struct DeviceFd {
    pub id: SectionId,
    pub instance: u32,
    /// The same open file description as the source device's (a `dup`, not a reopen): its
    /// offset and status flags (`O_DIRECT`, `O_APPEND`) are shared by both processes.
    pub fd: OwnedFd,
}

/// A region of guest RAM that lies in a file at a page-aligned offset: what a mapped restore
/// asks a VMM to map ([`DestinationVm::map_file`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileRegion {
    pub gpa: u64,
    pub size: u64,
    /// Where the region's first page lies in the file, a multiple of the page size.
    pub file_offset: u64,
}

/// A piece of non-RAM state: a vCPU, a device, the VM clock. The VMM chooses the id and
/// version and encodes the data; the engine carries it, bounded, and never looks inside.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub id: SectionId,
    /// Which of several sections with the same id this is (vCPU 3); 0 for a single one.
    pub instance: u32,
    pub version: u32,
    pub data: Vec<u8>,
}

impl Section {
    /// The header that precedes the data on the wire.
    pub fn header(&self) -> SectionHeader {
        SectionHeader {
            id: self.id,
            instance: self.instance,
            version: self.version,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{operation} is not supported by this VMM")]
    Unsupported { operation: &'static str },
    #[error("{operation} failed: {source}")]
    Failed {
        operation: &'static str,
        /// The VMM's own error, typed as it made it.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl VmError {
    /// `operation` failed with `source` (a VMM's typed error, or a message of its own).
    pub fn failed(
        operation: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> VmError {
        VmError::Failed {
            operation,
            source: source.into(),
        }
    }
}

/// The sending side of a migration.
///
/// # Safety
///
/// [`SourceVm::ram`] must describe mappings that are readable for as long as the value
/// lives, each backed by `fd` at `file_offset` (open for as long, or -1 for a region with no
/// file, which a local handover refuses), so that the engine may read guest memory through
/// them while the guest runs, and hand the files to a local destination.
pub unsafe trait SourceVm: Send {
    /// Guest RAM.
    fn ram(&self) -> Vec<RamRegion>;

    /// Starts dirty tracking with an empty log: every page written after this returns, by the
    /// guest or by the VMM itself, is in a later [`SourceVm::fetch_dirty`]; what was written
    /// before is not (pass 1 reads every populated page after this call, so it sees those
    /// writes). Its cost should follow the memory the guest has populated, not the memory it
    /// is configured with: pass 1 walks only populated memory, and nothing else in the
    /// engine touches the rest. A VMM whose tracking of a page starts only when the page is
    /// armed ([`SourceVm::arm_dirty`]) may return before anything is tracked.
    fn start_dirty_log(&mut self) -> Result<(), VmError>;

    /// Pass 1 is about to look for populated pages in `[gpa, gpa + len)` and read them: a VMM
    /// whose dirty tracking starts without watching pages (KVM's
    /// `KVM_DIRTY_LOG_INITIALLY_SET`, which spares the guest the stall of write-protecting all
    /// its memory at once) starts watching these now, so that a write after this call is in a
    /// later fetch, and the next fetch does not report them for the log's start. Pass 1 arms
    /// the slices that hold data, in address order, each once, before it reads them; the
    /// next [`SourceVm::fetch_dirty`] must report what was never armed and may have been
    /// written (its populated pages), as the VMM cannot tell. A VMM whose tracking starts
    /// whole keeps this default, and the engine stops asking.
    fn arm_dirty(&mut self, gpa: u64, len: u64) -> Result<(), VmError> {
        let _ = (gpa, len);
        Err(VmError::Unsupported {
            operation: "arming dirty tracking a range at a time",
        })
    }

    /// Fetch-and-clear: ORs into `into` every page written since tracking started or the
    /// last fetch, by the guest or by the VMM itself, and re-arms tracking for them. A VMM may
    /// report more (a page it cannot tell was written, such as one populated while it did not
    /// watch that range), never less.
    fn fetch_dirty(&mut self, into: &mut DirtyBitmap) -> Result<(), VmError>;

    /// Ends dirty tracking (after completion, failure or cancel).
    fn stop_dirty_log(&mut self);

    /// The VM's configuration as the destination must match it (vCPUs, devices, CPU
    /// features), in bytes of the VMM's own format: sent before anything else, so that a
    /// destination that cannot take the guest refuses before the guest pauses. A VMM that
    /// cannot describe its VM keeps this default, and the destination checks nothing.
    fn config(&self) -> Result<Vec<u8>, VmError> {
        Err(VmError::Unsupported {
            operation: "describing the VM's configuration",
        })
    }

    /// A local handover ([`crate::wire::Capabilities::LOCAL_DEVICES`] granted): the open
    /// files of devices that the destination's devices take over instead of opening them
    /// again (a disk's image: the file, whatever became of its path), each named as its
    /// device's state section is. Asked once guest RAM is adopted, while the guest still runs
    /// here; the descriptors go before the pause, and the destination uses them only once the
    /// state is loaded, so a device with one writer keeps one writer: this side stops at the
    /// pause, the other starts after the load. A VMM that passes none keeps this default (its
    /// destination opens its devices' files itself).
    fn device_fds(&self) -> Result<Vec<DeviceFd>, VmError> {
        Err(VmError::Unsupported {
            operation: "passing devices' descriptors in a local handover",
        })
    }

    /// Stops the vCPUs; returns once none runs guest code.
    fn pause(&mut self) -> Result<(), VmError>;

    fn resume(&mut self) -> Result<(), VmError>;

    /// All non-RAM state, taken while paused.
    fn save_state(&mut self) -> Result<Vec<Section>, VmError>;

    /// Where the last [`SourceVm::save_state`] spent its time, part by part (a vCPU, a
    /// device), for the downtime breakdown. A VMM that does not time its parts keeps this
    /// default.
    fn state_parts(&self) -> Vec<StatePart> {
        Vec::new()
    }

    /// Slows the guest down for auto-converge: every vCPU spends `percent` (0..=99) of its
    /// time asleep, in slices short enough that the guest sees a slower CPU rather than
    /// pauses (QEMU sleeps a vCPU `percent / (100 - percent)` of every 10 ms it runs). 0
    /// lifts it. The engine lifts it when the migration ends, however it ends.
    ///
    /// A VMM that cannot throttle keeps this default; the engine then turns auto-converge off
    /// for that migration and says so.
    fn set_throttle(&mut self, percent: u8) -> Result<(), VmError> {
        let _ = percent;
        Err(VmError::Unsupported {
            operation: "throttling the vCPUs",
        })
    }

    /// Caps each vCPU's dirty rate at `bytes_per_s` (`None` lifts the cap): a vCPU that
    /// dirties memory faster sleeps in proportion, and the others run freely. The engine sets
    /// it when asked to (`SourceParams::dirty_limit`) or when auto-converge slows the guest
    /// by dirty limit ([`crate::ConvergeBy::DirtyLimit`]), and lifts it when the migration
    /// ends, however it ends.
    ///
    /// A VMM that cannot tell which vCPU dirtied a page keeps this default; a migration asked
    /// for a dirty limit then fails before it starts, and auto-converge falls back to its
    /// throttle.
    fn set_dirty_limit(&mut self, bytes_per_s: Option<u64>) -> Result<(), VmError> {
        let _ = bytes_per_s;
        Err(VmError::Unsupported {
            operation: "a per-vCPU dirty limit",
        })
    }

    /// What each vCPU dirtied since dirty tracking started, and how long a dirty limit made
    /// it sleep, where the VMM can tell (empty where it cannot).
    fn vcpu_dirty(&self) -> Vec<VcpuDirty> {
        Vec::new()
    }

    /// Iterative state: the state of devices too large to send in the pause (a disk's blocks
    /// not on shared storage, a device with megabytes of its own), sent in chunks while the
    /// guest runs, as RAM is. Called once the destination agreed to take it
    /// ([`crate::wire::Capabilities::ITERATIVE_STATE`]), after dirty tracking started. From
    /// this call until [`SourceVm::end_state_iteration`], [`SourceVm::save_state`] leaves out
    /// what chunks carry, and a part that changes after its chunk went out is offered again
    /// by [`SourceVm::next_state_chunk`]. Returns the bytes to send (none was sent yet).
    ///
    /// A VMM without such state keeps this default, and its state goes in the pause as
    /// sections.
    fn start_state_iteration(&mut self) -> Result<u64, VmError> {
        Err(VmError::Unsupported {
            operation: "iterative device state",
        })
    }

    /// The next chunk of iterative state that changed since it was sent, or was never sent,
    /// as a section of at most `max_bytes` of data (the device on the destination gives it its
    /// meaning); `None` when nothing is pending now. While the guest is paused (the final
    /// pass), the engine takes chunks until `None`: what is left then is all of it.
    fn next_state_chunk(&mut self, max_bytes: usize) -> Result<Option<Section>, VmError> {
        let _ = max_bytes;
        Err(VmError::Unsupported {
            operation: "iterative device state",
        })
    }

    /// Bytes of iterative state pending (changed or never sent), for what is left to send and
    /// the switchover decision.
    fn pending_state_bytes(&self) -> Result<u64, VmError> {
        Err(VmError::Unsupported {
            operation: "iterative device state",
        })
    }

    /// How much iterative state the pause could carry now: the measured bandwidth times the
    /// downtime limit, given after every pass while an iteration runs. A device that can hold
    /// back what changes it (a disk that makes the guest's writes wait for their chunks, as
    /// QEMU's write-blocking mirror) keeps what it has pending well within this, so that the
    /// switchover comes however fast the guest changes it. The default ignores it.
    fn state_allowance(&mut self, bytes: u64) {
        let _ = bytes;
    }

    /// The migration ended, however it ended: [`SourceVm::save_state`] holds all of the state
    /// again. Called only after [`SourceVm::start_state_iteration`] succeeded.
    fn end_state_iteration(&mut self) {}

    /// Free page hinting (virtio-balloon's `FREE_PAGE_HINT`): asks the guest for a new round
    /// of hints, ranges of memory it does not use. The engine calls it only after dirty
    /// tracking started for all of RAM, so that a hinted page the guest writes again is
    /// in the dirty log. Hints of an earlier round that were never taken must be dropped here,
    /// not handed out later: the guest may have reused those pages before tracking started. A
    /// VMM without a balloon, or whose guest has no driver for it, keeps this default: the
    /// migration then sends every page, as without hints.
    fn start_hints(&mut self) -> Result<(), VmError> {
        Err(VmError::Unsupported {
            operation: "free page hinting",
        })
    }

    /// Ends the round: a hint the guest gives after this returns is dropped, never handed to
    /// [`SourceVm::take_hints`]. The engine calls it before every dirty sync, so no hint is
    /// applied after a sync that may have fetched a write made after it.
    fn stop_hints(&mut self) -> Result<(), VmError> {
        Err(VmError::Unsupported {
            operation: "free page hinting",
        })
    }

    /// Moves the hints received since the last call into `into`, as `(gpa, bytes)` ranges.
    fn take_hints(&mut self, into: &mut Vec<(u64, u64)>) -> Result<(), VmError> {
        let _ = into;
        Err(VmError::Unsupported {
            operation: "free page hinting",
        })
    }

    /// The migration no longer needs hints, however it ended: the guest may use the pages it
    /// hinted again (virtio's `DONE`). Called while the guest is paused before its state is
    /// saved, so the destination's guest is told too, and when a migration fails or is
    /// cancelled.
    fn finish_hints(&mut self) -> Result<(), VmError> {
        Err(VmError::Unsupported {
            operation: "free page hinting",
        })
    }
}

/// How the destination writes received pages into guest RAM. The VMM chooses, because only it
/// knows whether its RAM is populated; the two differ by 1.4–1.7x in opposite directions.
///
/// Measured on the project's machine (2 cores, nested KVM), one loopback TCP stream into a
/// 1 GiB memfd, 2 MiB records, per 4 KiB page, in the same run:
///
/// | RAM                        | `Mapping` (readv)      | `File` (read + pwrite) |
/// |----------------------------|------------------------|------------------------|
/// | never touched (sparse)     | 5.6–7.3 µs, 1.0–1.7 s/GiB | 4.0–4.2 µs, 0.7 s/GiB |
/// | populated (`--prealloc`)   | 1.7–1.8 µs, 0.2 s/GiB  | 2.2–2.9 µs, 0.45 s/GiB |
///
/// (`splice` socket → pipe → memfd measured 4.5 µs into fresh and 3.2 µs into populated
/// memory: no better than `pwrite`, and it needs a pipe per channel and raw socket fds.)
/// `ferry bench ingest` measures these references and both landings in a real migration of
/// 4 GiB of data: into populated RAM `Mapping` took in 1075 MB/s at 0.23 CPU-s/GiB against
/// `File`'s 568 MB/s at 0.49 (2 channels). Into sparse RAM the channel count decides: one
/// channel lands faster through the file (605 against 486 MB/s in one run), but with 2 and 4
/// channels the mapping wins (893 against 596 and 1084 against 648 MB/s, at 1.9 against 2.5
/// and 1.4 against 2.2 CPU-s/GiB), because a write to a shmem file holds the file's inode lock
/// (`shmem_file_write_iter`), so parallel receivers' `pwrite`s take turns while their page
/// faults on the mapping do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageLanding {
    /// Read from the socket straight into the mapped pages (`readv`, no intermediate copy).
    /// For populated RAM: the copy is the only cost left. Into never-touched RAM every page
    /// takes a page fault inside the copy, the slowest way to allocate it.
    Mapping,
    /// Read a record into a per-channel buffer, then `pwrite` it to the backing file at the
    /// pages' offsets. For sparse RAM: the file allocates the page without a fault on the
    /// mapping, which costs more than the extra copy saves. Needs each region's `fd` to be the
    /// file behind its mapping (the trait's contract).
    File,
}

/// The receiving side of a migration.
///
/// # Safety
///
/// [`DestinationVm::ram`] must describe mappings that are readable and writable for as long as
/// the value lives, each backed by `fd` at `file_offset` (written through the file with
/// [`PageLanding::File`]: its bytes must be the mapping's), and no vCPU may run before
/// [`DestinationVm::resume`].
pub unsafe trait DestinationVm: Send {
    fn ram(&self) -> Vec<RamRegion>;

    /// How received pages should land in [`DestinationVm::ram`] when `channels` data channels
    /// receive in parallel: [`PageLanding::Mapping`] when the RAM is populated (preallocated)
    /// or several channels write, [`PageLanding::File`] for one channel into sparse RAM (see
    /// [`PageLanding`] for the measurements). Asked once per migration, when its data channels
    /// start.
    fn page_landing(&self, channels: u16) -> PageLanding;

    /// Whether this VM can take a guest from a VM configured as `config` (the source's
    /// [`SourceVm::config`]): `Err` with a message that names what differs and how to start
    /// this VM instead. Called before the migration's hello is answered. A VMM that cannot
    /// compare keeps this default, which accepts: the state load still refuses what it cannot
    /// take, but only after the source paused.
    fn check_config(&self, config: &[u8]) -> Result<(), VmError> {
        let _ = config;
        Ok(())
    }

    /// A local handover ([`crate::wire::Capabilities::LOCAL`], a source on this host): maps
    /// the source's guest RAM, laid out as `regions`, from the files in `fds` (a region's `fd`
    /// indexes it) in place of this VM's own RAM, while the source's guest still runs there;
    /// afterwards [`DestinationVm::ram`] describes the adopted memory. Refuse (with the flag
    /// that fixes it) a layout this VM's configuration does not match, and a file that does
    /// not hold every region (mapping past its end would fault when the guest touches it).
    ///
    /// Until the engine resumes the guest here, the memory is the source's: nothing may write
    /// it (a state load that wrote guest RAM would change a guest the source may resume). If
    /// the session fails, the source runs its guest on in that memory: the VMM must never
    /// receive another migration into this VM, or run it; the engine does neither. A VMM that
    /// cannot adopt memory keeps this default, and a local handover to it is refused before the
    /// source pauses.
    fn adopt_ram(&mut self, regions: &[LocalRegion], fds: Vec<OwnedFd>) -> Result<(), VmError> {
        let _ = (regions, fds);
        Err(VmError::Unsupported {
            operation: "adopting the source's guest RAM (a local handover)",
        })
    }

    /// A mapped restore (`snapshot::Loading::Mapped`): makes guest RAM, laid out as `regions`,
    /// a private (copy-on-write) mapping of `file` at each region's offset, in place of this
    /// VM's own RAM, so the guest reads the file's pages (through the page cache, shared with
    /// every other mapping of the file) and its writes stay its own. `file` is open read-only;
    /// keep a duplicate if the VM needs it later. Refuse a layout this VM's configuration
    /// does not match, and a file that does not hold every region. Called before the state
    /// is loaded, on a VM that never ran. A VMM that cannot map its RAM from a file keeps
    /// this default, and a mapped restore into it is refused before anything is loaded.
    fn map_file(&mut self, file: BorrowedFd<'_>, regions: &[FileRegion]) -> Result<(), VmError> {
        let _ = (file, regions);
        Err(VmError::Unsupported {
            operation: "mapping guest RAM from a snapshot file (a mapped restore)",
        })
    }

    /// Whether this VM's devices take the source's descriptors in a local handover
    /// ([`DestinationVm::adopt_device_fds`]): asked before the hello is answered, and
    /// [`crate::wire::Capabilities::LOCAL_DEVICES`] is granted only if so. A VMM whose devices
    /// open their own files keeps this default, and the source passes nothing.
    fn takes_device_fds(&self) -> bool {
        false
    }

    /// The source's device descriptors ([`SourceVm::device_fds`]), after guest RAM was
    /// adopted and before any device state: keep them for the devices they name, and use
    /// them only from [`DestinationVm::load_state`] on (until then the source's guest may
    /// still write through them, and resumes there if the handover fails). Refuse a
    /// descriptor no device of this VM takes, or one of the wrong kind of file. Called only
    /// when [`DestinationVm::takes_device_fds`] said so.
    fn adopt_device_fds(&mut self, fds: Vec<DeviceFd>) -> Result<(), VmError> {
        let _ = fds;
        Err(VmError::Unsupported {
            operation: "taking devices' descriptors in a local handover",
        })
    }

    /// Loads all non-RAM state; refuses a section it does not know or cannot validate. With
    /// iterative state, what the chunks carried is loaded already
    /// ([`DestinationVm::load_state_chunk`]); the sections hold the rest.
    fn load_state(&mut self, sections: &[Section]) -> Result<(), VmError>;

    /// A chunk of iterative state ([`SourceVm::next_state_chunk`]), in the order sent, while
    /// the guest still runs on the source: a later chunk of the same part replaces an
    /// earlier one. Refuse a chunk no device of this VM takes, or one it cannot validate.
    fn load_state_chunk(&mut self, chunk: &Section) -> Result<(), VmError> {
        let _ = chunk;
        Err(VmError::Unsupported {
            operation: "iterative device state",
        })
    }

    /// Whether the devices that take chunks are ready for the switchover (QEMU's
    /// switchover-ack): asked after each chunk; once it says so, the source may pause its
    /// guest. A VMM without iterative state keeps this default, and the capability is not
    /// offered (a source whose VM has such state then sends it in the pause as sections).
    fn state_ready(&self) -> Result<bool, VmError> {
        Err(VmError::Unsupported {
            operation: "iterative device state",
        })
    }

    /// Starts the guest. Returns how long starting took (part of the downtime breakdown).
    fn resume(&mut self) -> Result<Duration, VmError>;

    /// Where the last [`DestinationVm::load_state`] and [`DestinationVm::resume`] spent their
    /// time, part by part, for the downtime breakdown (sent to the source in Resumed; at
    /// most [`crate::wire::MAX_STATE_PARTS`], names of at most
    /// [`crate::wire::MAX_PART_NAME`] bytes). A VMM that does not time its parts keeps this
    /// default.
    fn state_parts(&self) -> Vec<StatePart> {
        Vec::new()
    }

    /// A postcopy migration failed after [`DestinationVm::resume`]: pages the guest has not
    /// received will never come, so the VM must stop for good, with `why` as its reason. vCPUs
    /// blocked on a missing page stay blocked (the engine keeps the userfaultfd open so that
    /// they never read zeros instead); the VMM marks the VM failed and stops the others.
    fn abandon(&mut self, why: &str);
}
