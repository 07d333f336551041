//! The guest's calibration of its TSC against the PIT as the telemetry shows it: the words of
//! its latest [`Kind::Clock`](ferry_guest_abi::report::Kind::Clock) report, which the boot
//! vCPU sends at boot and every `calibrate-ms` (`kernel/pit.rs` in the guest).

use ferry_guest_abi::report;
use serde::Serialize;

/// The guest's latest calibration of its TSC against PIT channel 2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuestTscCalibration {
    /// The TSC's frequency the guest measured (Hz); `None` when its calibration failed.
    pub tsc_calibrated_hz: Option<u64>,
    /// The window in PIT ticks (1.193182 MHz), and the TSC ticks the guest counted over it.
    pub pit_ticks: u64,
    pub tsc_ticks: u64,
    /// How it ended: "ok", "output high at load" (no PIT or no port 0x61), "output never rose"
    /// (a port 0x61 without a PIT behind it), or "unknown".
    pub outcome: &'static str,
    /// Calibrations the guest made since it booted, this one included.
    pub calibrations: u64,
    /// How far `tsc_ticks` may be off (ppm), and the windows of 50 ms the guest timed to get
    /// the best of them.
    pub uncertainty_ppm: u64,
    pub windows: u64,
}

impl GuestTscCalibration {
    pub(super) fn from_detail(d: &[u64; report::DETAIL_WORDS]) -> GuestTscCalibration {
        use report::clock::*;
        GuestTscCalibration {
            tsc_calibrated_hz: Some(d[TSC_CALIBRATED_HZ]).filter(|&hz| hz != 0),
            pit_ticks: d[PIT_TICKS],
            tsc_ticks: d[TSC_TICKS],
            outcome: match d[OUTCOME] {
                OUTCOME_OK => "ok",
                OUTCOME_HIGH_AT_LOAD => "output high at load",
                OUTCOME_NEVER_ROSE => "output never rose",
                _ => "unknown",
            },
            calibrations: d[CALIBRATIONS],
            uncertainty_ppm: d[UNCERTAINTY_PPM],
            windows: d[WINDOWS],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_decodes_and_a_failed_one_has_no_frequency() {
        use report::clock::*;
        let mut d = [0; report::DETAIL_WORDS];
        d[TSC_CALIBRATED_HZ] = 2_100_000_000;
        (d[PIT_TICKS], d[TSC_TICKS]) = (59_659, 105_000_000);
        (d[OUTCOME], d[CALIBRATIONS]) = (OUTCOME_OK, 3);
        (d[UNCERTAINTY_PPM], d[WINDOWS]) = (120, 2);
        let c = GuestTscCalibration::from_detail(&d);
        assert_eq!(c.tsc_calibrated_hz, Some(2_100_000_000));
        assert_eq!((c.outcome, c.calibrations, c.pit_ticks), ("ok", 3, 59_659));
        assert_eq!((c.uncertainty_ppm, c.windows), (120, 2));
        (d[TSC_CALIBRATED_HZ], d[OUTCOME]) = (0, OUTCOME_HIGH_AT_LOAD);
        let c = GuestTscCalibration::from_detail(&d);
        assert_eq!(
            (c.tsc_calibrated_hz, c.outcome),
            (None, "output high at load")
        );
    }
}
