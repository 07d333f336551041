//! The hot set a snapshot records (docs/snapshot.md): the 2 MiB chunks of guest RAM its dirty
//! passes found written, those written in the most passes first (the newest pass breaking
//! ties). A lazy restore loads them before the rest of RAM and, when the guest faults inside
//! one, places the whole chunk: memory a guest kept writing is memory it touches first again,
//! and a chunk is what one read and one `UFFDIO_COPY` place at the file's full rate (single
//! pages, in the order they were dirtied, would not). Pure.
//!
//! Its bound, [`max_hot_runs`], is the format's: a writer reserves that many runs and a reader
//! refuses a hot set longer than it (`format.rs`), since [`hot_set`] never writes more.

#![forbid(unsafe_code)]

use std::collections::HashMap;

use crate::wire::PAGE_SIZE;

/// The hot set's unit: 2 MiB, a huge page, a migration's largest record.
pub const CHUNK: u64 = 2 << 20;

/// The most runs a hot set of guest RAM `regions` (`(gpa, size)`) holds: one per 2 MiB chunk
/// each region touches, counted per region (a region not aligned to 2 MiB touches a chunk more
/// than its size alone says). [`hot_set`] writes one run per chunk, clipped to the first region
/// in it, so never more than this: 16 bytes per 2 MiB of RAM (8 MiB for 1 TiB), where one run
/// per page would be 512 times that.
pub fn max_hot_runs(regions: &[(u64, u64)]) -> u64 {
    regions
        .iter()
        .filter(|r| r.1 > 0)
        .map(|&(gpa, size)| gpa.saturating_add(size - 1) / CHUNK - gpa / CHUNK + 1)
        .fold(0, u64::saturating_add)
}

/// The index of the first of `runs` that [`hot_set`] does not write for `regions`: empty,
/// not whole pages inside one region, or across a 2 MiB chunk. Runs that pass are pages a
/// restore places without checking their arithmetic again.
pub fn check_runs(runs: &[(u64, u64)], regions: &[(u64, u64)]) -> Result<(), usize> {
    let written = |&(gpa, pages): &(u64, u64)| {
        pages > 0
            && pages <= CHUNK / PAGE_SIZE
            && gpa.is_multiple_of(PAGE_SIZE)
            && regions.iter().any(|&(start, size)| {
                gpa >= start && (gpa - start) / PAGE_SIZE + pages <= size / PAGE_SIZE
            })
            // Inside a region, so the end does not overflow.
            && gpa / CHUNK == (gpa + pages * PAGE_SIZE - 1) / CHUNK
    };
    runs.iter().position(|r| !written(r)).map_or(Ok(()), Err)
}

