//! The guest's virtio-balloon driver, over virtio-mmio, polled from the workload's loop (the
//! guest takes no device interrupts: it runs at CPL3 and looks at the device every heartbeat).
//!
//! It negotiates `VERSION_1` and `FREE_PAGE_HINT` only, so its queues are inflate (0), deflate
//! (1) and free page (2). Free page hinting, as the virtio specification's balloon section
//! says: when the device's `free_page_hint_cmd_id` changes to a new id, the driver puts an
//! out-buffer holding that id on the free page queue, then one in-buffer per free 2 MiB block,
//! moving each block to `Held`; with no free block left it sends `STOP` (id 0). A block hinted
//! is not used again until the device writes `DONE` (id 1), which frees every held block.
//! `STOP` from the device ends a round early. Inflate and deflate follow `num_pages`, in whole
//! blocks, with the block's 512 page numbers in one buffer, and the driver keeps `actual`.
//!
//! The device (the VMM's) handles a notification while the vCPU waits in the MMIO write, so
//! every buffer is used when the write returns; the driver still reclaims descriptors from the
//! used ring rather than assuming it.

use core::ptr::{addr_of_mut, read_volatile, write_volatile};

use ferry_guest::pool::{BLOCK_PAGES, Pool, State};
use ferry_guest_abi::PAGE_SIZE;
use ferry_guest_abi::params::{FREE_BLOCK, MmioDevice};
use ferry_guest_abi::virtio::{self, balloon};

use super::virtio_mmio::{Desc, Transport, UsedElem, VERSION_1};

/// Descriptors per queue: a notification per 63 hints, ~50 for 6 GiB of free memory.
const QUEUE_SIZE: usize = 64;
const INFLATE: usize = 0;
const DEFLATE: usize = 1;
const FREE_PAGE: usize = 2;

/// One split queue: descriptors at 0, the driver (avail) ring at 1024, the device (used) ring
/// at 2048, all in one page of the image (which is identity mapped, so an address is a GPA).
#[repr(C, align(4096))]
struct QueueMem {
    desc: [Desc; QUEUE_SIZE],
    avail_flags: u16,
    avail_idx: u16,
    avail_ring: [u16; QUEUE_SIZE],
    _pad: [u8; 1024 - 4 - 2 * QUEUE_SIZE],
    used_flags: u16,
    used_idx: u16,
    used_ring: [UsedElem; QUEUE_SIZE],
    _tail: [u8; 4096 - 2048 - 4 - 8 * QUEUE_SIZE],
}

const _: () = assert!(core::mem::size_of::<QueueMem>() == 4096);

const EMPTY_QUEUE: QueueMem = QueueMem {
    desc: [Desc {
        addr: 0,
        len: 0,
        flags: 0,
        next: 0,
    }; QUEUE_SIZE],
    avail_flags: 0,
    avail_idx: 0,
    avail_ring: [0; QUEUE_SIZE],
    _pad: [0; 1024 - 4 - 2 * QUEUE_SIZE],
    used_flags: 0,
    used_idx: 0,
    used_ring: [UsedElem { id: 0, len: 0 }; QUEUE_SIZE],
    _tail: [0; 4096 - 2048 - 4 - 8 * QUEUE_SIZE],
};

static mut QUEUES: [QueueMem; 3] = [EMPTY_QUEUE, EMPTY_QUEUE, EMPTY_QUEUE];
/// Out-buffers of the free page queue: the round's id, then STOP.
static mut CMD_IDS: [u32; 2] = [0; 2];
/// The page numbers of one block, for inflate or deflate.
static mut PFNS: [u32; BLOCK_PAGES as usize] = [0; BLOCK_PAGES as usize];

/// The driver's side of one queue.
struct Queue {
    free: [u16; QUEUE_SIZE],
    free_count: usize,
    avail: u16,
    used_seen: u16,
}

impl Queue {
    const fn new() -> Queue {
        let mut free = [0u16; QUEUE_SIZE];
        let mut i = 0;
        while i < QUEUE_SIZE {
            free[i] = i as u16;
            i += 1;
        }
        Queue {
            free,
            free_count: QUEUE_SIZE,
            avail: 0,
            used_seen: 0,
        }
    }
}

