//! How recently and how often the guest dirtied each 2 MiB of its memory, and the postcopy
//! push's order by it: hottest first.
//!
//! [`Heat`] keeps a byte per chunk ([`CHUNK_PAGES`](crate::bitmap::CHUNK_PAGES)): at every
//! dirty sync each byte shifts right and a chunk the sync found dirtied gets the top bit. Read
//! as a number, a byte sorts by the latest sync that dirtied the chunk, then by the ones before
//! it: the order of an LRU clock, at one byte per 2 MiB (256 KiB for a 512 GiB guest) and a
//! pass over the bytes per sync.
//!
//! [`Walk`] is the push's order: the chunks that still hold pages by heat, hottest first and in
//! address order among equals. A vCPU that faults its way through memory in order (the
//! readahead window of its request is open, `readahead.rs`) is followed instead: the walk goes
//! on chunk after chunk from its fault for as long as they hold pages, then back to the heat
//! order. A random fault does not move the walk: the pages after it are no likelier than any.
//! In address order ([`PostcopyOrder::Address`](super::PostcopyOrder::Address), the design
//! before this one, kept as a reference) the walk follows every request and starts over from
//! the lowest address.
//!
//! Invariant: the walk only takes pages out of the bitmap, in whole chunks' worth of units
//! (a chunk holds whole postcopy units), so every page still leaves the bitmap exactly once.

#![forbid(unsafe_code)]

use super::params::PostcopyOrder as Order;
use crate::bitmap::{Chunk, DirtyBitmap};

/// A byte of dirty history per chunk.
#[derive(Debug, Default)]
pub(super) struct Heat {
    /// Per region, per chunk.
    bytes: Vec<Vec<u8>>,
}

impl Heat {
    /// Notes one dirty sync: what `bitmap`'s dirty logs touched since its last
    /// `forget_touched`.
    pub(super) fn note_sync(&mut self, bitmap: &DirtyBitmap) {
        if self.bytes.is_empty() {
            self.bytes = bitmap
                .chunk_counts()
                .into_iter()
                .map(|n| vec![0; n])
                .collect();
        }
        for region in &mut self.bytes {
            for b in region.iter_mut().filter(|b| **b != 0) {
                *b >>= 1;
            }
        }
        for (k, c) in bitmap.touched() {
            if let Some(b) = self.bytes.get_mut(k).and_then(|r| r.get_mut(c)) {
                *b |= 0x80;
            }
        }
    }

    fn of(&self, (k, c): Chunk) -> u8 {
        self.bytes
            .get(k)
            .and_then(|r| r.get(c))
            .copied()
            .unwrap_or(0)
    }
}

/// The postcopy push's way through the pages still to send.
#[derive(Debug, Default)]
pub(super) struct Walk {
    order: Order,
    /// The chunks that held pages when the walk began, in the order to send them.
    chunks: Vec<Chunk>,
    next: usize,
    /// The chunk a followed vCPU goes to next.
    front: Option<Chunk>,
}

impl Walk {
    /// A new walk over what `bitmap` holds now, in this walk's order.
    pub(super) fn again(&self, bitmap: &DirtyBitmap, heat: &Heat) -> Walk {
        Walk::new(bitmap, heat, self.order)
    }

    /// A walk over what `bitmap` holds now, in `order`.
    pub(super) fn new(bitmap: &DirtyBitmap, heat: &Heat, order: Order) -> Walk {
        let mut chunks = bitmap.marked_chunks();
        if order == Order::Hot {
            // Stable: address order among equals.
            chunks.sort_by_key(|&c| std::cmp::Reverse(heat.of(c)));
        }
        Walk {
            order,
            chunks,
            next: 0,
            front: None,
        }
    }

    /// Takes up to `max` pages out of `bitmap` into `out`, the next in the walk's order; fewer
    /// only when the walk is at its end. They are appended in address order (a batch is one
    /// record, whose addresses increase), so across chunks in another order the batch is
    /// sorted: a batch is a few hundred pages.
    pub(super) fn take(&mut self, bitmap: &mut DirtyBitmap, max: usize, out: &mut Vec<u64>) {
        let start = out.len();
        self.take_unsorted(bitmap, max, out);
        out[start..].sort_unstable();
    }

    fn take_unsorted(&mut self, bitmap: &mut DirtyBitmap, max: usize, out: &mut Vec<u64>) {
        let start = out.len();
        while out.len() - start < max {
            let want = max - (out.len() - start);
            if let Some((k, c)) = self.front {
                if !bitmap.take_chunk((k, c), want, out) {
                    // Followed on into the next chunk while it holds pages.
                    self.front = Some((k, c + 1)).filter(|&n| bitmap.chunk_marked(n));
                }
                continue;
            }
            let Some(&c) = self.chunks.get(self.next) else {
                return;
            };
            if !bitmap.take_chunk(c, want, out) {
                self.next += 1;
            }
        }
    }

    /// Whether every chunk of the walk was looked at to its end: what is left in the bitmap
    /// (if anything) came after the walk began, and a new walk takes it.
    pub(super) fn at_end(&self) -> bool {
        self.front.is_none() && self.next >= self.chunks.len()
    }

