//! The guest's disk workload (`disk=`) as the telemetry shows it: the counters of its latest
//! [`Kind::Disk`](ferry_guest_abi::report::Kind::Disk) report, which the boot vCPU sends
//! after every heartbeat while the workload runs. They are cumulative in the guest, so the
//! latest report is the whole story and a lost one loses nothing.

use ferry_guest_abi::report::{self, DiskCounters};
use serde::Serialize;

/// The disk workload's counters, in 4 KiB blocks of the guest's disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuestDisk {
    /// Blocks the workload uses (`disk=` / 4 KiB).
    pub blocks: u64,
    pub blocks_written: u64,
    /// Blocks read back and checked (`disk-read=` reads and verify sweeps).
    pub blocks_read: u64,
    /// Blocks read back that did not hold their last write: stale, misplaced, zero or torn.
    pub verify_failures: u64,
    /// Requests the device answered with an error status, or did not answer.
    pub request_errors: u64,
    pub flushes: u64,
    /// The first block found bad, if any.
    pub first_bad_block: Option<u64>,
    /// Verify sweeps completed, each over every block written before it got there.
    pub sweeps: u64,
}

impl GuestDisk {
    /// The counters of a Disk report's detail words.
    pub fn from_detail(d: &[u64; report::DETAIL_WORDS]) -> GuestDisk {
        let c = DiskCounters::from_detail(d);
        GuestDisk {
            blocks: c.blocks,
            blocks_written: c.blocks_written,
            blocks_read: c.blocks_read,
            verify_failures: c.verify_failures,
            request_errors: c.request_errors,
            flushes: c.flushes,
            first_bad_block: c.first_bad_block,
            sweeps: c.sweeps,
        }
    }

    /// Whether every block read held its last write and every request succeeded.
    pub fn clean(&self) -> bool {
        self.verify_failures == 0 && self.request_errors == 0
    }
}

#[cfg(test)]
mod tests {
    use ferry_guest_abi::report::{Kind, Report};

    use super::*;

    #[test]
    fn an_encoded_disk_report_decodes_to_its_counters() {
        let sent = DiskCounters {
            blocks_written: 5_000,
            blocks_read: 1_200,
            verify_failures: 2,
            request_errors: 1,
            flushes: 40,
            first_bad_block: Some(77),
            blocks: 16_384,
            sweeps: 3,
        };
        let r = Report {
            kind: Kind::Disk as u16,
            detail: sent.to_detail(),
            ..Report::default()
        };
        let back = Report::from_bytes(&r.to_bytes()).unwrap();
        assert_eq!(back.kind(), Kind::Disk);
        let disk = GuestDisk::from_detail(&back.detail);
        assert_eq!(
            disk,
            GuestDisk {
                blocks: 16_384,
                blocks_written: 5_000,
                blocks_read: 1_200,
                verify_failures: 2,
                request_errors: 1,
                flushes: 40,
                first_bad_block: Some(77),
                sweeps: 3,
            }
        );
        assert!(!disk.clean());
        let none = GuestDisk::from_detail(&DiskCounters::default().to_detail());
        assert_eq!(none.first_bad_block, None);
        assert!(none.clean());
        let json = serde_json::to_value(disk).unwrap();
        assert_eq!(json["first_bad_block"], 77);
        assert_eq!(json["verify_failures"], 2);
    }
}
