//! The disk workload (`disk=`): the boot vCPU writes stamped 4 KiB blocks to the virtio-blk
//! disk at `disk-rate=`, reads `disk-read=`% of its accesses back, flushes every
//! [`ferry_guest::disk::FLUSH_INTERVAL_NS`] of writing, and re-reads every written block in
//! sweeps that each verify pass advances by [`VERIFY_NS`] at most.
//!
//! Every write is of the block's next generation, recorded (after the device completed it) in
//! the disk's generation record, which is guest RAM and migrates with the VM; so a read finds
//! a block a migration lost (stale), misplaced or zeroed, and counts it. A request the device
//! failed is counted as an error and its block's record set to never-written, since what the
//! block holds then is unknown; a generation 0 block is never checked.

use ferry_guest::disk::{Access, Chooser, Writable, flush_due};
use ferry_guest::pace::Pace;
use ferry_guest_abi::disk::{BlockCheck, check_block, fill_block};
use ferry_guest_abi::params::{MmioDevice, Params, Rate};
use ferry_guest_abi::report::{DiskCounters, HaltReason};
use ferry_guest_abi::stamp::{NEVER_WRITTEN, next_generation};

use super::blk::{Blk, RequestError};
use super::clock::Clock;
use super::memory;

/// Most blocks per call of [`Disk::work`]: a request is a trip to the VMM and its file (tens
/// of µs), so 64 keep the loop that also writes memory and sends heartbeats turning every few
/// ms; the clock is looked at before each block besides.
const BATCH_BLOCKS: u64 = 64;
/// The share of a verify pass the disk's sweep may take: at tens of µs a request, 50 ms
/// re-reads a few thousand blocks, so a sweep of a 64 MiB disk spans a handful of passes
/// and never makes the memory pass (tens of ms for 256 MiB) look like a pause.
pub const VERIFY_NS: u64 = 50_000_000;
/// Failures named on the serial port, one line each; the counters carry the rest.
const LOGGED_FAILURES: u64 = 8;
/// A sweep looks at the clock every this many record entries it skips (never written).
const SKIPS_PER_CLOCK: u64 = 4096;

pub struct Disk {
    blk: Blk,
    record: &'static mut [u32],
    chooser: Chooser,
    /// `None`: as fast as the device answers (`disk-rate=max`).
    pace: Option<Pace>,
    counters: DiskCounters,
    /// The next block the verify sweep reads.
    sweep: u64,
    writes_since_flush: u64,
    last_flush_ns: u64,
    logged: u64,
}

/// Starts the disk workload if `disk=` asks for one: `Err` when it cannot run (the reason is on
/// the serial port), `Ok(None)` when none is asked for.
pub fn start(
    p: &Params,
    dev: Option<MmioDevice>,
    record_gpa: u64,
    clock: &Clock,
) -> Result<Option<Disk>, HaltReason> {
    let blocks = p.disk_blocks();
    let Some(dev) = dev.filter(|_| blocks > 0) else {
        if blocks > 0 {
            crate::sprintln!(
                "ferry-guest: disk={} MiB but the VM has no virtio-blk disk; give it one or drop disk=",
                p.disk >> 20
            );
            return Err(HaltReason::DiskTooSmall);
        }
        if let Some(dev) = dev {
            crate::sprintln!(
                "ferry-guest: virtio-blk disk at {:#x} left alone: no disk= workload",
                dev.addr
            );
        }
        return Ok(None);
    };
    let blk = Blk::start(dev, *clock).map_err(|why| {
        crate::sprintln!(
            "ferry-guest: the virtio-blk disk at {:#x} is not usable: {why}",
            dev.addr
        );
        HaltReason::DiskTooSmall
    })?;
    if blk.capacity_blocks() < blocks {
        crate::sprintln!(
            "ferry-guest: disk={} MiB is more than the {} MiB the virtio-blk disk holds; lower disk= or give a larger disk",
            p.disk >> 20,
            (blk.capacity_blocks() * ferry_guest_abi::disk::BLOCK_SIZE) >> 20
        );
        return Err(HaltReason::DiskTooSmall);
    }
    let writable = match blk.read_only {
        true => Writable::ReadOnly,
        false => Writable::Yes,
    };
    crate::sprintln!(
        "ferry-guest: disk workload on {} MiB of the virtio-blk disk at {:#x}{}: pattern {}, {}% reads",
        p.disk >> 20,
        dev.addr,
        match writable {
            Writable::ReadOnly => " (read-only: reads only)",
            Writable::Yes => "",
        },
        p.disk_pattern.name(),
        p.disk_read_percent
    );
    let now = clock.now_ns();
    Ok(Some(Disk {
        blk,
        // SAFETY: the plan puts the disk's record in RAM of its own, after the working set's
        // records and before the working set; only the boot vCPU, which owns this, uses it.
        record: unsafe { memory::record(record_gpa, blocks) },
        chooser: Chooser::new(p, writable),
        pace: match p.disk_rate {
            Rate::MegabytesPerSecond(mb) => Some(Pace::new(u64::from(mb) * 1_000_000, now)),
            // `disk-rate=` is never idle (the parser refuses it): flat out.
            Rate::FlatOut | Rate::Idle => None,
        },
        counters: DiskCounters {
            blocks,
            ..DiskCounters::default()
        },
        sweep: 0,
        writes_since_flush: 0,
        last_flush_ns: now,
        logged: 0,
    }))
}

