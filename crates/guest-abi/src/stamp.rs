//! The page stamp: what word 0 of a working-set page must hold.
//!
//! Page frame `pfn` after its `generation`-th write holds `pfn << 32 | generation` in its first
//! eight bytes and zeros in the rest, unless that write was chosen to be a zero write (a share
//! of writes set by `zero=`), in which case the whole page is zero. Generation 0 means "never
//! written": the page must be entirely zero. Because the expected content is a function of the
//! page's own number and the generation the guest recorded, a verify pass catches a page that
//! was lost (stale generation), misplaced (wrong frame number) or corrupted (any other word).

/// Generation of a page the workload has never written.
pub const NEVER_WRITTEN: u32 = 0;

/// The generation that follows `generation`, skipping [`NEVER_WRITTEN`] on wrap-around.
#[inline(always)]
pub fn next_generation(generation: u32) -> u32 {
    match generation.wrapping_add(1) {
        NEVER_WRITTEN => 1,
        g => g,
    }
}

/// Whether the write of `generation` to frame `pfn` writes zeros, for a zero share of
/// `zero_percent` (0..=100). Deterministic, so the verifier recomputes it instead of storing it.
#[inline(always)]
pub fn is_zero_write(pfn: u64, generation: u32, zero_percent: u8) -> bool {
    zero_percent != 0 && mix(pfn << 32 | u64::from(generation)) % 100 < u64::from(zero_percent)
}

/// Word 0 of frame `pfn` after the write of `generation`.
#[inline(always)]
pub fn expected_word(pfn: u64, generation: u32, zero_percent: u8) -> u64 {
    if generation == NEVER_WRITTEN || is_zero_write(pfn, generation, zero_percent) {
        0
    } else {
        pfn << 32 | u64::from(generation)
    }
}

/// Word `i` (1..512) of a page written with `fill=random` whose stamp word is `stamp`: every
/// word differs and depends on the stamp, so the page is incompressible and a stale or
/// misplaced copy is caught anywhere in it.
#[inline(always)]
pub fn fill_word(stamp: u64, i: u64) -> u64 {
    mix(stamp ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93))
}

/// The frame number and generation a stamp names (for error messages).
pub fn decode(word: u64) -> (u64, u32) {
    (word >> 32, word as u32)
}

/// SplitMix64's finaliser: cheap, and every input bit moves every output bit, so a zero share
/// of n% picks n% of (page, generation) pairs with no visible pattern.
#[inline(always)]
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_written_pages_are_zero() {
        assert_eq!(expected_word(1234, NEVER_WRITTEN, 0), 0);
        assert_eq!(expected_word(1234, NEVER_WRITTEN, 100), 0);
    }

    #[test]
    fn stamp_names_frame_and_generation() {
        let w = expected_word(0x1_2345, 7, 0);
        assert_eq!(decode(w), (0x1_2345, 7));
        assert_ne!(expected_word(0x1_2345, 8, 0), w);
        assert_ne!(expected_word(0x1_2346, 7, 0), w);
    }

    #[test]
    fn generation_skips_zero_on_wrap() {
        assert_eq!(next_generation(u32::MAX), 1);
        assert_eq!(next_generation(1), 2);
    }

    #[test]
    fn zero_share_is_close_to_requested() {
        for pct in [0u8, 10, 50, 100] {
            let zeros = (0..100_000u64)
                .filter(|&p| is_zero_write(p, 3, pct))
                .count();
            let want = 100_000 * pct as usize / 100;
            assert!(
                zeros.abs_diff(want) < 1_500,
                "pct {pct}: {zeros} zero writes, want ~{want}"
            );
        }
    }

    #[test]
    fn fill_words_differ_and_follow_the_stamp() {
        let a = expected_word(9, 1, 0);
        assert_ne!(fill_word(a, 1), fill_word(a, 2));
        assert_ne!(fill_word(a, 1), fill_word(expected_word(9, 2, 0), 1));
        assert_ne!(fill_word(a, 1), 0);
    }

    #[test]
    fn zero_choice_changes_with_generation() {
        // A page must alternate between zero and stamped writes, or a stale copy of a
        // zero page could never be told from a fresh one.
        let changes = (1..200u32)
            .filter(|&g| is_zero_write(77, g, 50) != is_zero_write(77, g + 1, 50))
            .count();
        assert!(changes > 50, "only {changes} changes");
    }
}
