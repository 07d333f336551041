//! What the dirty log (`dirty.rs`) knows of each slot, as plain values: whether it logs, and
//! with `KVM_DIRTY_LOG_INITIALLY_SET`, which of its pages KVM still holds dirty from the
//! log's start (not write-protected yet, so a write to them is not logged). No ioctl here: the
//! bit arithmetic is unit-tested on its own.

#![forbid(unsafe_code)]

/// How turning a slot's logging on treats the pages it maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogStart {
    /// The log starts empty: KVM write-protects every page the slot maps, in the one ioctl
    /// that turns logging on, while the vCPUs that touch memory wait on KVM's MMU lock.
    WriteProtect,
    /// `KVM_DIRTY_LOG_INITIALLY_SET`: the log starts with every page of the slot set and
    /// nothing write-protected; a page is write-protected when its bit is cleared, a slice at a
    /// time as pass 1 reaches it ([`super::KvmVm::arm_dirty_log`]), the rest at the next fetch.
    AllSet,
}

/// Names the old way for a bench that measures both in one run: `FERRY_DIRTY_LOG_START`
/// set to this makes every VM started after it write-protect when its log starts. The only
/// switch of its kind in the VMM, read where a VM is built and nowhere else.
pub const LOG_START_ENV: &str = "FERRY_DIRTY_LOG_START";
/// The value of [`LOG_START_ENV`] that selects [`LogStart::WriteProtect`].
pub const LOG_START_WRITE_PROTECT: &str = "write-protect";

impl LogStart {
    /// [`LogStart::AllSet`], unless [`LOG_START_ENV`] asks for the old way.
    pub fn from_env() -> LogStart {
        match std::env::var(LOG_START_ENV) {
            Ok(v) if v == LOG_START_WRITE_PROTECT => LogStart::WriteProtect,
            _ => LogStart::AllSet,
        }
    }
}

/// One slot's logging.
#[derive(Debug, Default)]
pub enum SlotLog {
    #[default]
    Off,
    On {
        /// Pages of the slot (bit `i`: page `i`) whose bit KVM set when logging started and
        /// that were not armed since (cleared in KVM, which write-protects them). Empty when
        /// there are none (the log started empty, or every page was armed).
        unarmed: Vec<u64>,
    },
}

impl SlotLog {
    pub fn is_on(&self) -> bool {
        matches!(self, SlotLog::On { .. })
    }
}

/// Every slot's logging, by index in the VM's slot table, and how logging starts.
#[derive(Debug)]
pub struct Logging {
    pub start: LogStart,
    pub slots: Vec<SlotLog>,
}

impl Logging {
    pub fn new(slots: usize) -> Logging {
        Logging {
            start: LogStart::WriteProtect,
            slots: (0..slots).map(|_| SlotLog::Off).collect(),
        }
    }

    /// A slot of `pages` pages whose logging was just turned on.
    pub fn turned_on(&self, pages: u64) -> SlotLog {
        SlotLog::On {
            unarmed: match self.start {
                LogStart::WriteProtect => Vec::new(),
                LogStart::AllSet => all_set(pages),
            },
        }
    }

    pub fn count_on(&self) -> usize {
        self.slots.iter().filter(|s| s.is_on()).count()
    }
}

/// A bitmap of `pages` bits, all set.
pub fn all_set(pages: u64) -> Vec<u64> {
    let mut bits = vec![!0u64; pages.div_ceil(64) as usize];
    if !pages.is_multiple_of(64) {
        *bits.last_mut().expect("pages > 0") = (1 << (pages % 64)) - 1;
    }
    bits
}

/// The bits of `bits` for pages `from..to`, as words from the word holding `from` (bits
/// outside the range zero): returns that word's index and the words. KVM's clear takes a
/// first page that is a multiple of 64, so the range is widened to whole words and masked.
pub fn bits_in(bits: &[u64], from: u64, to: u64) -> (usize, Vec<u64>) {
    let (first, last) = ((from / 64) as usize, to.div_ceil(64) as usize);
    let mut words = bits[first..last].to_vec();
    if let Some(w) = words.first_mut() {
        *w &= !0u64 << (from % 64);
    }
    if !to.is_multiple_of(64)
        && let Some(w) = words.last_mut()
    {
        *w &= (1u64 << (to % 64)) - 1;
    }
    (first, words)
}

/// Clears in `bits`, from word `first` on, the bits set in `words`.
pub fn clear_bits(bits: &mut [u64], first: usize, words: &[u64]) {
    for (b, w) in bits[first..].iter_mut().zip(words) {
        *b &= !w;
    }
}

/// The runs of set bits in `bits`, as page ranges `(start, end)`, in order.
pub fn runs(bits: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, &w) in bits.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let zeros = w.trailing_zeros();
            let ones = (w >> zeros).trailing_ones();
            let start = i as u64 * 64 + u64::from(zeros);
            let end = start + u64::from(ones);
            match out.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => out.push((start, end)),
            }
            let seen = zeros + ones;
            w = if seen >= 64 { 0 } else { w & (!0u64 << seen) };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_set_has_exactly_the_slots_pages() {
        assert_eq!(all_set(128), vec![!0, !0]);
        assert_eq!(all_set(70), vec![!0, 0b11_1111]);
        assert_eq!(runs(&all_set(70)), vec![(0, 70)]);
    }

    #[test]
    fn bits_in_masks_the_edges_of_the_range() {
        let bits = all_set(256);
        let (first, words) = bits_in(&bits, 70, 130);
        assert_eq!(first, 1);
        assert_eq!(words, vec![!0u64 << 6, 0b11]);
        assert_eq!(runs(&words), vec![(6, 66)]);
        // A range on word boundaries takes the words whole.
        assert_eq!(bits_in(&bits, 64, 192), (1, vec![!0, !0]));
        // Bits already clear stay clear.
        assert_eq!(bits_in(&[0b1010], 0, 3), (0, vec![0b010]));
    }

    #[test]
    fn arming_a_range_twice_clears_nothing_the_second_time() {
        let mut unarmed = all_set(256);
        let (first, words) = bits_in(&unarmed, 70, 130);
        clear_bits(&mut unarmed, first, &words);
        assert_eq!(runs(&unarmed), vec![(0, 70), (130, 256)]);
        // A wider arm clears in KVM only what is still unarmed (pages 64-69 and 130-139,
        // counted from page 64 here), never the bit of a write logged in 70-129.
        let (_, again) = bits_in(&unarmed, 64, 140);
        assert_eq!(runs(&again), vec![(0, 6), (130 - 64, 140 - 64)]);
        let (first, words) = bits_in(&unarmed, 70, 130);
        assert!(words.iter().all(|&w| w == 0), "{first} {words:?}");
    }

    #[test]
    fn runs_join_across_words_and_split_at_gaps() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[0, 0]), vec![]);
        assert_eq!(runs(&[1 << 63, 1]), vec![(63, 65)]);
        assert_eq!(runs(&[0b1101]), vec![(0, 1), (2, 4)]);
        assert_eq!(runs(&[!0, !0, 1 << 5]), vec![(0, 128), (133, 134)]);
    }

    #[test]
    fn a_slot_turned_on_is_unarmed_only_with_all_set() {
        let mut l = Logging::new(2);
        assert!(matches!(l.turned_on(64), SlotLog::On { unarmed } if unarmed.is_empty()));
        l.start = LogStart::AllSet;
        assert!(matches!(l.turned_on(64), SlotLog::On { unarmed } if unarmed == vec![!0]));
        assert_eq!(l.count_on(), 0);
    }
}