impl Disk {
    pub fn counters(&self) -> DiskCounters {
        self.counters
    }

    /// When the rate next allows a burst of blocks: how long a guest with nothing else to do
    /// may sleep. A burst is what the rate allows in [`ferry_guest::pace::MAX_BURST_NS`] (at
    /// most a batch), as the memory workload's: each wake-up is a trip through CPL0, which
    /// costs ~0.3 ms where CPL0 is emulated, so a wake per block would cost more than the
    /// block.
    pub fn due_ns(&self, now_ns: u64) -> u64 {
        match &self.pace {
            Some(pace) => {
                let burst = pace.pages_in(ferry_guest::pace::MAX_BURST_NS);
                pace.due_ns(now_ns, burst.min(BATCH_BLOCKS))
            }
            None => now_ns,
        }
    }

    /// Makes the accesses the rate allows, [`BATCH_BLOCKS`] at most, stopping once the clock
    /// reads `until_ns`; flushes when one is due. `between` runs before each request (the
    /// network workload looks at its queue there: a request takes tens of µs).
    pub fn work(&mut self, clock: &Clock, until_ns: u64, between: &mut dyn FnMut()) {
        for _ in 0..BATCH_BLOCKS {
            between();
            let now = clock.now_ns();
            let granted = match &mut self.pace {
                Some(pace) => pace.grant(now, 1),
                None => 1,
            };
            if now >= until_ns || granted == 0 {
                break;
            }
            match self.chooser.next(self.record) {
                Access::Write(block) => self.write(block),
                Access::Read(block) => self.read_and_check(block),
            }
        }
        let now = clock.now_ns();
        if flush_due(now, self.last_flush_ns, self.writes_since_flush) {
            self.flush(now);
        }
    }

    /// Flushes the writes made since the last flush (also when the guest stops).
    pub fn flush(&mut self, now_ns: u64) {
        match self.blk.flush() {
            Ok(true) => self.counters.flushes += 1,
            Ok(false) => {}
            Err(e) => self.error(e, "flush", 0),
        }
        self.writes_since_flush = 0;
        self.last_flush_ns = now_ns;
    }

    /// Re-reads written blocks from where the sweep stands until the clock reads `until_ns`;
    /// true when the sweep reached the end of the disk (and starts over at the next call).
    /// `between` runs before each read, as in [`Disk::work`].
    pub fn verify(&mut self, clock: &Clock, until_ns: u64, between: &mut dyn FnMut()) -> bool {
        let mut skipped = 0u64;
        while let Some(&generation) = self.record.get(self.sweep as usize) {
            if generation == NEVER_WRITTEN {
                skipped += 1;
                if skipped.is_multiple_of(SKIPS_PER_CLOCK) && clock.now_ns() >= until_ns {
                    return false;
                }
                self.sweep += 1;
                continue;
            }
            if clock.now_ns() >= until_ns {
                return false;
            }
            between();
            self.read_and_check(self.sweep);
            self.sweep += 1;
        }
        self.sweep = 0;
        self.counters.sweeps += 1;
        true
    }

    fn write(&mut self, block: u64) {
        let generation = next_generation(self.record[block as usize]);
        fill_block(block, generation, &mut self.blk.buffer().0);
        match self.blk.write(block) {
            Ok(()) => {
                self.record[block as usize] = generation;
                self.counters.blocks_written += 1;
                self.writes_since_flush += 1;
            }
            Err(e) => {
                // What the block holds now is unknown: not checked until written again.
                self.record[block as usize] = NEVER_WRITTEN;
                self.error(e, "write", block);
            }
        }
    }

    fn read_and_check(&mut self, block: u64) {
        if let Err(e) = self.blk.read(block) {
            return self.error(e, "read", block);
        }
        self.counters.blocks_read += 1;
        let generation = self.record[block as usize];
        let found = check_block(block, generation, &self.blk.buffer().0);
        if found == BlockCheck::Good {
            return;
        }
        self.counters.verify_failures += 1;
        self.counters.first_bad_block.get_or_insert(block);
        if self.logged < LOGGED_FAILURES {
            self.logged += 1;
            crate::sprintln!(
                "ferry-guest: DISK VERIFY FAILED: block {block} should hold generation {generation}, found {found:?}"
            );
        }
    }

    fn error(&mut self, e: RequestError, what: &str, block: u64) {
        self.counters.request_errors += 1;
        if self.logged < LOGGED_FAILURES {
            self.logged += 1;
            crate::sprintln!("ferry-guest: DISK ERROR: {what} of block {block}: {e:?}");
        }
    }
}

/// The disk's counters on the serial log line: nothing without a disk workload.
pub struct LogText<'a>(pub Option<&'a Disk>);

impl core::fmt::Display for LogText<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let Some(disk) = self.0 else {
            return Ok(());
        };
        let c = &disk.counters;
        write!(
            f,
            " disk: written={} read={} bad={} errors={} flushes={} sweeps={}",
            c.blocks_written,
            c.blocks_read,
            c.verify_failures,
            c.request_errors,
            c.flushes,
            c.sweeps
        )
    }
}
