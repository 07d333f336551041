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

/// Shares of `fill=mixed`'s pages, in percent: text-like, then code-like; the rest is random.
pub const MIXED_TEXT_PERCENT: u64 = 50;
pub const MIXED_CODE_PERCENT: u64 = 30;

/// What a `fill=mixed` page holds, fixed by its frame number so that the shares hold in any
/// working set and a verifier recomputes it.
///
/// The two compressible kinds are made to compress about as real text and code do. Measured
/// with zstd level 1 in 512 KiB batches on the project's machine: text-like pages 3.9x
/// (license texts: 3.5x), code-like pages 2.2x (ferry's own binary: 2.6x); 20% random pages
/// then bound a mixed batch's ratio at 2.2x.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixedKind {
    /// Words of 3-7 lowercase letters and spaces from a vocabulary of 1,024.
    Text,
    /// 8-byte "instructions" from a set of 32, each with an operand: 8 bits, or 16 in one of
    /// four.
    Code,
    /// [`fill_word`]'s incompressible words.
    Random,
}

/// The kind of `fill=mixed` page at frame `pfn`.
#[inline(always)]
pub fn mixed_kind(pfn: u64) -> MixedKind {
    match mix(pfn ^ 0x6a09_e667_f3bc_c908) % 100 {
        r if r < MIXED_TEXT_PERCENT => MixedKind::Text,
        r if r < MIXED_TEXT_PERCENT + MIXED_CODE_PERCENT => MixedKind::Code,
        _ => MixedKind::Random,
    }
}

/// Word `i` (1..512) of a page written with `fill=mixed` whose stamp word is `stamp`: like
/// [`fill_word`], it depends on the stamp (a stale or misplaced copy is caught anywhere in the
/// page), but drawn from a small vocabulary on text-like and code-like pages, so that those
/// compress about as real text and code do.
#[inline(always)]
pub fn mixed_word(stamp: u64, i: u64) -> u64 {
    let r = fill_word(stamp, i);
    match mixed_kind(decode(stamp).0) {
        MixedKind::Text => {
            let w = mix(r % 1024);
            let letters = 3 + (w >> 56) % 5;
            let mut word = u64::from_le_bytes(*b"        ");
            for k in 0..letters {
                let letter = b'a' + ((w >> (k * 8)) % 26) as u8;
                word = word & !(0xff << (k * 8)) | u64::from(letter) << (k * 8);
            }
            word
        }
        MixedKind::Code => {
            let operand = match (r >> 40) & 3 {
                0 => r >> 48,
                _ => (r >> 48) & 0xff,
            };
            mix(r % 32) & !0xffff | operand
        }
        MixedKind::Random => r,
    }
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
    fn mixed_pages_come_in_their_shares_and_text_is_letters() {
        let mut count = [0u64; 3];
        for pfn in 0..10_000 {
            count[mixed_kind(pfn) as usize] += 1;
        }
        let share = |k: usize| count[k] as f64 / 100.0;
        assert!(
            (share(0) - MIXED_TEXT_PERCENT as f64).abs() < 3.0,
            "{count:?}"
        );
        assert!(
            (share(1) - MIXED_CODE_PERCENT as f64).abs() < 3.0,
            "{count:?}"
        );
        let text = (0..).find(|&p| mixed_kind(p) == MixedKind::Text).unwrap();
        let stamp = expected_word(text, 3, 0);
        for i in 1..512 {
            let bytes = mixed_word(stamp, i).to_le_bytes();
            assert!(
                bytes.iter().all(|&b| b == b' ' || b.is_ascii_lowercase()),
                "{bytes:?}"
            );
        }
        // Another generation of the same page differs somewhere, as fill=random's does.
        let other = expected_word(text, 4, 0);
        assert!((1..512).any(|i| mixed_word(stamp, i) != mixed_word(other, i)));
    }

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
