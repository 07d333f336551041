//! The conformance suite (`ferry_migrate_testkit::conformance`) on this VMM over real KVM,
//! twice: with the slots' dirty bitmaps (the default) and with the dirty ring (`dirty_ring`),
//! which is what gives a per-vCPU dirty limit and per-vCPU counts, so that those checks see
//! them work rather than refused. And the regression tests for VMM writes that a migration's
//! dirty pages must include.
//!
//! The "guest" writes are the built-in guest's own: a slow writer over a small working set,
//! seen only through KVM's dirty log (the VMM writes no guest memory while a guest runs). The
//! guest holds some memory free, which its balloon driver hints when asked.

mod common;

use std::ops::Range;
use std::time::Duration;

use common::{TestVm, boot, boot_config, config, require_kvm, wait_for_telemetry};
use ferry_migrate::SourceVm;
use ferry_migrate::bitmap::{Cursor, DirtyBitmap};
use ferry_migrate::wire::PAGE_SIZE;
use ferry_migrate_testkit::conformance::Fixture;
use ferry_vmm::migration::SourceAdapter;
use ferry_vmm::{IncomingVm, Vm};
use vm_memory::{Bytes, GuestAddress};

/// The smallest guest: one RAM region, one KVM memory slot.
const MEMORY: u64 = 64 << 20;
/// A 4 MiB working set dirtied at 4 MB/s (about 1000 pages a second, so a millisecond of
/// running writes a page; four times the engine's lowest dirty limit, which the dirty limit's
/// check sets), never verified, no serial log lines: the guest keeps writing without flooding
/// anything. And 8 MiB filled and freed at boot (four 2 MiB blocks), for the balloon to hint.
const WORKLOAD: &str = "ws=4M rate=4 free=8M verify-ms=0 log-ms=0";
/// With a disk: a 4 MiB image whose first 2 MiB the guest writes at 1 MB/s.
const DISK: u64 = 4 << 20;
const DISK_WORKLOAD: &str = "disk=2M disk-rate=1";
/// Entries of each vCPU's dirty ring in the ring's instantiation: what `ferry run --dirty-ring`
/// suggests; the 1024 pages of the working set fit, so a ring never fills between syncs.
const RING_ENTRIES: u32 = 4096;
/// How long a booted guest may take to report where its working set is.
const BOOT_TIMEOUT: Duration = Duration::from_secs(30);
/// Working-set pages the guest must have written before `guest_writes` returns: a handful,
/// so that a write in flight at the pause cannot be the only one.
const GUEST_PAGES: u64 = 16;
/// How long a destination's guest may take to stop once abandoned: its vCPUs are kicked out of
/// the guest at once, and leave within a scheduling delay.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Boots a guest per source, keeps every VM (and its serial file) alive for the test.
#[derive(Default)]
struct Kvm {
    /// Every VM's dirty ring, entries per vCPU; `None`: the slots' bitmaps.
    dirty_ring: Option<u32>,
    /// Give every VM a disk, and copy it as iterative state.
    disk_copy: bool,
    sources: Vec<TestVm>,
    /// The sources' and destinations' serial logs.
    dirs: Vec<tempfile::TempDir>,
}

impl Kvm {
    fn new() -> Kvm {
        require_kvm();
        Kvm::default()
    }

    fn with_ring() -> Kvm {
        Kvm {
            dirty_ring: Some(RING_ENTRIES),
            ..Kvm::new()
        }
    }

    /// Sources with a disk they copy as iterative state (`disk_copy`), and destinations whose
    /// disk is a new file for the copy.
    fn with_disk_copy() -> Kvm {
        Kvm {
            disk_copy: true,
            ..Kvm::new()
        }
    }

    /// The configuration of every VM of this fixture, with its serial log in a new directory;
    /// with a disk copy, a source's disk is a 4 MiB image there and a destination's a path
    /// there with no file yet.
    fn config(&mut self, cmdline: &str, source: bool) -> ferry_vmm::VmConfig {
        let dir = tempfile::tempdir().unwrap();
        let disk = self.disk_copy.then(|| {
            let path = dir.path().join("disk.img");
            if source {
                std::fs::File::create(&path).unwrap().set_len(DISK).unwrap();
            }
            path.to_str().unwrap().parse().unwrap()
        });
        let c = ferry_vmm::VmConfig {
            dirty_ring: self.dirty_ring,
            disk,
            net: None,
            ..config(MEMORY, cmdline, &dir.path().join("serial.log"))
        };
        self.dirs.push(dir);
        c
    }

