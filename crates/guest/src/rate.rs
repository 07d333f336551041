//! The write rate the guest prints on its serial line, in the unit `rate=` is given in: MB/s
//! (10^6 bytes) of whole pages, so `rate=150` reads back as about `150.0 MB/s`; and the rate
//! asked for, as the command line gave it.

use ferry_guest_abi::PAGE_SIZE;
use ferry_guest_abi::params::Rate;

/// `pages` written over `ns` nanoseconds, shown as `123.4 MB/s`; `0.0 MB/s` over no time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRate {
    pub pages: u64,
    pub ns: u64,
}

impl WriteRate {
    /// Tenths of a MB/s, rounded down. In 128 bits: pages times bytes per page times 10^4
    /// passes 2^64 after 4.5 * 10^11 pages, an hour and a half of a flat-out guest's writing.
    pub fn tenths_of_mb_per_s(self) -> u64 {
        if self.ns == 0 {
            return 0;
        }
        // tenths of MB/s = bytes / (ns / 1e9) / 1e6 * 10 = bytes * 10^4 / ns
        let tenths = u128::from(self.pages) * u128::from(PAGE_SIZE) * 10_000 / u128::from(self.ns);
        u64::try_from(tenths).unwrap_or(u64::MAX)
    }
}

impl core::fmt::Display for WriteRate {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let tenths = self.tenths_of_mb_per_s();
        write!(f, "{}.{} MB/s", tenths / 10, tenths % 10)
    }
}

/// A `rate=` or `disk-rate=` as the guest prints it: `flat out`, `idle` or `N MB/s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateText(pub Rate);

impl core::fmt::Display for RateText {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0 {
            Rate::FlatOut => f.write_str("flat out"),
            Rate::Idle => f.write_str("idle"),
            Rate::MegabytesPerSecond(r) => write!(f, "{r} MB/s"),
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::string::ToString;

    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn reads_back_in_the_unit_rate_is_given_in() {
        // (pages, ns, shown): rate=150 paces 150e6 / 4096 = 36621 pages a second.
        for (pages, ns, shown) in [
            (36_621, S, "149.9 MB/s"),
            (36_622, S, "150.0 MB/s"),
            // One page a second: 4096 B/s, below a tenth of a MB/s.
            (1, S, "0.0 MB/s"),
            (25, S, "0.1 MB/s"),
            // A log line 1.087 s after the last, as a guest that was busy verifying prints it.
            (97_656 + 8_496, 1_087_000_000, "399.9 MB/s"),
            // Flat out, one word stamped per page: millions of pages a second.
            (86_700_000, S, "355123.2 MB/s"),
            (10, 0, "0.0 MB/s"),
        ] {
            assert_eq!(
                WriteRate { pages, ns }.to_string(),
                shown,
                "{pages} pages in {ns} ns"
            );
        }
    }

    #[test]
    fn rates_print_as_the_command_line_gives_them() {
        assert_eq!(RateText(Rate::FlatOut).to_string(), "flat out");
        assert_eq!(RateText(Rate::Idle).to_string(), "idle");
        assert_eq!(
            RateText(Rate::MegabytesPerSecond(10)).to_string(),
            "10 MB/s"
        );
    }

    #[test]
    fn an_hour_flat_out_does_not_overflow() {
        let hour = WriteRate {
            pages: 86_700_000 * 3600,
            ns: 3600 * S,
        };
        assert_eq!(hour.to_string(), "355123.2 MB/s");
        let absurd = WriteRate {
            pages: u64::MAX,
            ns: 1,
        };
        assert_eq!(absurd.tenths_of_mb_per_s(), u64::MAX);
    }
}
