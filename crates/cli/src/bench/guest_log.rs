//! The built-in guest's serial log as a bench reads it where no telemetry port is (under
//! QEMU): its periodic line (`log-ms=`), with the guest's clock, its memory verify failures
//! and its disk counters, and the lines that name a failure.
//!
//! A line reads `ferry-guest: t=13.422s written=309658 pages (19.5 MB/s) verify passes=0
//! failures=0 disk: written=3275 read=773 bad=0 errors=0 flushes=86 sweeps=0` (the guest's
//! `workload.rs` and `kernel/disk.rs` write it); the disk part is there only with a disk
//! workload.

/// One periodic line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct LogLine {
    /// The guest's clock, seconds since its boot.
    pub t_s: f64,
    /// Memory verify failures.
    pub failures: u64,
    pub disk: Option<DiskLine>,
}

/// The disk counters of a periodic line, in 4 KiB blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct DiskLine {
    pub written: u64,
    pub read: u64,
    /// Blocks read back that did not hold their last write.
    pub bad: u64,
    /// Requests the device failed or did not answer.
    pub errors: u64,
}

impl LogLine {
    /// The disk's written blocks, 0 without a disk.
    pub fn written(&self) -> u64 {
        self.disk.map_or(0, |d| d.written)
    }
}

/// A periodic line's figures; `None` for any other line.
pub(super) fn parse_line(line: &str) -> Option<LogLine> {
    let rest = line.trim().strip_prefix("ferry-guest: t=")?;
    let (t, rest) = rest.split_once("s ")?;
    let t_s = t.parse().ok()?;
    let (memory, disk) = match rest.split_once(" disk: ") {
        Some((m, d)) => (m, Some(d)),
        None => (rest, None),
    };
    let failures = field(memory, "failures")?;
    let disk = match disk {
        Some(d) => Some(DiskLine {
            written: field(d, "written")?,
            read: field(d, "read")?,
            bad: field(d, "bad")?,
            errors: field(d, "errors")?,
        }),
        None => None,
    };
    Some(LogLine {
        t_s,
        failures,
        disk,
    })
}

/// The number after `key=` among space-separated words.
fn field(text: &str, key: &str) -> Option<u64> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// The periodic lines of a log, in order.
pub(super) fn lines(log: &str) -> Vec<LogLine> {
    log.lines().filter_map(parse_line).collect()
}

/// The lines in which the guest names a failure (verify, disk error, halt), for a row's note.
pub(super) fn failure_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("FAILED") || l.contains("DISK ERROR") || l.contains("halting"))
        .collect()
}

/// MB/s of disk writes between two periodic lines (by the guest's clock); `None` when they
/// are not apart in time.
pub(super) fn write_rate_mb_s(from: &LogLine, to: &LogLine) -> Option<f64> {
    let seconds = to.t_s - from.t_s;
    (seconds > 0.0)
        .then(|| to.written().saturating_sub(from.written()) as f64 * 4096.0 / 1e6 / seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WITH_DISK: &str = "ferry-guest: t=13.422s written=309658 pages (19.5 MB/s) verify passes=0 failures=0 disk: written=3275 read=773 bad=2 errors=1 flushes=86 sweeps=0";

    #[test]
    fn a_periodic_line_with_a_disk_parses() {
        let l = parse_line(WITH_DISK).unwrap();
        assert_eq!(l.t_s, 13.422);
        assert_eq!(l.failures, 0);
        assert_eq!(
            l.disk,
            Some(DiskLine {
                written: 3275,
                read: 773,
                bad: 2,
                errors: 1
            })
        );
    }

    #[test]
    fn a_periodic_line_without_a_disk_has_none() {
        let l = parse_line(
            "ferry-guest: t=1.019s written=4209 pages (17.7 MB/s) verify passes=3 failures=7",
        )
        .unwrap();
        assert_eq!((l.t_s, l.failures, l.disk), (1.019, 7, None));
    }

    #[test]
    fn other_lines_are_not_periodic_lines() {
        for line in [
            "ferry-guest: vCPU 0 prefilled 262144 pages",
            "ferry-guest: DISK VERIFY FAILED: block 7 should hold generation 3, found Stale",
            "ferry-guest: t=1.0s written=1 pages (1 MB/s) verify passes=0",
            "",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
    }

    #[test]
    fn the_write_rate_is_over_the_guests_clock() {
        let log = format!(
            "ferry-guest: vCPU 0 prefilled 4 pages\n{}\n{}\nferry-guest: DISK ERROR: flush of block 0: NoAnswer\n",
            WITH_DISK,
            WITH_DISK
                .replace("t=13.422s", "t=14.422s")
                .replace("written=3275", "written=5716")
        );
        let l = lines(&log);
        assert_eq!(l.len(), 2);
        let rate = write_rate_mb_s(&l[0], &l[1]).unwrap();
        assert!((rate - 2441.0 * 4096.0 / 1e6).abs() < 1e-9, "{rate}");
        assert_eq!(write_rate_mb_s(&l[1], &l[1]), None);
        assert_eq!(failure_lines(&log).len(), 1);
    }
}