    /// The booted VM behind `src`, recognised by its RAM mapping.
    fn vm_of(&self, src: &SourceAdapter) -> &TestVm {
        let host = SourceVm::ram(src)[0].host_addr;
        self.sources
            .iter()
            .find(|t| t.handle().ram().regions()[0].host_addr as usize == host)
            .expect("a source this fixture booted")
    }
}

impl Fixture for Kvm {
    type Source = SourceAdapter;
    type Destination = IncomingVm;

    fn source(&mut self) -> SourceAdapter {
        let workload = match self.disk_copy {
            true => format!("{WORKLOAD} {DISK_WORKLOAD}"),
            false => WORKLOAD.into(),
        };
        let disk_copy = self.disk_copy;
        let t = boot_config(self.config(&workload, true));
        t.wait_for("the working set's layout", BOOT_TIMEOUT, |g| {
            g.layout.is_some()
                && g.pages_written > 0
                && (!disk_copy || g.disk.as_ref().is_some_and(|d| d.blocks_written > 0))
        });
        let src = match self.disk_copy {
            true => t.handle().migration_source_copying_disk(),
            false => t.handle().migration_source(),
        };
        self.sources.push(t);
        src
    }

    fn destination(&mut self) -> IncomingVm {
        let config = self.config("", false);
        Vm::incoming(config).unwrap()
    }

    fn vmm_write(&mut self, vm: &mut SourceAdapter, gpa: u64, byte: u8) {
        self.vm_of(vm).handle().ram().write(gpa, &[byte]).unwrap();
    }

    fn guest_writes(&mut self, vm: &mut SourceAdapter) -> Vec<Range<u64>> {
        let t = self.vm_of(vm);
        let before = t.handle().telemetry().pages_written;
        let g = t.wait_for("the guest writing its working set", BOOT_TIMEOUT, |g| {
            g.pages_written >= before + GUEST_PAGES
        });
        g.layout
            .expect("reported at boot")
            .extents
            .iter()
            .map(|&(frame, pages)| frame * PAGE_SIZE..(frame + pages) * PAGE_SIZE)
            .collect()
    }

    /// The guest reports (a heartbeat every 10 ms) to the destination's VMM.
    fn destination_runs(&mut self, vm: &mut IncomingVm) {
        let h = vm.handle();
        let before = h.telemetry().reports;
        wait_for_telemetry(
            &h,
            "a report from the destination's guest",
            BOOT_TIMEOUT,
            |g| g.reports > before,
        );
    }

    fn destination_stopped(&mut self, vm: &mut IncomingVm) -> Option<String> {
        let stopped = vm.handle().wait_stopped(Some(STOP_TIMEOUT));
        stopped.map(|why| why.to_string())
    }
}

ferry_migrate_testkit::conformance_tests!(Kvm::new());

/// The suite again over the dirty ring.
mod dirty_ring {
    use super::Kvm;

    ferry_migrate_testkit::conformance_tests!(Kvm::with_ring());
}

/// The iterative-state check over a VM whose disk is copied (`disk_copy`): the reference
/// VMM's one user of iterative state. The first source shows the copy is not refused, so the
/// check below cannot pass by its branch for a VM without such state.
#[test]
fn a_copied_disk_is_iterative_state_that_moves() {
    let mut kvm = Kvm::with_disk_copy();
    let mut src = ferry_migrate_testkit::conformance::Fixture::source(&mut kvm);
    let pending = src.start_state_iteration().expect("the disk copy starts");
    assert!(
        pending > 0,
        "the guest wrote its disk: something is to send"
    );
    src.end_state_iteration();
    ferry_migrate_testkit::conformance::iterative_state_moves_or_is_refused(&mut kvm);
}

