//! The guest's virtio-blk driver over virtio-mmio: one request at a time, of one 4 KiB block
//! (read or write) or a flush, polled (the guest takes no device interrupts: it runs at CPL3).
//!
//! It agrees on `VERSION_1`, and on `FLUSH`, `BLK_SIZE` and `RO` when the device offers them
//! (a read-only disk is only read), and uses one queue. A request is three descriptors in a
//! chain: the 16-byte header (type, sector), the block's buffer (read by the device for a
//! write, written for a read; absent for a flush), and the status byte the device writes
//! last. The device (the VMM's) completes a request while the vCPU waits in the notify write,
//! so the request is done when the write returns; the driver still takes it back from the
//! used ring and checks its status, and a request the device did not return within
//! [`ANSWER_NS`] leaves the driver stopped, since its buffers are still the device's.
//!
//! The queue, the header, the buffer and the status byte live in the guest image, which is
//! identity mapped below 4 GiB: an address in it is a guest-physical address.

use core::ptr::{addr_of_mut, read_volatile, write_volatile};
use core::sync::atomic::{AtomicBool, Ordering, fence};

use ferry_guest_abi::disk::{BLOCK_SIZE, BLOCK_WORDS, SECTORS_PER_BLOCK};
use ferry_guest_abi::params::MmioDevice;
use ferry_guest_abi::virtio::{self, blk};

use super::clock::Clock;
use super::virtio_mmio::{Desc, Refusal, Transport, UsedElem, VERSION_1};

/// Descriptors in the queue: one request of three is all the driver has in flight; eight is
/// the next power of two (split queue sizes are powers of two) with room to spare.
const QUEUE_SIZE: usize = 8;
/// The descriptors a request uses, always the same ones (one request at a time).
const HEADER: u16 = 0;
const DATA: u16 = 1;
const STATUS: u16 = 2;
/// How long the device may take to return a request after the notify before the driver
/// takes it for a device that will not. ferry's VMM returns a request before the notify write
/// completes; QEMU's answers later, and a flush under a `blockdev-mirror` waits for the
/// mirror's target too (its NBD export's fdatasync while it takes gigabytes of copy), which
/// was seen taking over a second; 30 s is past any of that and still ends a hung test. A
/// migration's pause stops the vCPU too and never falls inside the wait.
pub const ANSWER_NS: u64 = 30_000_000_000;
/// What the status byte holds until the device writes it: no status the device sends.
const NO_STATUS: u8 = 0xff;
/// `VIRTQ_AVAIL_F_NO_INTERRUPT` (virtio 1.2, 2.7.7): the driver polls, so the device need
/// not raise its interrupt for each request (a hint the device may ignore).
const AVAIL_F_NO_INTERRUPT: u16 = 1;

/// The split queue: descriptors at 0, the driver (avail) ring at 1024, the device (used) ring
/// at 2048, in one page (the layout balloon.rs uses).
#[repr(C, align(4096))]
struct QueueMem {
    desc: [Desc; QUEUE_SIZE],
    _pad0: [u8; 1024 - 16 * QUEUE_SIZE],
    avail_flags: u16,
    avail_idx: u16,
    avail_ring: [u16; QUEUE_SIZE],
    _pad1: [u8; 1024 - 4 - 2 * QUEUE_SIZE],
    used_flags: u16,
    used_idx: u16,
    used_ring: [UsedElem; QUEUE_SIZE],
    _tail: [u8; 4096 - 2048 - 4 - 8 * QUEUE_SIZE],
}

const _: () = assert!(size_of::<QueueMem>() == 4096);

/// A request's header (virtio 1.2, 5.2.6).
#[repr(C)]
struct Header {
    kind: u32,
    reserved: u32,
    sector: u64,
}

const _: () = assert!(size_of::<Header>() == blk::HEADER_SIZE as usize);

/// The block buffer, page-aligned so that it is one page for the device.
#[repr(C, align(4096))]
pub struct Block(pub [u64; BLOCK_WORDS]);

