//! The RTC's time of day as the guest read it (`kernel/rtc.rs` in the guest), carried by its
//! [`Kind::Clock`](ferry_guest_abi::report::Kind::Clock) reports, beside the host's wall clock
//! when the report arrived, so the two can be compared (`GET /vm`: `guest.rtc`).

use ferry_guest_abi::report;
use ferry_guest_abi::rtc::{DM_BINARY, HOURS_24};
use serde::Serialize;

/// The guest's latest reading of the RTC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GuestRtc {
    /// The RTC's time of day, seconds since the Unix epoch.
    pub unix_seconds: u64,
    /// The host's wall clock when the report arrived, seconds since the Unix epoch.
    pub host_unix_seconds: u64,
    /// The format register B gave the time registers: "bcd" or "binary", "24h" or "12h".
    pub format: (&'static str, &'static str),
}

impl GuestRtc {
    /// The reading in a Clock report's words, received at the host's `host_wall_ns` (ns
    /// since the Unix epoch); `None` when the guest read none.
    pub(super) fn from_detail(
        d: &[u64; report::DETAIL_WORDS],
        host_wall_ns: i128,
    ) -> Option<GuestRtc> {
        use report::clock::*;
        let b = d[RTC_REGISTER_B] as u8;
        (d[RTC_UNIX_SECONDS] != 0).then(|| GuestRtc {
            unix_seconds: d[RTC_UNIX_SECONDS],
            host_unix_seconds: (host_wall_ns / 1_000_000_000).max(0) as u64,
            format: (
                if b & DM_BINARY != 0 { "binary" } else { "bcd" },
                if b & HOURS_24 != 0 { "24h" } else { "12h" },
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_decodes_and_none_is_none() {
        use report::clock::*;
        let mut d = [0; report::DETAIL_WORDS];
        assert_eq!(GuestRtc::from_detail(&d, 0), None);
        (d[RTC_UNIX_SECONDS], d[RTC_REGISTER_B]) = (1_000_000_000, u64::from(HOURS_24));
        let r = GuestRtc::from_detail(&d, 1_000_000_002_500_000_000).unwrap();
        assert_eq!(
            (r.unix_seconds, r.host_unix_seconds),
            (1_000_000_000, 1_000_000_002)
        );
        assert_eq!(r.format, ("bcd", "24h"));
    }
}
