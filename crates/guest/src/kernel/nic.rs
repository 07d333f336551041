//! The guest's virtio-net driver over virtio-mmio: one queue pair, no offloads, polled (the
//! guest takes no device interrupts: it runs at CPL3).
//!
//! It agrees on `VERSION_1` and `MAC` (the address it answers for is the device's), and on
//! `STATUS` and `MTU` when offered, which it only reads. Every frame in either direction is
//! preceded by the 12-byte `virtio_net_hdr` ([`net::HEADER_SIZE`]), zeroed when sent.
//!
//! Receive: [`RX_BUFFERS`] buffers of [`BUFFER_SIZE`] bytes, one descriptor each, all given to
//! the device at start; each comes back holding one whole frame (no offloads, so never more
//! than [`net::MAX_FRAME`] bytes after the header) and is given back as soon as its frame was
//! handled. After giving buffers back the driver notifies the receive queue, unless the
//! device said it needs no notification (`VIRTQ_USED_F_NO_NOTIFY`): a device that ran out of
//! buffers waits for that notify. Looking for a frame is a read of the used index in guest
//! memory, no exit, so the workload may look as often as it likes.
//!
//! Transmit: [`TX_BUFFERS`] buffers, one descriptor each (header and frame together), a
//! notify after each frame unless the device said it needs none. ferry's device sends a frame
//! while the vCPU waits in the notify write; another device (QEMU's) later, so the driver takes back every buffer the device returned before it picks a free
//! one, waits [`TX_WAIT_NS`] at most for one when none is, and then does not send the frame
//! ([`TxError::Full`]).
//!
//! The queues and buffers live in the guest image, identity mapped below 4 GiB: an address
//! in it is a guest-physical address.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};
use core::sync::atomic::{AtomicBool, Ordering, fence};

use ferry_guest_abi::net::Mac;
use ferry_guest_abi::params::MmioDevice;
use ferry_guest_abi::virtio::{self, net};

use super::clock::Clock;
use super::virtio_mmio::{Desc, Refusal, Transport, UsedElem, VERSION_1};

/// Receive buffers: 64 frames queued at once, ~6 ms of a 10,000 frames/s stream, so the
/// device has room while the workload is inside a longer step (a verify pass looks at the
/// queue every 256 pages, a disk request takes tens of µs); 128 KiB of the image.
pub const RX_BUFFERS: usize = 64;
/// Transmit buffers: each answer is one, and ferry's device returns it inside the notify, so
/// one would do. QEMU's sends from its main loop, which on a loaded host fell behind a
/// 10,000 frames/s stream by more than 8 buffers (half the echoes were lost); 64, as many as
/// the receive side, hold as many answers as frames the guest can be given at once.
pub const TX_BUFFERS: usize = 64;
/// How long a frame waits for a transmit buffer the device has not returned: the echo's
/// latency budget. ferry's device never makes it wait.
pub const TX_WAIT_NS: u64 = 1_000_000;
/// Bytes of a buffer: the header and the largest frame (12 + 1514), rounded up to a power of
/// two so that buffers never straddle a page.
pub const BUFFER_SIZE: usize = 2048;
const _: () = assert!(BUFFER_SIZE >= (net::HEADER_SIZE + net::MAX_FRAME) as usize);
const HEADER: usize = net::HEADER_SIZE as usize;
/// `VIRTQ_AVAIL_F_NO_INTERRUPT` (virtio 1.2, 2.7.7): the driver polls.
const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// `VIRTQ_USED_F_NO_NOTIFY` (2.7.10): the device needs no notification for now.
const USED_F_NO_NOTIFY: u16 = 1;

/// A split queue of `N` descriptors (virtio 1.2, 2.7): descriptors, the driver (avail) ring
/// and the device (used) ring, in one page-aligned block.
#[repr(C, align(4096))]
struct Queue<const N: usize> {
    desc: [Desc; N],
    avail: Avail<N>,
    used: Used<N>,
}

#[repr(C)]
struct Avail<const N: usize> {
    flags: u16,
    idx: u16,
    ring: [u16; N],
    used_event: u16,
}

#[repr(C, align(4))]
struct Used<const N: usize> {
    flags: u16,
    idx: u16,
    ring: [UsedElem; N],
    avail_event: u16,
}

