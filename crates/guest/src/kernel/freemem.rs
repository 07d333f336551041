//! Free memory as a real guest has it (`free=`, `churn=`): blocks beyond the working set that
//! were filled with data once and freed (their content stale), a churn workload that keeps
//! allocating blocks, writing them, verifying them and freeing them again, and the balloon
//! driver that hints the free ones to the host.
//!
//! Every block the churn workload holds is verified before it is freed and by every verify
//! pass, so a hinted block that was reused and then lost by a migration is found and named.

use core::ptr::addr_of_mut;

use ferry_guest::pool::{self, BLOCK_PAGES, Pool, State};
use ferry_guest_abi::layout::MAX_EXTENTS;
use ferry_guest_abi::params::{FREE_BLOCK, MmioDevice, Params};
use ferry_guest_abi::report;
use ferry_guest_abi::stamp::{expected_word, fill_word, next_generation};

use super::balloon::Balloon;
use super::memory;

/// Largest `free=`: 64 GiB of 2 MiB blocks, one state byte each in the image.
pub const MAX_BLOCKS: usize = 32 * 1024;
/// Blocks the churn workload holds at once before it frees the oldest: 128 MiB in flight, as
/// a compile keeps a working set of short-lived allocations.
const LIVE: usize = 64;
/// At most this many blocks per look, so a late churn does not stall the main workload.
const MAX_BLOCKS_PER_LOOK: u64 = 8;

static mut STATES: [u8; MAX_BLOCKS] = [0; MAX_BLOCKS];

/// Why free memory could not be set up.
pub enum FreeMemError {
    TooMuch,
    NoRoom,
}

impl FreeMemError {
    /// Says on the serial port what went wrong and what to change.
    pub fn explain(&self, p: &Params) {
        match self {
            FreeMemError::TooMuch => crate::sprintln!(
                "ferry-guest: free= is more than the {} GiB the guest tracks; lower it",
                (MAX_BLOCKS as u64 * FREE_BLOCK) >> 30
            ),
            FreeMemError::NoRoom => crate::sprintln!(
                "ferry-guest: free={} MiB does not fit beside the working set; give the VM more memory or lower free= or ws=",
                p.free >> 20
            ),
        }
    }
}

pub struct FreeMemory {
    pub pool: Pool<'static>,
    pub balloon: Option<Balloon>,
    /// The blocks the churn workload holds, oldest first, with the generation written.
    live: [(u32, u32); LIVE],
    live_count: usize,
    live_first: usize,
    generation: u32,
    churn_bytes_per_s: u64,
    started_ns: u64,
    churned: u64,
    pub bad_pages: u64,
}

impl FreeMemory {
    /// Places `p.free` bytes of blocks after `after` in `ranges`, fills them with data and
    /// frees them, and starts the balloon driver if the VM has a balloon (`balloon`, found by
    /// its device ID). The churn's clock starts at `clock()` once the fill is done, so the
    /// fill is no backlog.
    pub fn new(
        p: &Params,
        balloon: Option<MmioDevice>,
        ranges: &[(u64, u64)],
        after: u64,
        clock: impl Fn() -> u64,
    ) -> Result<FreeMemory, FreeMemError> {
        let blocks = (p.free / FREE_BLOCK) as usize;
        if blocks > MAX_BLOCKS {
            return Err(FreeMemError::TooMuch);
        }
        let (extents, count): ([_; MAX_EXTENTS], usize) =
            pool::place(ranges, after, p.free).ok_or(FreeMemError::NoRoom)?;
        let states = addr_of_mut!(STATES);
        // SAFETY: the one FreeMemory takes the array for the rest of the program.
        let states: &'static mut [u8] = unsafe { &mut (&mut *states)[..blocks] };
        let pool = Pool::new(&extents[..count], states);
        for block in 0..pool.blocks() {
            let first = pool.pfn(block);
            for k in 0..BLOCK_PAGES {
                memory::scribble(first + k);
            }
        }
        Ok(FreeMemory {
            pool,
            balloon: balloon.and_then(|dev| Balloon::start(dev, p.hint_batch)),
            live: [(0, 0); LIVE],
            live_count: 0,
            live_first: 0,
            generation: 0,
            churn_bytes_per_s: u64::from(p.churn_mb_s) * 1_000_000,
            started_ns: clock(),
            churned: 0,
            bad_pages: 0,
        })
    }