/// What the driver did, for telemetry.
#[derive(Clone, Copy, Debug, Default)]
pub struct BalloonCounters {
    pub rounds: u32,
    pub blocks_hinted: u32,
}

pub struct Balloon {
    t: Transport,
    queues: [Queue; 3],
    last_cmd: u32,
    /// The id of the round being answered, until its blocks ran out or the device stopped it.
    round: Option<u32>,
    /// Blocks hinted per look at most (`hint-batch=`; `u32::MAX` for all).
    batch: u32,
    pub counters: BalloonCounters,
}

fn mem(q: usize) -> *mut QueueMem {
    // SAFETY: only the address is taken; the boot vCPU is the only user of the queues (it
    // alone drives the balloon).
    unsafe { addr_of_mut!(QUEUES[q]) }
}

impl Balloon {
    /// Initialises the balloon at `dev` (found by its device ID); `None`, with the reason on
    /// the serial port, when it refuses the features or the queues.
    pub fn start(dev: MmioDevice, batch: u32) -> Option<Balloon> {
        let mut b = Balloon {
            t: Transport::new(dev),
            queues: [Queue::new(), Queue::new(), Queue::new()],
            last_cmd: balloon::CMD_ID_STOP,
            round: None,
            batch: match batch {
                0 => u32::MAX,
                n => n,
            },
            counters: BalloonCounters::default(),
        };
        let hint = 1 << balloon::F_FREE_PAGE_HINT;
        let set_up = b.t.negotiate(VERSION_1 | hint, 0).and_then(|_| {
            [INFLATE, DEFLATE, FREE_PAGE].into_iter().try_for_each(|q| {
                let base = mem(q) as u64;
                b.t.setup_queue(q as u32, QUEUE_SIZE as u32, base, base + 1024, base + 2048)
            })
        });
        if let Err(why) = set_up {
            crate::sprintln!(
                "ferry-guest: the balloon at {:#x} is not used, free page hinting is off: {why}",
                dev.addr
            );
            return None;
        }
        b.t.driver_ok();
        // An id already in the config from before this boot is not a request to answer.
        b.last_cmd = b.config(balloon::CONFIG_CMD_ID);
        Some(b)
    }

    /// Looks at the device: answers a new hint request, frees held blocks on `DONE`, follows
    /// the inflate target.
    pub fn poll(&mut self, pool: &mut Pool<'_>) {
        let cmd = self.config(balloon::CONFIG_CMD_ID);
        if cmd != self.last_cmd {
            self.last_cmd = cmd;
            self.round = None;
            match cmd {
                balloon::CMD_ID_DONE => {
                    pool.move_all(State::Held, State::Free);
                }
                balloon::CMD_ID_STOP => {}
                id => {
                    self.counters.rounds += 1;
                    self.round = Some(id);
                    self.post_cmd(0, id);
                }
            }
        }
        if let Some(id) = self.round {
            self.hint(pool, id);
        }
        self.follow_target(pool);
    }

    /// Hints every free block (at most `batch` per look), a queue's worth per notification,
    /// then sends STOP; stops early if the device stops the round.
    fn hint(&mut self, pool: &mut Pool<'_>, id: u32) {
        for n in 0..self.batch {
            // A look at the config (one exit) every 16 blocks: a round the device stopped
            // holds back at most that many blocks more until DONE.
            if n % 16 == 15 && self.config(balloon::CONFIG_CMD_ID) != id {
                self.notify(FREE_PAGE);
                self.round = None;
                return;
            }
            self.reclaim(FREE_PAGE);
            if self.queues[FREE_PAGE].free_count == 0 {
                self.notify(FREE_PAGE);
                if self.config(balloon::CONFIG_CMD_ID) != id {
                    self.round = None;
                    return;
                }
                continue;
            }
            match pool.take(State::Free, State::Held) {
                Some(block) => {
                    let gpa = pool.pfn(block) * PAGE_SIZE;
                    self.post(FREE_PAGE, gpa, FREE_BLOCK as u32, virtio::DESC_F_WRITE);
                    self.counters.blocks_hinted += 1;
                }
                None => {
                    self.post_cmd(1, balloon::CMD_ID_STOP);
                    self.notify(FREE_PAGE);
                    self.round = None;
                    return;
                }
            }
        }
        // The batch is spent: hand over what was posted; the round goes on at the next look.
        self.notify(FREE_PAGE);
    }