impl<const N: usize> Queue<N> {
    /// The guest-physical addresses of the queue at `q`'s descriptors, driver ring and device
    /// ring.
    fn rings(q: *mut Queue<N>) -> [u64; 3] {
        let base = q as u64;
        [
            base,
            base + core::mem::offset_of!(Queue<N>, avail) as u64,
            base + core::mem::offset_of!(Queue<N>, used) as u64,
        ]
    }

    const EMPTY: Queue<N> = Queue {
        desc: [Desc {
            addr: 0,
            len: 0,
            flags: 0,
            next: 0,
        }; N],
        avail: Avail {
            flags: 0,
            idx: 0,
            ring: [0; N],
            used_event: 0,
        },
        used: Used {
            flags: 0,
            idx: 0,
            ring: [UsedElem { id: 0, len: 0 }; N],
            avail_event: 0,
        },
    };
}

#[repr(C, align(2048))]
struct Buffer([u8; BUFFER_SIZE]);

static mut RX: Queue<RX_BUFFERS> = Queue::EMPTY;
static mut TX: Queue<TX_BUFFERS> = Queue::EMPTY;
static mut RX_BUF: [Buffer; RX_BUFFERS] = [const { Buffer([0; BUFFER_SIZE]) }; RX_BUFFERS];
static mut TX_BUF: [Buffer; TX_BUFFERS] = [const { Buffer([0; BUFFER_SIZE]) }; TX_BUFFERS];
/// Set by the one [`Nic`] there is: the statics above are its alone.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// Why the NIC could not be set up.
#[derive(Clone, Copy, Debug)]
pub enum StartError {
    Refused(Refusal),
    /// Another driver holds the buffers (a second NIC).
    Taken,
}

impl core::fmt::Display for StartError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            StartError::Refused(why) => write!(f, "{why}"),
            StartError::Taken => f.write_str("the guest drives one NIC only"),
        }
    }
}

/// Why a frame was not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TxError {
    /// The device held every transmit buffer for [`TX_WAIT_NS`].
    Full,
    /// The frame is longer than a buffer holds after the header.
    TooLong(usize),
}

/// A received frame not yet given back: buffer `id`, `len` bytes with the header.
#[derive(Debug)]
pub struct Rx {
    id: u16,
    len: u32,
}

/// What the device said of itself at start.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    /// The link status (`S_LINK_UP`), if the device reports one.
    pub status: Option<u16>,
    /// The MTU, if the device states one.
    pub mtu: Option<u16>,
}

#[derive(Debug)]
pub struct Nic {
    t: Transport,
    clock: Clock,
    pub mac: Mac,
    pub link: Link,
    rx_avail: u16,
    rx_seen: u16,
    /// Buffers given back since the last notify of the receive queue.
    rx_given: u16,
    tx_avail: u16,
    tx_seen: u16,
    /// Bit `i`: transmit buffer `i` is the driver's.
    tx_free: u64,
    /// The config generation the MAC was read at.
    config_generation: u32,
    /// Frames queued since the last notify.
    tx_queued: u16,
}

const _: () = assert!(TX_BUFFERS <= u64::BITS as usize);

