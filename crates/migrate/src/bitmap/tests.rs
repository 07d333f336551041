use super::*;

fn bitmap() -> DirtyBitmap {
    DirtyBitmap::new(&[
        RamRegion::for_test(0, 100 * PAGE_SIZE),
        RamRegion::for_test(1 << 32, 64 * PAGE_SIZE),
    ])
}

fn drain(b: &mut DirtyBitmap, max: usize) -> Vec<u64> {
    let (mut cursor, mut out) = (Cursor::default(), Vec::new());
    while !cursor.at_end(b) {
        b.take(&mut cursor, max, &mut out);
    }
    out
}

#[test]
fn ranges_set_and_clear_whole_pages_inside_ram_and_count_them() {
    let mut b = bitmap();
    // Pages 1..=98 of the first region: partial pages at both ends do not count.
    assert_eq!(b.set_range(PAGE_SIZE - 1, 99 * PAGE_SIZE), 98);
    assert!(!b.contains(0) && b.contains(PAGE_SIZE) && b.contains(98 * PAGE_SIZE));
    assert!(!b.contains(99 * PAGE_SIZE));
    assert_eq!(b.count(), 98);
    // Across the gap between regions only RAM is touched; set twice adds nothing new.
    assert_eq!(b.set_range(90 * PAGE_SIZE, 1 << 33), 1 + 64);
    assert_eq!(b.set_range(0, 1 << 40), 1);
    assert_eq!(b.count(), 164);
    assert_eq!(b.clear_range(63 * PAGE_SIZE, 2 * PAGE_SIZE), 2);
    assert_eq!(b.clear_range(u64::MAX - PAGE_SIZE, PAGE_SIZE * 4), 0);
    assert_eq!(b.count(), 162);
    let left = drain(&mut b, usize::MAX);
    assert_eq!(left.len(), 162);
    assert!(!left.contains(&(63 * PAGE_SIZE)) && !left.contains(&(64 * PAGE_SIZE)));
}

#[test]
fn round_out_marks_whole_units_and_counts_them() {
    let mut b = DirtyBitmap::new(&[
        RamRegion::for_test(0, 2048 * PAGE_SIZE),
        RamRegion::for_test(1 << 32, 1100 * PAGE_SIZE),
    ]);
    b.set(513 * PAGE_SIZE);
    b.set(1023 * PAGE_SIZE);
    b.set((1 << 32) + 1030 * PAGE_SIZE);
    b.round_out(512);
    assert_eq!(b.count(), 512 + (1100 - 1024));
    assert_eq!(
        b.runs_except(None, 1 << 20),
        vec![(512 * PAGE_SIZE, 512), ((1 << 32) + 1024 * PAGE_SIZE, 76)]
    );
    b.round_out(512);
    assert_eq!(b.count(), 588, "rounding twice adds nothing");
    let mut one = bitmap();
    one.set(5 * PAGE_SIZE);
    one.round_out(1);
    assert_eq!(one.count(), 1);
}

#[test]
fn runs_split_at_gaps_regions_and_the_cap_and_leave_the_bits() {
    let mut b = bitmap();
    for p in [0, 1, 2, 63, 64, 65, 99] {
        b.set(p * PAGE_SIZE);
    }
    b.set(1 << 32);
    b.set((1 << 32) + PAGE_SIZE);
    assert_eq!(
        b.runs_except(None, 2),
        vec![
            (0, 2),
            (2 * PAGE_SIZE, 1),
            (63 * PAGE_SIZE, 2),
            (65 * PAGE_SIZE, 1),
            (99 * PAGE_SIZE, 1),
            (1 << 32, 2),
        ]
    );
    assert_eq!(b.runs_except(None, 1000)[0], (0, 3));
    let mut earlier = bitmap();
    earlier.set(PAGE_SIZE);
    earlier.set(64 * PAGE_SIZE);
    assert_eq!(
        b.runs_except(Some(&earlier), 1000)[..3],
        [(0, 1), (2 * PAGE_SIZE, 1), (63 * PAGE_SIZE, 1)]
    );
    assert_eq!(b.count(), 9, "runs_except() only looks");
    assert!(b.test_and_clear(64 * PAGE_SIZE));
    assert!(!b.test_and_clear(64 * PAGE_SIZE));
    assert!(!b.test_and_clear(5000 * PAGE_SIZE), "not RAM");
    assert_eq!(b.count(), 8);
    // A walk from after page 63 goes on at page 65 and then the next region.
    let mut cursor = b.cursor_after(63 * PAGE_SIZE);
    let mut out = Vec::new();
    b.take(&mut cursor, 3, &mut out);
    assert_eq!(out, vec![65 * PAGE_SIZE, 99 * PAGE_SIZE, 1 << 32]);
}

