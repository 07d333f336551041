//! The guest's free memory (`free=`): 2 MiB blocks placed after the working set, and the state
//! of each. A block is free (its content stale), in use by the churn workload, hinted to the
//! host (held by the balloon driver until the host says `DONE`, so the guest never writes a
//! page it told the host it does not need), or given to the host by inflating the balloon.
//!
//! Pure bookkeeping over a caller's byte per block, so that it tests on the host; the kernel
//! writes and verifies the blocks' pages itself.

use ferry_guest_abi::PAGE_SIZE;
use ferry_guest_abi::layout::MAX_EXTENTS;
use ferry_guest_abi::params::FREE_BLOCK;

use crate::plan::Extent;

/// Pages per block.
pub const BLOCK_PAGES: u64 = FREE_BLOCK / PAGE_SIZE;

/// What a block is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    Free = 0,
    /// Written by the churn workload, verified before it is freed again.
    Used = 1,
    /// Hinted free to the host in a round not finished yet: untouchable until `DONE`.
    Held = 2,
    /// Given to the host by inflating the balloon.
    Ballooned = 3,
}

const STATES: [State; 4] = [State::Free, State::Used, State::Held, State::Ballooned];

/// Where the blocks are: `extents` with `first_index` counting blocks and `pages` pages.
pub fn place(
    ranges: &[(u64, u64)],
    after: u64,
    bytes: u64,
) -> Option<([Extent; MAX_EXTENTS], usize)> {
    let mut extents = [Extent::default(); MAX_EXTENTS];
    let (mut count, mut blocks, want) = (0, 0, bytes / FREE_BLOCK);
    for &(s, e) in ranges {
        let s = s.max(after).next_multiple_of(FREE_BLOCK);
        let e = e / FREE_BLOCK * FREE_BLOCK;
        if s >= e || blocks == want {
            continue;
        }
        if count == MAX_EXTENTS {
            return None;
        }
        let n = ((e - s) / FREE_BLOCK).min(want - blocks);
        extents[count] = Extent {
            first_index: blocks,
            first_pfn: s / PAGE_SIZE,
            pages: n * BLOCK_PAGES,
        };
        count += 1;
        blocks += n;
    }
    (blocks == want).then_some((extents, count))
}

/// The blocks and their states.
#[derive(Debug)]
pub struct Pool<'a> {
    extents: [Extent; MAX_EXTENTS],
    extent_count: usize,
    states: &'a mut [u8],
    counts: [u32; 4],
    /// Where the next search for a block in a given state starts (next fit).
    cursor: usize,
}

impl<'a> Pool<'a> {
    /// All of `states.len()` blocks free, laid out by `extents`.
    pub fn new(extents: &[Extent], states: &'a mut [u8]) -> Pool<'a> {
        states.fill(State::Free as u8);
        let mut e = [Extent::default(); MAX_EXTENTS];
        e[..extents.len()].copy_from_slice(extents);
        Pool {
            extents: e,
            extent_count: extents.len(),
            counts: [states.len() as u32, 0, 0, 0],
            states,
            cursor: 0,
        }
    }

    pub fn blocks(&self) -> u32 {
        self.states.len() as u32
    }

    pub fn count(&self, state: State) -> u32 {
        self.counts[state as usize]
    }

    /// The first frame of `block`.
    pub fn pfn(&self, block: u32) -> u64 {
        let b = u64::from(block);
        let e = self.extents[..self.extent_count]
            .iter()
            .rev()
            .find(|e| e.first_index <= b)
            .copied()
            .unwrap_or_default();
        e.first_pfn + (b - e.first_index) * BLOCK_PAGES
    }

    pub fn state(&self, block: u32) -> State {
        STATES[self.states[block as usize] as usize]
    }

    pub fn set(&mut self, block: u32, to: State) {
        let from = self.state(block);
        self.counts[from as usize] -= 1;
        self.counts[to as usize] += 1;
        self.states[block as usize] = to as u8;
    }

    /// A block in state `from`, moved to `to`; `None` if there is none.
    pub fn take(&mut self, from: State, to: State) -> Option<u32> {
        if self.count(from) == 0 {
            return None;
        }
        let n = self.states.len();
        let at = (0..n)
            .map(|k| (self.cursor + k) % n)
            .find(|&i| self.states[i] == from as u8)?;
        self.cursor = (at + 1) % n;
        self.set(at as u32, to);
        Some(at as u32)
    }

    /// Moves every block in state `from` to `to`; returns how many.
    pub fn move_all(&mut self, from: State, to: State) -> u32 {
        let moved = self.count(from);
        if moved > 0 {
            for s in self.states.iter_mut().filter(|s| **s == from as u8) {
                *s = to as u8;
            }
            self.counts[from as usize] = 0;
            self.counts[to as usize] += moved;
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;
    const GB: u64 = 1 << 30;

    #[test]
    fn blocks_go_after_the_working_set_on_2m_boundaries_and_span_the_hole() {
        let ranges = [(MB, 3 * GB), (4 * GB, 9 * GB)];
        let (e, n) = place(&ranges, 300 * MB + 5, 6 * GB).unwrap();
        assert_eq!(n, 2);
        assert_eq!(e[0].first_pfn * PAGE_SIZE, 302 * MB);
        assert_eq!(e[1].first_pfn * PAGE_SIZE, 4 * GB);
        assert_eq!(e[1].first_index, e[0].pages / BLOCK_PAGES);
        assert_eq!((e[0].pages + e[1].pages) * PAGE_SIZE, 6 * GB);
        assert_eq!(place(&ranges, 300 * MB, 9 * GB), None, "does not fit");
        assert_eq!(place(&ranges, 0, 0).map(|(_, n)| n), Some(0));
    }

    #[test]
    fn states_are_counted_taken_next_fit_and_released_together() {
        let mut states = [9u8; 8];
        let extents = [
            Extent {
                first_index: 0,
                first_pfn: 0x100,
                pages: 4 * BLOCK_PAGES,
            },
            Extent {
                first_index: 4,
                first_pfn: 0x10_0000,
                pages: 4 * BLOCK_PAGES,
            },
        ];
        let mut pool = Pool::new(&extents, &mut states);
        assert_eq!(pool.count(State::Free), 8);
        assert_eq!(pool.pfn(5), 0x10_0000 + BLOCK_PAGES);
        assert_eq!(pool.take(State::Free, State::Used), Some(0));
        assert_eq!(pool.take(State::Free, State::Held), Some(1));
        assert_eq!(pool.take(State::Free, State::Held), Some(2));
        pool.set(0, State::Free);
        // Next fit: the search goes on after the last block taken, then wraps.
        assert_eq!(pool.take(State::Free, State::Used), Some(3));
        assert_eq!(pool.count(State::Held), 2);
        assert_eq!(pool.move_all(State::Held, State::Free), 2);
        assert_eq!(pool.count(State::Free), 7);
        assert_eq!(pool.take(State::Held, State::Free), None);
        for _ in 0..7 {
            assert!(pool.take(State::Free, State::Ballooned).is_some());
        }
        assert_eq!(pool.take(State::Free, State::Used), None);
        assert_eq!(pool.count(State::Ballooned) + pool.count(State::Used), 8);
    }
}