impl Nic {
    /// Initialises the network device at `dev` (found by its device ID) and gives the device
    /// every receive buffer; `clock` times the wait for a transmit buffer.
    pub fn start(dev: MmioDevice, clock: Clock) -> Result<Nic, StartError> {
        if TAKEN.swap(true, Ordering::Relaxed) {
            return Err(StartError::Taken);
        }
        let t = Transport::new(dev);
        let bit = |f: u32| 1u64 << f;
        let agreed = t
            .negotiate(
                VERSION_1 | bit(net::F_MAC),
                bit(net::F_STATUS) | bit(net::F_MTU),
            )
            .map_err(StartError::Refused)?;
        let le16 = |offset| u16::from_le_bytes(t.config_bytes(offset));
        let link = Link {
            status: (agreed & bit(net::F_STATUS) != 0).then(|| le16(net::CONFIG_STATUS)),
            mtu: (agreed & bit(net::F_MTU) != 0).then(|| le16(net::CONFIG_MTU)),
        };
        let (rx, tx) = (addr_of_mut!(RX), addr_of_mut!(TX));
        // SAFETY: the queues and buffers are this driver's (TAKEN) and not yet the device's.
        unsafe {
            write_volatile(addr_of_mut!((*rx).avail.flags), AVAIL_F_NO_INTERRUPT);
            write_volatile(addr_of_mut!((*tx).avail.flags), AVAIL_F_NO_INTERRUPT);
            for i in 0..RX_BUFFERS {
                let desc = Desc {
                    addr: addr_of!(RX_BUF) as u64 + (i * size_of::<Buffer>()) as u64,
                    len: BUFFER_SIZE as u32,
                    flags: virtio::DESC_F_WRITE,
                    next: 0,
                };
                write_volatile(addr_of_mut!((*rx).desc[i]), desc);
                write_volatile(addr_of_mut!((*rx).avail.ring[i]), i as u16);
            }
            fence(Ordering::SeqCst);
            write_volatile(addr_of_mut!((*rx).avail.idx), RX_BUFFERS as u16);
        }
        for (q, size, [desc, avail, used]) in [
            (net::RX_QUEUE, RX_BUFFERS, Queue::rings(rx)),
            (net::TX_QUEUE, TX_BUFFERS, Queue::rings(tx)),
        ] {
            t.setup_queue(u32::from(q), size as u32, desc, avail, used)
                .map_err(StartError::Refused)?;
        }
        t.driver_ok();
        t.notify(u32::from(net::RX_QUEUE));
        Ok(Nic {
            t,
            clock,
            config_generation: t.read(virtio::mmio::CONFIG_GENERATION),
            mac: Mac(t.config_bytes(net::CONFIG_MAC)),
            link,
            rx_avail: RX_BUFFERS as u16,
            rx_seen: 0,
            rx_given: 0,
            tx_avail: 0,
            tx_seen: 0,
            tx_free: u64::MAX >> (u64::BITS as usize - TX_BUFFERS),
            tx_queued: 0,
        })
    }

    /// The MAC again if the device's config changed since it was read (a restored clone's
    /// NIC gets a new one): one register read, a trip to the VMM.
    pub fn mac_changed(&mut self) -> Option<Mac> {
        let generation = self.t.read(virtio::mmio::CONFIG_GENERATION);
        if generation == self.config_generation {
            return None;
        }
        self.config_generation = generation;
        let mac = Mac(self.t.config_bytes(net::CONFIG_MAC));
        (mac != self.mac).then(|| {
            self.mac = mac;
            mac
        })
    }

    /// Whether the device has filled a frame not yet taken: one read of guest memory, no
    /// exit, inlined into the workload's loops.
    #[inline(always)]
    pub fn pending(&self) -> bool {
        // SAFETY: the device's ring, read volatile since the device writes it.
        unsafe { read_volatile(addr_of!((*addr_of!(RX)).used.idx)) != self.rx_seen }
    }

    /// The next frame the device filled, if there is one.
    pub fn receive(&mut self) -> Option<Rx> {
        if !self.pending() {
            return None;
        }
        let rx = addr_of_mut!(RX);
        // The entry after the index that published it.
        fence(Ordering::SeqCst);
        let at = self.rx_seen as usize % RX_BUFFERS;
        // SAFETY: as above; the entry is below the device's index, so it is written.
        let elem = unsafe { read_volatile(addr_of!((*rx).used.ring[at])) };
        self.rx_seen = self.rx_seen.wrapping_add(1);
        Some(Rx {
            // An entry naming a buffer the device was never given is skipped: the driver reads
            // no memory that is not a buffer of its own.
            id: u16::try_from(elem.id)
                .ok()
                .filter(|id| usize::from(*id) < RX_BUFFERS)?,
            len: elem.len.min(BUFFER_SIZE as u32),
        })
    }

    /// The frame `rx` holds, without its header (empty if the device wrote no more).
    pub fn frame(&self, rx: &Rx) -> &[u8] {
        let len = (rx.len as usize).saturating_sub(HEADER);
        // SAFETY: the device returned the buffer and has not been given it back (that takes
        // `rx` and `&mut self`, which this borrow prevents); in bounds by `receive`'s checks.
        let buf = unsafe { &*addr_of!(RX_BUF[usize::from(rx.id)]) };
        &buf.0[HEADER..HEADER + len]
    }

    /// Gives `rx`'s buffer back to the device; [`Nic::kick`] tells it.
    pub fn give_back(&mut self, rx: Rx) {
        let q = addr_of_mut!(RX);
        let at = self.rx_avail as usize % RX_BUFFERS;
        self.rx_avail = self.rx_avail.wrapping_add(1);
        self.rx_given += 1;
        // SAFETY: the ring slot is the driver's (the device has at most RX_BUFFERS buffers,
        // and this one is back); the descriptor still names the buffer. Volatile and fenced
        // because the device reads the ring by the index.
        unsafe {
            write_volatile(addr_of_mut!((*q).avail.ring[at]), rx.id);
            fence(Ordering::SeqCst);
            write_volatile(addr_of_mut!((*q).avail.idx), self.rx_avail);
        }
    }