    /// Says on the serial port what was set up.
    pub fn announced(self, p: &Params) -> FreeMemory {
        crate::sprintln!(
            "ferry-guest: {} MiB filled and freed in 2 MiB blocks{}",
            p.free >> 20,
            match self.balloon {
                Some(_) => ", hinted through the balloon when asked",
                None => "",
            }
        );
        self
    }

    /// Looks at the balloon (every heartbeat).
    pub fn poll(&mut self) {
        if let Some(b) = &mut self.balloon {
            b.poll(&mut self.pool);
        }
    }

    /// Churns the blocks the rate allows by `now_ns`; returns bad pages found freeing them.
    pub fn churn(&mut self, now_ns: u64) -> u64 {
        if self.churn_bytes_per_s == 0 {
            return 0;
        }
        let elapsed = now_ns.saturating_sub(self.started_ns);
        let due = (u128::from(elapsed) * u128::from(self.churn_bytes_per_s)
            / 1_000_000_000
            / u128::from(FREE_BLOCK)) as u64;
        let mut bad = 0;
        for _ in 0..due.saturating_sub(self.churned).min(MAX_BLOCKS_PER_LOOK) {
            if self.live_count == LIVE || self.pool.count(State::Free) == 0 {
                if self.live_count == 0 {
                    break;
                }
                let (block, generation) = self.live[self.live_first];
                bad += self.check(block, generation);
                self.pool.set(block, State::Free);
                self.live_first = (self.live_first + 1) % LIVE;
                self.live_count -= 1;
            }
            let Some(block) = self.pool.take(State::Free, State::Used) else {
                break;
            };
            self.generation = next_generation(self.generation);
            let first = self.pool.pfn(block);
            for k in 0..BLOCK_PAGES {
                memory::write_filled(
                    first + k,
                    expected_word(first + k, self.generation, 0),
                    fill_word,
                );
            }
            self.live[(self.live_first + self.live_count) % LIVE] = (block, self.generation);
            self.live_count += 1;
            self.churned += 1;
        }
        self.bad_pages += bad;
        bad
    }

    /// Bad pages among the blocks the churn workload holds (part of every verify pass); the
    /// first few frames are pushed to `listed`.
    pub fn verify(&self, listed: &mut impl FnMut(u64)) -> u64 {
        let mut bad = 0;
        for i in 0..self.live_count {
            let (block, generation) = self.live[(self.live_first + i) % LIVE];
            let first = self.pool.pfn(block);
            for k in 0..BLOCK_PAGES {
                if !memory::page_matches_filled(
                    first + k,
                    expected_word(first + k, generation, 0),
                    fill_word,
                ) {
                    listed(first + k);
                    bad += 1;
                }
            }
        }
        bad
    }

    fn check(&self, block: u32, generation: u32) -> u64 {
        let first = self.pool.pfn(block);
        (0..BLOCK_PAGES)
            .filter(|k| {
                !memory::page_matches_filled(
                    first + k,
                    expected_word(first + k, generation, 0),
                    fill_word,
                )
            })
            .count() as u64
    }

    /// The heartbeat's free-memory words.
    pub fn heartbeat(&self, detail: &mut [u64; report::DETAIL_WORDS]) {
        use report::heartbeat::*;
        let c = self
            .balloon
            .as_ref()
            .map(|b| b.counters)
            .unwrap_or_default();
        let p = &self.pool;
        detail[HINTS] = u64::from(c.rounds) << 32 | u64::from(c.blocks_hinted);
        detail[HELD_BALLOONED] =
            u64::from(p.count(State::Ballooned)) << 32 | u64::from(p.count(State::Held));
        detail[FREE_USED] = u64::from(p.count(State::Used)) << 32 | u64::from(p.count(State::Free));
        detail[CHURNED] = self.churned;
    }
}