#[test]
fn count_follows_sets_merges_and_takes() {
    let mut b = bitmap();
    assert!(b.set(5 * PAGE_SIZE));
    assert!(!b.set(5 * PAGE_SIZE));
    assert!(!b.set(200 * PAGE_SIZE), "not RAM");
    b.merge_at(0, 100, &[0b1110_0000, u64::MAX]).unwrap();
    assert_eq!(
        b.count(),
        3 + 36,
        "page 5 counted once; bits past page 100 ignored"
    );
    b.merge_at(1 << 32, 64, &[1 << 63]).unwrap();
    assert_eq!(b.count(), 40);
    let pages = drain(&mut b, 7);
    assert_eq!(pages.len(), 40);
    assert_eq!(b.count(), 0);
    assert_eq!(&pages[..3], &[5 * PAGE_SIZE, 6 * PAGE_SIZE, 7 * PAGE_SIZE]);
    assert_eq!(*pages.last().unwrap(), (1 << 32) + 63 * PAGE_SIZE);
    assert!(pages.windows(2).all(|w| w[0] < w[1]), "address order");
}

#[test]
fn take_respects_its_page_budget() {
    let mut b = bitmap();
    b.merge_at(0, 100, &[u64::MAX, u64::MAX]).unwrap();
    let (mut cursor, mut out) = (Cursor::default(), Vec::new());
    b.take(&mut cursor, 10, &mut out);
    assert_eq!(out.len(), 10);
    assert_eq!(b.count(), 90);
    b.take(&mut cursor, 1000, &mut out);
    assert_eq!(out.len(), 100);
}

#[test]
fn take_bounds_its_scan_on_a_sparse_bitmap() {
    // Twice as many summary words as one call may look at (8 Mi words of bits).
    let summary_words = MAX_WORDS_PER_TAKE as u64 * 2;
    let mut b = DirtyBitmap::new(&[RamRegion::for_test(0, 64 * 64 * summary_words * PAGE_SIZE)]);
    let far = 64 * 64 * (MAX_WORDS_PER_TAKE as u64 + 5) * PAGE_SIZE;
    b.set(far);
    let (mut cursor, mut out) = (Cursor::default(), Vec::new());
    b.take(&mut cursor, 100, &mut out);
    assert!(
        out.is_empty() && !cursor.at_end(&b),
        "first call stops after its scan budget"
    );
    b.take(&mut cursor, 100, &mut out);
    assert_eq!(out, vec![far]);
    b.take(&mut cursor, 100, &mut out);
    assert!(cursor.at_end(&b) && b.count() == 0);
}

#[test]
fn walks_skip_unnamed_words_and_runs_split_across_them() {
    let mut b = DirtyBitmap::new(&[RamRegion::for_test(0, 1 << 30)]);
    // The last page of word 5 and the first of word 7: not one run (word 6 is empty);
    // the last page of word 99 and the first of word 100: one run.
    for p in [5 * 64 + 63, 7 * 64, 99 * 64 + 63, 100 * 64, 200_000] {
        b.set(p * PAGE_SIZE);
    }
    assert_eq!(
        b.runs_except(None, 1000),
        vec![
            ((5 * 64 + 63) * PAGE_SIZE, 1),
            (7 * 64 * PAGE_SIZE, 1),
            ((99 * 64 + 63) * PAGE_SIZE, 2),
            (200_000 * PAGE_SIZE, 1),
        ]
    );
    let mut other = b.clone();
    assert!(other.test_and_clear(7 * 64 * PAGE_SIZE));
    other.round_out(512);
    assert_eq!(
        other.runs_except(None, 1 << 20),
        vec![
            (0, 512),
            (12 * 512 * PAGE_SIZE, 512),
            (390 * 512 * PAGE_SIZE, 512)
        ],
        "whole units around what is left, a word emptied by a clear included in none"
    );
    assert_eq!(drain(&mut b, usize::MAX).len(), 5);
    assert_eq!(b.runs_except(None, 1000), vec![], "the walk emptied it");
}