    /// Inflates or deflates a block at a time towards `num_pages`, then reports `actual`.
    fn follow_target(&mut self, pool: &mut Pool<'_>) {
        let target = u64::from(self.config(balloon::CONFIG_NUM_PAGES)).div_ceil(BLOCK_PAGES);
        let mut have = u64::from(pool.count(State::Ballooned));
        while have != target {
            let (q, block) = match have < target {
                true => (INFLATE, pool.take(State::Free, State::Ballooned)),
                false => (DEFLATE, pool.take(State::Ballooned, State::Free)),
            };
            let Some(block) = block else {
                break;
            };
            let first = pool.pfn(block);
            let pfns = addr_of_mut!(PFNS);
            for k in 0..BLOCK_PAGES {
                // SAFETY: the array is the driver's; the device reads it only during the
                // notification below, when this loop is done.
                unsafe { (*pfns)[k as usize] = (first + k) as u32 };
            }
            self.reclaim(q);
            self.post(q, pfns as u64, (BLOCK_PAGES * 4) as u32, 0);
            self.notify(q);
            self.reclaim(q);
            have = u64::from(pool.count(State::Ballooned));
        }
        if u64::from(self.config(balloon::CONFIG_ACTUAL)) != have * BLOCK_PAGES {
            self.t
                .set_config(balloon::CONFIG_ACTUAL, (have * BLOCK_PAGES) as u32);
        }
    }

    fn post_cmd(&mut self, slot: usize, id: u32) {
        let ids = addr_of_mut!(CMD_IDS);
        // SAFETY: the driver's own array; the device reads it during a later notification.
        unsafe { (*ids)[slot] = id };
        self.reclaim(FREE_PAGE);
        let addr = ids as u64 + 4 * slot as u64;
        self.post(FREE_PAGE, addr, 4, 0);
    }

    /// Puts one buffer on queue `q` (the caller made sure a descriptor is free).
    fn post(&mut self, q: usize, addr: u64, len: u32, flags: u16) {
        let queue = &mut self.queues[q];
        if queue.free_count == 0 {
            self.notify(q);
            self.reclaim(q);
        }
        let queue = &mut self.queues[q];
        let Some(count) = queue.free_count.checked_sub(1) else {
            return;
        };
        queue.free_count = count;
        let d = queue.free[count];
        let m = mem(q);
        // SAFETY: descriptor `d` is free (not in the device's hands) and the rings are ours;
        // volatile because the device reads them.
        unsafe {
            write_volatile(
                addr_of_mut!((*m).desc[d as usize]),
                Desc {
                    addr,
                    len,
                    flags,
                    next: 0,
                },
            );
            write_volatile(
                addr_of_mut!((*m).avail_ring[queue.avail as usize % QUEUE_SIZE]),
                d,
            );
            queue.avail = queue.avail.wrapping_add(1);
            core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
            write_volatile(addr_of_mut!((*m).avail_idx), queue.avail);
        }
    }

    /// Takes back the descriptors the device has used.
    fn reclaim(&mut self, q: usize) {
        let m = mem(q);
        let queue = &mut self.queues[q];
        // SAFETY: reading the device's ring, volatile since the device writes it.
        let used = unsafe { read_volatile(addr_of_mut!((*m).used_idx)) };
        while queue.used_seen != used {
            // SAFETY: as above; the entry is below the device's index, so it is written.
            let UsedElem { id, .. } = unsafe {
                read_volatile(addr_of_mut!(
                    (*m).used_ring[queue.used_seen as usize % QUEUE_SIZE]
                ))
            };
            if (id as usize) < QUEUE_SIZE && queue.free_count < QUEUE_SIZE {
                queue.free[queue.free_count] = id as u16;
                queue.free_count += 1;
            }
            queue.used_seen = queue.used_seen.wrapping_add(1);
        }
    }

    fn notify(&mut self, q: usize) {
        self.t.notify(q as u32);
    }

    fn config(&self, offset: u64) -> u32 {
        self.t.config(offset)
    }
}