/// The hot set of `passes` (each a list of runs `(gpa, pages)`, newest pass first) in guest
/// RAM `regions` (`(gpa, size)`): one run per chunk any of them wrote, clipped to its region,
/// ordered by the passes that wrote the chunk (most first), then by the newest of them, then
/// by address; at most `max_runs` runs.
pub fn hot_set(
    passes: &[Vec<(u64, u64)>],
    regions: &[(u64, u64)],
    max_runs: usize,
) -> Vec<(u64, u64)> {
    // chunk -> (passes that wrote it, the newest of them, the last counted). Passes come
    // newest first, so the first pass that writes a chunk is its newest.
    let mut chunks: HashMap<u64, (u32, usize, usize)> = HashMap::new();
    for (age, pass) in passes.iter().enumerate() {
        for &(gpa, pages) in pass {
            if pages == 0 {
                continue;
            }
            let last = gpa + pages * PAGE_SIZE - 1;
            for chunk in gpa / CHUNK..=last / CHUNK {
                let e = chunks.entry(chunk).or_insert((0, age, usize::MAX));
                // Once per pass: a pass's runs may share a chunk.
                if e.2 != age {
                    e.0 += 1;
                    e.2 = age;
                }
            }
        }
    }
    let mut order: Vec<(u64, u32, usize)> = chunks
        .into_iter()
        .map(|(chunk, (count, newest, _))| (chunk, count, newest))
        .collect();
    order.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
    order
        .into_iter()
        .filter_map(|(chunk, _, _)| {
            let (start, end) = (chunk * CHUNK, (chunk + 1) * CHUNK);
            regions.iter().find_map(|&(gpa, size)| {
                let (s, e) = (start.max(gpa), end.min(gpa + size));
                (s < e).then(|| (s, (e - s) / PAGE_SIZE))
            })
        })
        .take(max_runs)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE_SIZE;
    const RAM: [(u64, u64); 1] = [(0, 64 * CHUNK)];

    #[test]
    fn chunks_written_in_more_passes_come_first_then_the_newest() {
        let passes = vec![
            vec![(5 * CHUNK + 3 * P, 1)],             // newest: chunk 5
            vec![(2 * CHUNK, 1), (5 * CHUNK, 2)],     // chunks 2 and 5
            vec![(2 * CHUNK + P, 1), (9 * CHUNK, 1)], // chunks 2 and 9
        ];
        let pages = CHUNK / P;
        assert_eq!(
            hot_set(&passes, &RAM, 100),
            vec![(5 * CHUNK, pages), (2 * CHUNK, pages), (9 * CHUNK, pages)]
        );
    }

    #[test]
    fn a_run_across_chunks_marks_each_once_per_pass() {
        let passes = vec![vec![(CHUNK - P, 2), (CHUNK + P, 1)], vec![(0, 1)]];
        let pages = CHUNK / P;
        // Chunk 0: two passes; chunk 1: one (its two runs in one pass count once).
        assert_eq!(
            hot_set(&passes, &RAM, 100),
            vec![(0, pages), (CHUNK, pages)]
        );
        assert_eq!(hot_set(&passes, &RAM, 1), vec![(0, pages)]);
        assert_eq!(hot_set(&[], &RAM, 1), vec![]);
    }

    #[test]
    fn the_bound_counts_each_chunk_a_region_touches_and_no_hot_set_is_over_it() {
        assert_eq!(max_hot_runs(&RAM), 64);
        assert_eq!(max_hot_runs(&[]), 0);
        // Unaligned: 2 MiB from 1 MiB touches two chunks; a page at the end of a chunk, one.
        let regions = [
            (CHUNK / 2, CHUNK),
            (4 * CHUNK - P, P),
            (8 * CHUNK, 3 * CHUNK),
        ];
        assert_eq!(max_hot_runs(&regions), 2 + 1 + 3);
        // Every chunk of every region written in every pass: exactly the bound.
        let all: Vec<(u64, u64)> = regions.iter().map(|&(gpa, size)| (gpa, size / P)).collect();
        let hot = hot_set(&[all.clone(), all], &regions, usize::MAX);
        assert_eq!(hot.len() as u64, max_hot_runs(&regions));
        // Two regions in one chunk: one run (the first region's), under the bound of two.
        let shared = [(0, 4 * P), (8 * P, 4 * P)];
        let hot = hot_set(&[vec![(0, 4), (8 * P, 4)]], &shared, usize::MAX);
        assert_eq!((hot.len(), max_hot_runs(&shared)), (1, 2));
        // The largest RAM a header can describe does not overflow.
        assert_eq!(max_hot_runs(&[(0, u64::MAX - P + 1)]), u64::MAX / CHUNK + 1);
    }

    #[test]
    fn a_run_a_writer_does_not_write_is_refused() {
        let regions = [(0, 3 * CHUNK), (4 * CHUNK, CHUNK)];
        let chunk = CHUNK / P;
        assert_eq!(
            check_runs(&[(0, chunk), (4 * CHUNK + P, 1)], &regions),
            Ok(())
        );
        for (gpa, pages) in [
            (0, 0),                   // empty
            (0, chunk + 1),           // longer than a chunk
            (P, chunk),               // across two chunks
            (0x800, 1),               // not a page
            (3 * CHUNK, 1),           // between the regions
            (5 * CHUNK - P, 2),       // past the last region
            (u64::MAX - 4095, chunk), // where the end would overflow
        ] {
            let runs = [(0, 1), (gpa, pages)];
            assert_eq!(check_runs(&runs, &regions), Err(1), "{gpa:#x} {pages}");
        }
        // Every run hot_set writes passes.
        let all: Vec<(u64, u64)> = regions.iter().map(|&(gpa, size)| (gpa, size / P)).collect();
        assert_eq!(
            check_runs(&hot_set(&[all], &regions, 100), &regions),
            Ok(())
        );
    }

    #[test]
    fn chunks_are_clipped_to_their_region() {
        let regions = [(0, CHUNK + 8 * P), (3 * CHUNK + 4 * P, CHUNK)];
        let passes = vec![vec![(CHUNK, 1), (3 * CHUNK + 4 * P, 1)]];
        assert_eq!(
            hot_set(&passes, &regions, 100),
            vec![(CHUNK, 8), (3 * CHUNK + 4 * P, CHUNK / P - 4)]
        );
    }
}