    /// Notifies the receive queue if buffers were given back since the last notify and the
    /// device did not say it needs none: a device that ran out waits for it.
    pub fn kick(&mut self) {
        if self.rx_given == 0 {
            return;
        }
        self.rx_given = 0;
        fence(Ordering::SeqCst);
        // SAFETY: the device's flags, read volatile since the device writes them.
        let flags = unsafe { read_volatile(addr_of!((*addr_of!(RX)).used.flags)) };
        if flags & USED_F_NO_NOTIFY == 0 {
            self.t.notify(u32::from(net::RX_QUEUE));
        }
    }

    /// Queues `frame` for sending (the header is the driver's); [`Nic::flush`] tells the
    /// device. With every transmit buffer out, flushes first to get them back.
    pub fn queue(&mut self, frame: &[u8]) -> Result<(), TxError> {
        if frame.len() > BUFFER_SIZE - HEADER {
            return Err(TxError::TooLong(frame.len()));
        }
        self.take_back_tx();
        if self.tx_free == 0 {
            self.flush();
            let give_up = self.clock.now_ns().saturating_add(TX_WAIT_NS);
            while self.tx_free == 0 {
                if self.clock.now_ns() >= give_up {
                    return Err(TxError::Full);
                }
                core::hint::spin_loop();
                self.take_back_tx();
            }
        }
        let id = self.tx_free.trailing_zeros() as usize;
        self.tx_free &= !(1 << id);
        let q = addr_of_mut!(TX);
        let at = self.tx_avail as usize % TX_BUFFERS;
        self.tx_avail = self.tx_avail.wrapping_add(1);
        self.tx_queued += 1;
        // SAFETY: buffer `id` and its descriptor are the driver's (its bit was free); the ring
        // slot too (at most TX_BUFFERS in flight). Volatile and fenced: the device reads them.
        unsafe {
            let buf = &mut *addr_of_mut!(TX_BUF[id]);
            buf.0[..HEADER].fill(0);
            buf.0[HEADER..HEADER + frame.len()].copy_from_slice(frame);
            let desc = Desc {
                addr: buf.0.as_ptr() as u64,
                len: (HEADER + frame.len()) as u32,
                flags: 0,
                next: 0,
            };
            write_volatile(addr_of_mut!((*q).desc[id]), desc);
            write_volatile(addr_of_mut!((*q).avail.ring[at]), id as u16);
            fence(Ordering::SeqCst);
            write_volatile(addr_of_mut!((*q).avail.idx), self.tx_avail);
            fence(Ordering::SeqCst);
        }
        Ok(())
    }

    /// Tells the device about the frames queued since the last flush: one notify for a batch
    /// (each is a trip to the VMM), unless the device said it needs none.
    pub fn flush(&mut self) {
        if self.tx_queued == 0 {
            return;
        }
        self.tx_queued = 0;
        // A device still sending the last frames (QEMU's, from its loop) says it needs no
        // notify and finds these too; ferry's never says so and sends inside the notify.
        // SAFETY: the device's flags, read volatile since the device writes them.
        let flags = unsafe { read_volatile(addr_of!((*addr_of!(TX)).used.flags)) };
        if flags & USED_F_NO_NOTIFY == 0 {
            self.t.notify(u32::from(net::TX_QUEUE));
        }
        self.take_back_tx();
    }

    /// Marks free every transmit buffer the device returned.
    fn take_back_tx(&mut self) {
        let q = addr_of_mut!(TX);
        loop {
            // SAFETY: the device's ring, read volatile since the device writes it.
            let used = unsafe { read_volatile(addr_of!((*q).used.idx)) };
            if used == self.tx_seen {
                return;
            }
            fence(Ordering::SeqCst);
            let at = self.tx_seen as usize % TX_BUFFERS;
            // SAFETY: as above; the entry is below the device's index.
            let elem = unsafe { read_volatile(addr_of!((*q).used.ring[at])) };
            self.tx_seen = self.tx_seen.wrapping_add(1);
            if (elem.id as usize) < TX_BUFFERS {
                self.tx_free |= 1 << elem.id;
            }
        }
    }
}
