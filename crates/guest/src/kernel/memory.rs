//! Raw access to the pages the workload writes and verifies, and to its generation record.
//! Guest RAM is identity mapped, so a frame number times 4096 is a valid pointer.

use ferry_guest_abi::PAGE_SIZE;

const WORDS_PER_PAGE: usize = (PAGE_SIZE / 8) as usize;

/// Writes the stamp word of frame `pfn`.
#[inline(always)]
pub fn write_stamp(pfn: u64, word: u64) {
    // SAFETY: the workload only passes frames of its plan, which lie in RAM from the memory
    // map above the image and the record, identity mapped user-writable; no Rust reference to
    // that memory exists. Volatile because the host, not this program, reads it.
    unsafe { ((pfn * PAGE_SIZE) as *mut u64).write_volatile(word) }
}

/// Writes a whole page for `fill=random` or `fill=mixed`: the stamp in word 0, the words
/// `word` derives from it after (or all zeros when the write is a zero write, `stamp == 0`).
#[inline(always)]
pub fn write_filled(pfn: u64, stamp: u64, word: fn(u64, u64) -> u64) {
    let p = (pfn * PAGE_SIZE) as *mut u64;
    for i in 0..WORDS_PER_PAGE {
        let w = if stamp == 0 || i == 0 {
            stamp
        } else {
            word(stamp, i as u64)
        };
        // SAFETY: as for `write_stamp`; `i` stays inside the page.
        unsafe { p.add(i).write_volatile(w) };
    }
}

/// Fills frame `pfn` with data no one will check, as memory a program used and freed holds:
/// cheap to write, never zero (so a migration cannot skip it as a zero page).
pub fn scribble(pfn: u64) {
    let p = (pfn * PAGE_SIZE) as *mut u64;
    for i in 0..WORDS_PER_PAGE as u64 {
        // SAFETY: the caller passes frames of its free memory, which lie in RAM above the
        // image, identity mapped user-writable, referenced by nothing else.
        unsafe { p.add(i as usize).write_volatile((pfn << 12 | i) | 1 << 63) };
    }
}

/// Whether frame `pfn` holds the content `write_filled` writes for `stamp` and `word`.
pub fn page_matches_filled(pfn: u64, stamp: u64, word: fn(u64, u64) -> u64) -> bool {
    // SAFETY: as for `page_matches`.
    let words =
        unsafe { core::slice::from_raw_parts((pfn * PAGE_SIZE) as *const u64, WORDS_PER_PAGE) };
    if stamp == 0 {
        return words.iter().fold(0, |acc, w| acc | w) == 0;
    }
    words[0] == stamp
        && words[1..]
            .iter()
            .enumerate()
            .all(|(i, &w)| w == word(stamp, i as u64 + 1))
}

/// Writes word `lane` of frame `pfn` (`shared=1`: each vCPU writes its own word of a page).
#[inline(always)]
pub fn write_lane(pfn: u64, lane: usize, word: u64) {
    debug_assert!(lane < WORDS_PER_PAGE);
    // SAFETY: as for `write_stamp`; `lane` is a vCPU index, below 64, so inside the page.
    unsafe {
        ((pfn * PAGE_SIZE) as *mut u64)
            .add(lane)
            .write_volatile(word)
    }
}

/// Whether word `lane` of frame `pfn` holds `stamp` (the other vCPUs' words are theirs).
#[inline(always)]
pub fn lane_matches(pfn: u64, lane: usize, stamp: u64) -> bool {
    read_word(pfn, lane) == stamp
}

/// Reads word `lane` of frame `pfn` (0: the stamp word).
pub fn read_word(pfn: u64, lane: usize) -> u64 {
    debug_assert!(lane < WORDS_PER_PAGE);
    // SAFETY: as for `write_lane`.
    unsafe { ((pfn * PAGE_SIZE) as *const u64).add(lane).read_volatile() }
}

/// Whether frame `pfn` holds `stamp` in word 0 and zeros everywhere else.
#[inline(always)]
pub fn page_matches(pfn: u64, stamp: u64) -> bool {
    // SAFETY: as for `write_stamp`; the slice lives only for this call, during which nothing
    // in the guest writes the page: it is this vCPU's (whole pages are written only without
    // `shared=1`, where the vCPUs' shares are disjoint). A concurrent host write is exactly
    // what verify is there to catch, and any value read is a valid u64.
    let words =
        unsafe { core::slice::from_raw_parts((pfn * PAGE_SIZE) as *const u64, WORDS_PER_PAGE) };
    // Fold with OR so the compiler vectorises the scan of the 511 words that must be zero.
    words[0] == stamp && words[1..].iter().fold(0, |acc, w| acc | w) == 0
}

/// The generation record: one `u32` per working-set page at guest-physical `base`.
///
/// # Safety
///
/// `base..base + 4 * pages` must be RAM that nothing else uses for the rest of the program.
pub unsafe fn record(base: u64, pages: u64) -> &'static mut [u32] {
    // SAFETY: guaranteed by the caller; zero is a valid u32 (and the never-written value).
    unsafe { core::slice::from_raw_parts_mut(base as *mut u32, pages as usize) }
}