/// Item 7 of the seams issue: a write through the vm-memory view (how loaders and devices
/// write) while a migration tracks was invisible to it. Above the MMIO hole, so the write
/// lands in the second KVM slot and is placed by its guest address.
#[test]
fn vmm_write_through_the_memory_view_is_in_fetch_dirty() {
    const GIB: u64 = 1 << 30;
    let t = boot(3 * GIB + MEMORY, WORKLOAD);
    t.wait_for("the guest running", BOOT_TIMEOUT, |g| g.pages_written > 0);
    let mut src = t.handle().migration_source();
    src.pause().unwrap();
    src.start_dirty_log().unwrap();
    let mut regions = src.ram();
    regions.sort_by_key(|r| r.gpa);
    // As pass 1 would before reading: the log started all set reports nothing armed since.
    for r in &regions {
        src.arm_dirty(r.gpa, r.size).unwrap();
    }
    assert_eq!(regions.len(), 2, "RAM continues above the hole");
    let gpa = 4 * GIB + 5 * PAGE_SIZE + 12;
    let handle = t.handle();
    let memory = handle.ram().memory();
    let was: u32 = memory.read_obj(GuestAddress(gpa)).unwrap();
    memory.write_obj(was, GuestAddress(gpa)).unwrap();

    let mut bitmap = DirtyBitmap::new(&regions);
    src.fetch_dirty(&mut bitmap).unwrap();
    let (mut cursor, mut dirty) = (Cursor::default(), Vec::new());
    while !cursor.at_end(&bitmap) {
        bitmap.take(&mut cursor, usize::MAX, &mut dirty);
    }
    assert_eq!(dirty, vec![4 * GIB + 5 * PAGE_SIZE]);
    src.stop_dirty_log();
    src.resume().unwrap();
}

/// Issue 15: a memory slot that held no data when tracking started is not logged (that is
/// what makes tracking cost what the guest populated), so when the guest fills it, the next
/// fetch must turn its log on and report every page in it. The guest writes its working set in
/// order, each page for the first time, across slot boundaries (64 MiB slots in a 3 GiB guest).
#[test]
fn a_slot_that_fills_while_tracking_is_reported_whole() {
    const SLOT: u64 = ferry_vmm::kvm::MIN_SLOT_BYTES;
    let t = boot(3 << 30, "ws=2560M pattern=seq verify-ms=0 log-ms=0");
    t.wait_for("the guest writing", BOOT_TIMEOUT, |g| {
        g.pages_written * PAGE_SIZE >= SLOT
    });
    let handle = t.handle();
    let populated_end = || {
        let extents = handle.ram().data_extents().unwrap();
        extents.last().map_or(0, |&(gpa, len)| gpa + len)
    };
    let mut src = handle.migration_source();
    src.pause().unwrap();
    src.start_dirty_log().unwrap();
    let empty_from = populated_end().next_multiple_of(SLOT);
    src.resume().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while populated_end() < empty_from + SLOT / 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the guest did not reach the next slot"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    src.pause().unwrap();
    let mut regions = src.ram();
    regions.sort_by_key(|r| r.gpa);
    let mut bitmap = DirtyBitmap::new(&regions);
    src.fetch_dirty(&mut bitmap).unwrap();
    let filled: Vec<u64> = handle
        .ram()
        .data_extents()
        .unwrap()
        .into_iter()
        .flat_map(|(gpa, len)| (gpa..gpa + len).step_by(PAGE_SIZE as usize))
        .filter(|&gpa| gpa >= empty_from)
        .collect();
    assert!(
        filled.len() as u64 >= SLOT / 2 / PAGE_SIZE,
        "{} pages",
        filled.len()
    );
    let missing: Vec<u64> = filled
        .iter()
        .copied()
        .filter(|&gpa| !bitmap.contains(gpa))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of the {} pages written into slots that had no data are not reported, the first at {:#x}",
        missing.len(),
        filled.len(),
        missing[0]
    );
    let mut again = DirtyBitmap::new(&regions);
    src.fetch_dirty(&mut again).unwrap();
    assert_eq!(again.count(), 0, "a paused guest wrote nothing more");
    src.stop_dirty_log();
    src.resume().unwrap();
}