#[test]
fn merge_is_placed_by_guest_address_at_any_page_offset() {
    let mut b = bitmap();
    // 70 pages from page 30 of the first region: words 0 and 1 of the region, shifted.
    b.merge_at(30 * PAGE_SIZE, 70, &[u64::MAX, u64::MAX])
        .unwrap();
    assert_eq!(b.count(), 70, "bits past the 70 pages are ignored");
    let pages = drain(&mut b, 1000);
    assert_eq!(pages.first(), Some(&(30 * PAGE_SIZE)));
    assert_eq!(pages.last(), Some(&(99 * PAGE_SIZE)));
    b.merge_at((1 << 32) + PAGE_SIZE, 1, &[1]).unwrap();
    assert_eq!(drain(&mut b, 10), vec![(1 << 32) + PAGE_SIZE]);
}

#[test]
fn merge_refuses_a_log_outside_one_region() {
    let mut b = bitmap();
    assert_eq!(
        b.merge_at(200 * PAGE_SIZE, 1, &[1]),
        Err(RamError::OutOfRange {
            gpa: 200 * PAGE_SIZE
        }),
        "in the hole between the regions"
    );
    assert_eq!(
        b.merge_at(64 * PAGE_SIZE, 64, &[1]),
        Err(RamError::NotInOneRegion {
            gpa: 64 * PAGE_SIZE,
            pages: 64
        }),
        "runs past the region's end (page 100)"
    );
    assert_eq!(
        b.merge_at(0, 65, &[1]),
        Err(RamError::NotInOneRegion { gpa: 0, pages: 65 }),
        "more pages than bits"
    );
    assert_eq!(b.count(), 0, "a refused log changes nothing");
}

/// Two regions of 3 and 2 chunks, the second one's last chunk short.
fn chunked() -> DirtyBitmap {
    DirtyBitmap::new(&[
        RamRegion::for_test(0, 3 * CHUNK_PAGES * PAGE_SIZE),
        RamRegion::for_test(1 << 32, (CHUNK_PAGES + 100) * PAGE_SIZE),
    ])
}

#[test]
fn a_chunk_is_taken_alone_in_address_order_and_says_whether_pages_are_left() {
    let mut b = chunked();
    let c = CHUNK_PAGES * PAGE_SIZE;
    for gpa in [5 * PAGE_SIZE, c + 7 * PAGE_SIZE, c + 300 * PAGE_SIZE, 2 * c] {
        b.set(gpa);
    }
    b.set((1 << 32) + c + 99 * PAGE_SIZE);
    assert_eq!(b.marked_chunks(), vec![(0, 0), (0, 1), (0, 2), (1, 1)]);
    assert_eq!(b.chunk_of(c + 7 * PAGE_SIZE), Some((0, 1)));
    assert_eq!(b.chunk_of((1 << 32) + c + 99 * PAGE_SIZE), Some((1, 1)));
    assert_eq!(b.chunk_of(1 << 40), None);
    let mut out = Vec::new();
    assert!(b.take_chunk((0, 1), 1, &mut out), "one page left");
    assert_eq!(out, vec![c + 7 * PAGE_SIZE]);
    assert!(!b.take_chunk((0, 1), 10, &mut out), "none left");
    assert_eq!(out, vec![c + 7 * PAGE_SIZE, c + 300 * PAGE_SIZE]);
    assert!(!b.chunk_marked((0, 1)));
    assert!(b.chunk_marked((1, 1)), "the short last chunk");
    assert!(!b.chunk_marked((1, 2)), "past the region's end");
    assert!(!b.take_chunk((1, 2), 10, &mut out));
    assert_eq!(b.count(), 3, "the count follows");
}

#[test]
fn only_dirty_logs_touch_chunks() {
    let mut b = chunked();
    let c = CHUNK_PAGES * PAGE_SIZE;
    // The engine's own marks say what to send, not what the guest wrote.
    b.set(0);
    b.set_range(2 * c, c);
    assert_eq!(b.touched(), vec![]);
    // A log's page counts whether or not it was marked already.
    b.merge_at(0, 64, &[1]).unwrap();
    b.merge_at((1 << 32) + c, 64, &[1 << 3]).unwrap();
    assert_eq!(b.touched(), vec![(0, 0), (1, 1)]);
    b.forget_touched();
    assert_eq!(b.touched(), vec![]);
    assert_eq!(b.count(), 1 + CHUNK_PAGES + 1);
}
