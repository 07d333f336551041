//! The conformance suite (`ferry_migrate_testkit::conformance`) on the fake VMM.

use std::ops::Range;
use std::time::{Duration, Instant};

use ferry_migrate::SourceVm;
use ferry_migrate::wire::SectionId;
use ferry_migrate_testkit::conformance::Fixture;
use ferry_migrate_testkit::device_files::DeviceFile;
use ferry_migrate_testkit::{FakeVm, Writers};

/// 8 MiB in two regions of 1024 pages: several bitmap words per region, and a gap between
/// the regions (the fake leaves 1 GiB), so a slot-by-index mistake would show.
const MEMORY: u64 = 8 << 20;
const REGIONS: usize = 2;
/// A disk of four blocks: small enough for the pause as sections, and iterative state too.
const DISK: u64 = 1 << 20;
/// Pages the source's guest holds free, from page index [`FREE_FROM`]: its balloon hints them.
const FREE_PAGES: u64 = 256;
const FREE_FROM: u64 = 512;
/// Hints arrive at 64 pages a millisecond, a few at a time as a real guest's trickle in: the
/// 256 pages take 4 ms, so some of a round arrive between two takes.
const HINT_PAGES_PER_MS: u64 = 64;

/// The device whose file the source passes (a section id of the fake's own choice).
const DEVICE: (SectionId, u32) = (SectionId(0x44), 0);

struct Fake;

impl Fixture for Fake {
    type Source = FakeVm;
    type Destination = FakeVm;

    /// With a balloon, some memory free to hint, a small disk (iterative state), and a
    /// device file a local handover passes.
    fn source(&mut self) -> FakeVm {
        let mut vm = FakeVm::new(MEMORY, REGIONS);
        vm.add_disk(DISK);
        vm.devices.files.push(DeviceFile {
            id: DEVICE.0,
            instance: DEVICE.1,
            file: tempfile::tempfile().unwrap(),
        });
        vm.fill(3);
        vm.free_pages(FREE_FROM, FREE_PAGES);
        vm.attach_balloon(HINT_PAGES_PER_MS);
        vm
    }

    fn destination(&mut self) -> FakeVm {
        let mut vm = FakeVm::new(MEMORY, REGIONS);
        vm.add_disk(DISK);
        vm.devices.takes = vec![DEVICE];
        vm
    }

    fn vmm_write(&mut self, vm: &mut FakeVm, gpa: u64, byte: u8) {
        vm.write(gpa, &[byte]).unwrap();
    }

    /// The fake's guest is its writer threads, which write pages anywhere in RAM.
    fn guest_writes(&mut self, vm: &mut FakeVm) -> Vec<Range<u64>> {
        vm.start_writers(Writers {
            threads: 1,
            seed: 7,
            zero_percent: 0,
            interval: Duration::from_millis(1),
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while vm.writes() == 0 {
            assert!(Instant::now() < deadline, "the fake's writer never wrote");
            std::thread::sleep(Duration::from_millis(1));
        }
        SourceVm::ram(vm)
            .iter()
            .map(|r| r.gpa..r.gpa + r.size)
            .collect()
    }

    /// The fake's guest runs once resumed, until paused.
    fn destination_runs(&mut self, vm: &mut FakeVm) {
        assert!(
            vm.resumed && !vm.is_paused(),
            "the fake destination is not running (resumed: {}, paused: {})",
            vm.resumed,
            vm.is_paused()
        );
    }

    /// The fake stops for good when abandoned: its writers pause, and it keeps the reason.
    fn destination_stopped(&mut self, vm: &mut FakeVm) -> Option<String> {
        vm.abandoned.clone().filter(|_| vm.is_paused())
    }
}

ferry_migrate_testkit::conformance_tests!(Fake);