static mut QUEUE: QueueMem = QueueMem {
    desc: [Desc {
        addr: 0,
        len: 0,
        flags: 0,
        next: 0,
    }; QUEUE_SIZE],
    _pad0: [0; 1024 - 16 * QUEUE_SIZE],
    avail_flags: 0,
    avail_idx: 0,
    avail_ring: [0; QUEUE_SIZE],
    _pad1: [0; 1024 - 4 - 2 * QUEUE_SIZE],
    used_flags: 0,
    used_idx: 0,
    used_ring: [UsedElem { id: 0, len: 0 }; QUEUE_SIZE],
    _tail: [0; 4096 - 2048 - 4 - 8 * QUEUE_SIZE],
};
static mut HEADER_BUF: Header = Header {
    kind: 0,
    reserved: 0,
    sector: 0,
};
static mut BUFFER: Block = Block([0; BLOCK_WORDS]);
static mut STATUS_BUF: u8 = NO_STATUS;
/// Set by the one [`Blk`] there is: the statics above are its alone.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestError {
    /// The device answered with this status (not `S_OK`).
    Status(u8),
    /// The device did not return the request within [`ANSWER_NS`]; the driver is stopped.
    NoAnswer,
    /// The device returned a descriptor that was not the request's.
    WrongDescriptor(u32),
    /// The driver stopped after an earlier request went unanswered.
    Stopped,
}

/// Why the disk could not be set up.
#[derive(Clone, Copy, Debug)]
pub enum StartError {
    Refused(Refusal),
    /// The device's logical block size does not divide a 4 KiB block.
    BlockSize(u32),
    /// Another driver holds the buffers (a second disk).
    Taken,
}

impl core::fmt::Display for StartError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            StartError::Refused(why) => write!(f, "{why}"),
            StartError::BlockSize(size) => write!(
                f,
                "its logical block size of {size} bytes does not divide the workload's 4 KiB blocks"
            ),
            StartError::Taken => f.write_str("the guest drives one disk only"),
        }
    }
}

pub struct Blk {
    t: Transport,
    clock: Clock,
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    pub read_only: bool,
    flush: bool,
    avail: u16,
    used_seen: u16,
    stopped: bool,
}

impl Blk {
    /// Initialises the block device at `dev` (found by its device ID); `clock` times the
    /// device's answers.
    pub fn start(dev: MmioDevice, clock: Clock) -> Result<Blk, StartError> {
        if TAKEN.swap(true, Ordering::Relaxed) {
            return Err(StartError::Taken);
        }
        let t = Transport::new(dev);
        let bit = |f: u32| 1u64 << f;
        let optional = bit(blk::F_FLUSH) | bit(blk::F_BLK_SIZE) | bit(blk::F_RO);
        let agreed = t
            .negotiate(VERSION_1, optional)
            .map_err(StartError::Refused)?;
        if agreed & bit(blk::F_BLK_SIZE) != 0 {
            let size = t.config(blk::CONFIG_BLK_SIZE);
            if size == 0 || !BLOCK_SIZE.is_multiple_of(u64::from(size)) {
                t.fail(Refusal::FeaturesNotOk);
                return Err(StartError::BlockSize(size));
            }
        }
        let q = addr_of_mut!(QUEUE);
        // SAFETY: the queue is this driver's (TAKEN) and not yet the device's.
        unsafe { write_volatile(addr_of_mut!((*q).avail_flags), AVAIL_F_NO_INTERRUPT) };
        let q = q as u64;
        t.setup_queue(0, QUEUE_SIZE as u32, q, q + 1024, q + 2048)
            .map_err(StartError::Refused)?;
        t.driver_ok();
        Ok(Blk {
            t,
            clock,
            capacity_sectors: t.config_u64(blk::CONFIG_CAPACITY),
            read_only: agreed & bit(blk::F_RO) != 0,
            flush: agreed & bit(blk::F_FLUSH) != 0,
            avail: 0,
            used_seen: 0,
            stopped: false,
        })
    }

