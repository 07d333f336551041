//! The conformance suite (`ferry_migrate_testkit::conformance`) on the fake VMM.

use std::ops::Range;
use std::time::{Duration, Instant};

use ferry_migrate::SourceVm;
use ferry_migrate_testkit::conformance::Fixture;
use ferry_migrate_testkit::{FakeVm, Writers};

/// 8 MiB in two regions of 1024 pages: several bitmap words per region, and a gap between
/// the regions (the fake leaves 1 GiB), so a slot-by-index mistake would show.
const MEMORY: u64 = 8 << 20;
const REGIONS: usize = 2;

struct Fake;

impl Fixture for Fake {
    type Source = FakeVm;
    type Destination = FakeVm;

    fn source(&mut self) -> FakeVm {
        let vm = FakeVm::new(MEMORY, REGIONS);
        vm.fill(3);
        vm
    }

    fn destination(&mut self) -> FakeVm {
        FakeVm::new(MEMORY, REGIONS)
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
}

ferry_migrate_testkit::conformance_tests!(Fake);