    /// A request was served whose pages (window included) ended at `last`: a sequential vCPU
    /// (or, in address order, any) is followed from there.
    pub(super) fn after_request(&mut self, bitmap: &DirtyBitmap, last: u64, sequential: bool) {
        if !sequential && self.order == Order::Hot {
            return;
        }
        let Some((k, c)) = bitmap.chunk_of(last) else {
            return;
        };
        self.front = [(k, c), (k, c + 1)]
            .into_iter()
            .find(|&c| bitmap.chunk_marked(c));
        if self.order == Order::Address {
            // Then on in address order to the end; the next walk starts over.
            self.next = self.chunks.partition_point(|&x| x < (k, c));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bitmap::CHUNK_PAGES;
    use crate::ram::RamRegion;
    use crate::wire::PAGE_SIZE;

    const C: u64 = CHUNK_PAGES * PAGE_SIZE;

    /// 8 chunks of one region, each with every page marked.
    fn full() -> DirtyBitmap {
        let mut b = DirtyBitmap::new(&[RamRegion::for_test(0, 8 * C)]);
        b.set_range(0, 8 * C);
        b
    }

    /// A sync whose log dirtied one page of each chunk in `chunks`.
    fn sync(heat: &mut Heat, b: &mut DirtyBitmap, chunks: &[u64]) {
        b.forget_touched();
        for &c in chunks {
            b.merge_at(c * C, 1, &[1]).unwrap();
        }
        heat.note_sync(b);
    }

    /// The chunks of `pages`, each once, in the order first taken.
    fn chunks_in_order(pages: &[u64]) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        for p in pages {
            if out.last() != Some(&(p / C)) {
                out.push(p / C);
            }
        }
        out
    }

    /// Page by page, so that the order is the walk's (a batch is sorted).
    fn take_all(walk: &mut Walk, b: &mut DirtyBitmap) -> Vec<u64> {
        let mut out = Vec::new();
        while !walk.at_end() {
            walk.take(b, 1, &mut out);
        }
        out
    }

    #[test]
    fn a_batch_across_chunks_is_in_address_order() {
        let (mut b, mut heat) = (full(), Heat::default());
        sync(&mut heat, &mut b, &[6]);
        let mut walk = Walk::new(&b, &heat, Order::Hot);
        let mut out = Vec::new();
        walk.take(&mut b, CHUNK_PAGES as usize + 3, &mut out);
        assert!(out.is_sorted(), "a record's addresses increase");
        assert_eq!(
            out[..3],
            [0, PAGE_SIZE, 2 * PAGE_SIZE],
            "then chunk 0's first"
        );
        assert!(out[3..].iter().all(|p| p / C == 6), "chunk 6 whole");
    }

    #[test]
    fn the_most_recently_then_most_often_dirtied_chunk_goes_first_and_every_page_once() {
        let (mut b, mut heat) = (full(), Heat::default());
        sync(&mut heat, &mut b, &[1, 2, 5]);
        sync(&mut heat, &mut b, &[2, 5]);
        sync(&mut heat, &mut b, &[6, 5]);
        // Bytes: 5 = 0xe0, 6 = 0x80, 2 = 0x60, 1 = 0x20, the rest 0.
        let mut walk = Walk::new(&b, &heat, Order::Hot);
        let pages = take_all(&mut walk, &mut b);
        assert_eq!(chunks_in_order(&pages), vec![5, 6, 2, 1, 0, 3, 4, 7]);
        let mut sorted = pages.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), pages.len(), "no page twice");
        assert_eq!(pages.len() as u64, 8 * CHUNK_PAGES, "every page");
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn a_sequential_vcpu_is_followed_while_chunks_hold_pages_and_a_random_fault_moves_nothing() {
        let (mut b, mut heat) = (full(), Heat::default());
        sync(&mut heat, &mut b, &[0]);
        // Chunk 4 was sent already: following from 2 stops after 3.
        let mut gone = Vec::new();
        while b.take_chunk((0, 4), 512, &mut gone) {}
        let mut walk = Walk::new(&b, &heat, Order::Hot);
        let mut out = Vec::new();
        walk.take(&mut b, 10, &mut out);
        assert!(out.iter().all(|p| p / C == 0), "the hottest first");
        walk.after_request(&b, 6 * C + PAGE_SIZE, false);
        walk.take(&mut b, 10, &mut out);
        assert!(
            out.iter().all(|p| p / C == 0),
            "a random fault moves nothing"
        );
        walk.after_request(&b, 2 * C + 40 * PAGE_SIZE, true);
        let rest = take_all(&mut walk, &mut b);
        assert_eq!(chunks_in_order(&rest), vec![2, 3, 0, 1, 5, 6, 7]);
    }

    #[test]
    fn in_address_order_every_request_moves_the_walk_on_to_the_end() {
        let (mut b, heat) = (full(), Heat::default());
        let mut walk = Walk::new(&b, &heat, Order::Address);
        let mut out = Vec::new();
        walk.take(&mut b, 10, &mut out);
        walk.after_request(&b, 5 * C, false);
        let rest = take_all(&mut walk, &mut b);
        assert_eq!(chunks_in_order(&rest), vec![5, 6, 7]);
        // What is left is a new walk's, from the start.
        let mut again = Walk::new(&b, &heat, Order::Address);
        assert_eq!(
            chunks_in_order(&take_all(&mut again, &mut b)),
            vec![0, 1, 2, 3, 4]
        );
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn a_sync_ages_every_chunk() {
        let (mut b, mut heat) = (full(), Heat::default());
        sync(&mut heat, &mut b, &[3]);
        assert_eq!(heat.of((0, 3)), 0x80);
        for _ in 0..7 {
            sync(&mut heat, &mut b, &[]);
        }
        assert_eq!(heat.of((0, 3)), 1);
        sync(&mut heat, &mut b, &[]);
        assert_eq!(heat.of((0, 3)), 0, "forgotten after 8 syncs");
        assert_eq!(heat.of((7, 0)), 0, "an unknown chunk is cold");
    }
}
