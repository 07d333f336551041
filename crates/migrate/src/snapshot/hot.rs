//! The hot set a snapshot records (docs/snapshot.md): the 2 MiB chunks of guest RAM its dirty
//! passes found written, those written in the most passes first (the newest pass breaking
//! ties). A lazy restore loads them before the rest of RAM and, when the guest faults inside
//! one, places the whole chunk: memory a guest kept writing is memory it touches first again,
//! and a chunk is what one read and one `UFFDIO_COPY` place at the file's full rate (single
//! pages, in the order they were dirtied, would not). Pure.

#![forbid(unsafe_code)]

use std::collections::HashMap;

use crate::wire::PAGE_SIZE;

/// The hot set's unit: 2 MiB, a huge page, a migration's largest record.
pub const CHUNK: u64 = 2 << 20;

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
    fn chunks_are_clipped_to_their_region() {
        let regions = [(0, CHUNK + 8 * P), (3 * CHUNK + 4 * P, CHUNK)];
        let passes = vec![vec![(CHUNK, 1), (3 * CHUNK + 4 * P, 1)]];
        assert_eq!(
            hot_set(&passes, &regions, 100),
            vec![(CHUNK, 8), (3 * CHUNK + 4 * P, CHUNK / P - 4)]
        );
    }
}