    /// Whole 4 KiB blocks the disk holds.
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_sectors / SECTORS_PER_BLOCK
    }

    /// The block buffer: what [`Blk::write`] sends and [`Blk::read`] fills.
    pub fn buffer(&mut self) -> &mut Block {
        // SAFETY: the buffer is this driver's (TAKEN), `&mut self` makes the borrow unique,
        // and the device touches it only inside a request, which takes `&mut self` too.
        unsafe { &mut *addr_of_mut!(BUFFER) }
    }

    /// Writes the buffer to 4 KiB block `block`.
    pub fn write(&mut self, block: u64) -> Result<(), RequestError> {
        self.request(blk::T_OUT, block * SECTORS_PER_BLOCK, Some(0))
    }

    /// Reads 4 KiB block `block` into the buffer.
    pub fn read(&mut self, block: u64) -> Result<(), RequestError> {
        self.request(
            blk::T_IN,
            block * SECTORS_PER_BLOCK,
            Some(virtio::DESC_F_WRITE),
        )
    }

    /// Asks the device to make every completed write durable; `Ok(false)` when the device
    /// offers no flush (its writes are durable when they complete, virtio 1.2, 5.2.6.2).
    pub fn flush(&mut self) -> Result<bool, RequestError> {
        if !self.flush {
            return Ok(false);
        }
        self.request(blk::T_FLUSH, 0, None).map(|()| true)
    }

    /// One request: the header, the buffer with `data`'s flags (none for a flush), the
    /// status; notify, take it back, check the status.
    fn request(&mut self, kind: u32, sector: u64, data: Option<u16>) -> Result<(), RequestError> {
        if self.stopped {
            return Err(RequestError::Stopped);
        }
        let q = addr_of_mut!(QUEUE);
        let next = virtio::DESC_F_NEXT;
        // SAFETY: the queue and buffers are this driver's (TAKEN); no request is in flight
        // (each one is taken back before the next is made), so the device reads none of them
        // now. Volatile because the device reads them.
        unsafe {
            write_volatile(
                addr_of_mut!(HEADER_BUF),
                Header {
                    kind,
                    reserved: 0,
                    sector,
                },
            );
            write_volatile(addr_of_mut!(STATUS_BUF), NO_STATUS);
            let status_desc = Desc {
                addr: addr_of_mut!(STATUS_BUF) as u64,
                len: 1,
                flags: virtio::DESC_F_WRITE,
                next: 0,
            };
            let header_desc = |to: u16| Desc {
                addr: addr_of_mut!(HEADER_BUF) as u64,
                len: blk::HEADER_SIZE,
                flags: next,
                next: to,
            };
            match data {
                Some(flags) => {
                    write_volatile(addr_of_mut!((*q).desc[HEADER as usize]), header_desc(DATA));
                    write_volatile(
                        addr_of_mut!((*q).desc[DATA as usize]),
                        Desc {
                            addr: addr_of_mut!(BUFFER) as u64,
                            len: BLOCK_SIZE as u32,
                            flags: flags | next,
                            next: STATUS,
                        },
                    );
                }
                None => {
                    write_volatile(
                        addr_of_mut!((*q).desc[HEADER as usize]),
                        header_desc(STATUS),
                    );
                }
            }
            write_volatile(addr_of_mut!((*q).desc[STATUS as usize]), status_desc);
            write_volatile(
                addr_of_mut!((*q).avail_ring[self.avail as usize % QUEUE_SIZE]),
                HEADER,
            );
            self.avail = self.avail.wrapping_add(1);
            // The descriptors and the ring entry before the index the device reads them by.
            fence(Ordering::SeqCst);
            write_volatile(addr_of_mut!((*q).avail_idx), self.avail);
            fence(Ordering::SeqCst);
        }
        self.t.notify(0);
        let give_up = self.clock.now_ns().saturating_add(ANSWER_NS);
        let used = loop {
            // SAFETY: the device's ring, read volatile since the device writes it.
            let used = unsafe { read_volatile(addr_of_mut!((*q).used_idx)) };
            if used != self.used_seen {
                break used;
            }
            if self.clock.now_ns() >= give_up {
                self.stopped = true;
                return Err(RequestError::NoAnswer);
            }
            core::hint::spin_loop();
        };
        // The used entry and the status byte after the index that published them.
        fence(Ordering::SeqCst);
        // SAFETY: as above; the entry is below the device's index, so it is written.
        let elem = unsafe {
            read_volatile(addr_of_mut!(
                (*q).used_ring[self.used_seen as usize % QUEUE_SIZE]
            ))
        };
        self.used_seen = used;
        if elem.id != u32::from(HEADER) {
            self.stopped = true;
            return Err(RequestError::WrongDescriptor(elem.id));
        }
        // SAFETY: the device returned the request, so the byte is the driver's again.
        match unsafe { read_volatile(addr_of_mut!(STATUS_BUF)) } {
            blk::S_OK => Ok(()),
            status => Err(RequestError::Status(status)),
        }
    }
}
