//! The network device model: its tap, its MAC and what the driver reads in config space, the
//! transmit queue written to the tap, and the receive queue filled from it (see the module
//! doc of `net` for when). Its migrated state is in `state.rs`, the host's calls in
//! `host.rs`.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;

use ferry_guest_abi::virtio::net::{self as spec, RX_QUEUE, S_LINK_UP, TX_QUEUE};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::marks::OpenMarks;
use super::options::{Mac, NetOptions, TapSource};
use super::spec::{HEADER, MAX_FRAME, MAX_PENDING, MAX_PENDING_BYTES, NAME, OFFERED, QUEUE_SIZE};
use super::state::{NetState, NetStats};
use crate::devices::device::DeviceStateError;
use crate::devices::virtio::chain::{self, Chain};
use crate::devices::virtio::device::{
    Disposition, Negotiated, VirtioDevice, VirtioError, drain, read_config_bytes,
};
use crate::memory::{GuestRam, TrackedMemory};
use crate::tap::{Tap, TapError};

/// What one receive turn found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Receive {
    /// The tap has no frame waiting (every one that was is in the guest).
    TapEmpty { used: bool },
    /// The driver has no buffer: frames wait in the tap until it gives some.
    NoBuffer { used: bool },
    /// The gate is closed (the VM is not running): nothing was read.
    Closed,
}

impl Receive {
    pub fn used(self) -> bool {
        matches!(
            self,
            Receive::TapEmpty { used: true } | Receive::NoBuffer { used: true }
        )
    }
}

/// A virtio-net device over a tap.
#[derive(Debug)]
pub struct Net {
    options: NetOptions,
    /// `None` until attached: a deferred device (an arriving VM's) attaches its tap at the
    /// state load, so that a local handover can pass the source's instead (a tap takes one
    /// attachment at a time).
    tap: Option<Arc<Tap>>,
    /// The source's tap, passed in a local handover, which [`Net::attach`] takes.
    passed: Option<Tap>,
    /// An arriving VM's own tap, opened at build ([`Net::arriving`]) so that its link is up
    /// by the resume; [`Net::attach`] takes it unless a tap was passed.
    early: Option<Tap>,
    mac: Mac,
    /// The driver's accepted features (set at DRIVER_OK or restore; 0 after a reset).
    features: u64,
    /// Whether received frames may go into guest memory: open while the vCPUs run.
    open: bool,
    /// What the device did first since the gate last opened.
    marks: OpenMarks,
    stats: NetStats,
    /// Written whenever the receive thread should look again: the driver gave buffers, or the
    /// gate opened.
    wake: Arc<EventFd>,
    /// Frames taken from the tap for a migration's destination (read at the source's save,
    /// carried in the state), given to the guest before any frame of the tap.
    pending: VecDeque<Vec<u8>>,
    /// One frame's bounce buffer: the header, the frame, and one byte more to tell a frame
    /// too long from one that fits exactly.
    buf: Vec<u8>,
}

impl Net {
    /// A device over the tap `options` names, attached now, its gate open.
    pub fn open(options: &NetOptions) -> Result<Net, TapError> {
        let mut net = Net::deferred(options);
        net.attach()?;
        net.open = true;
        Ok(net)
    }

    /// A device whose tap is attached later by [`Net::attach`], its gate closed until the VM
    /// first runs (a migration's destination, a restore).
    pub fn deferred(options: &NetOptions) -> Net {
        Net {
            options: options.clone(),
            tap: None,
            passed: None,
            early: None,
            mac: options.mac.unwrap_or_else(Mac::random),
            features: 0,
            open: false,
            marks: OpenMarks::default(),
            stats: NetStats::default(),
            pending: VecDeque::new(),
            wake: Arc::new(
                EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                    .expect("an eventfd (the process is out of descriptors)"),
            ),
            buf: vec![0; HEADER + MAX_FRAME + 1],
        }
    }

    /// A migration's or a restore's device ([`Net::deferred`]) whose own tap is opened now, if
    /// no other process holds it: a tap's link comes up when it is opened, and a bridge takes
    /// a while to forward on a port that just came up, so a tap opened only at the state load
    /// would drop the announce sent at the resume. A tap held elsewhere (`EBUSY`: a local
    /// handover's source, which passes its own) is left for [`Net::attach`]; any other
    /// failure is this VM's to report now, before a source pauses for it.
    pub fn arriving(options: &NetOptions) -> Result<Net, TapError> {
        let mut net = Net::deferred(options);
        let early = match &options.tap {
            TapSource::Name(name) => Tap::open(name),
            TapSource::Fd(fd) => Tap::inherited(*fd),
        };
        match early {
            Ok(tap) => net.early = Some(tap),
            Err(TapError::Attach { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => return Err(e),
        }
        Ok(net)
    }

    /// Keeps `tap`, the source's passed in a local handover, for [`Net::attach`].
    pub fn pass_tap(&mut self, tap: Tap) {
        self.passed = Some(tap);
    }

    /// Attaches the tap: the one a local handover passed, else the one the options name.
    pub fn attach(&mut self) -> Result<(), TapError> {
        if self.tap.is_some() {
            return Ok(());
        }
        let tap = match (self.passed.take(), self.early.take()) {
            (Some(tap), _) => tap,
            (None, Some(tap)) => {
                // What came before the guest's state did is not the guest's to take: a bridge
                // floods a copy of what the source's guest got until the announce.
                let mut stale = 0;
                while let Ok(Some(_)) = tap.recv(&mut self.buf[HEADER..]) {
                    stale += 1;
                }
                if stale > 0 {
                    tracing::debug!("{NAME}: {stale} frames that came before the guest dropped");
                }
                tap
            }
            (None, None) => match &self.options.tap {
                TapSource::Name(name) => Tap::open(name)?,
                TapSource::Fd(fd) => Tap::inherited(*fd)?,
            },
        };
        self.tap = Some(Arc::new(tap));
        self.poke();
        Ok(())
    }

    pub fn mac(&self) -> Mac {
        self.mac
    }

    /// The MAC the user gave (`mac=`), if any.
    pub fn given_mac(&self) -> Option<Mac> {
        self.options.mac
    }

    /// Gives the NIC another MAC (a clone's); the transport must signal the config change.
    pub(crate) fn set_mac(&mut self, mac: Mac) {
        self.mac = mac;
    }

    /// The tap, once attached.
    pub fn tap(&self) -> Option<&Arc<Tap>> {
        self.tap.as_ref()
    }

    pub fn wake_fd(&self) -> Arc<EventFd> {
        self.wake.clone()
    }

    pub fn stats(&self) -> NetStats {
        self.stats
    }

    pub fn is_open(&self) -> bool {
        self.open
    }

    /// What the device did first since the gate last opened.
    pub fn open_marks(&self) -> &OpenMarks {
        &self.marks
    }

    pub(super) fn set_open(&mut self, open: bool) {
        if open && !self.open {
            self.marks = OpenMarks::opened();
        }
        self.open = open;
        self.poke();
    }

    pub(super) fn count_announce(&mut self) {
        self.stats.announces += 1;
    }

    fn poke(&self) {
        // A full counter still wakes the thread; nothing else can fail on an eventfd.
        let _ = self.wake.write(1);
    }

    pub(super) fn state(&self) -> NetState {
        NetState {
            mac: self.mac,
            stats: self.stats,
            pending: self.pending.iter().cloned().collect(),
        }
    }

    /// Moves the frames waiting in the tap into the device, up to [`MAX_PENDING`] frames and
    /// [`MAX_PENDING_BYTES`], so that the state carries them to a migration's destination
    /// (whose guest gets them first) instead of their being lost with the source's tap.
    /// Called at the source's save, the vCPUs paused and the gate closed. Returns how many
    /// it took.
    pub(super) fn take_waiting(&mut self) -> usize {
        let Some(tap) = self.tap.clone() else {
            return 0;
        };
        let mut bytes: usize = self.pending.iter().map(Vec::len).sum();
        let before = self.pending.len();
        while self.pending.len() < MAX_PENDING && bytes + MAX_FRAME <= MAX_PENDING_BYTES {
            match tap.recv(&mut self.buf[HEADER..]) {
                Ok(Some(n)) if n <= MAX_FRAME => {
                    self.pending
                        .push_back(self.buf[HEADER..HEADER + n].to_vec());
                    bytes += n;
                }
                Ok(Some(_)) => self.stats.rx_dropped += 1,
                Ok(None) | Err(_) => break,
            }
        }
        self.pending.len() - before
    }

    /// The next frame for the guest into the bounce buffer (after the header): a pending
    /// one first, else the tap's. `Ok(None)`: none waits.
    fn next_frame(&mut self, tap: &Tap) -> std::io::Result<Option<usize>> {
        if let Some(f) = self.pending.pop_front() {
            self.buf[HEADER..HEADER + f.len()].copy_from_slice(&f);
            return Ok(Some(f.len()));
        }
        tap.recv(&mut self.buf[HEADER..])
    }

    /// Reads frames from the tap into the buffers the driver made available on the receive
    /// `queue`, one frame a buffer, until either runs out, while the gate is open.
    pub(super) fn receive(
        &mut self,
        queue: &mut Queue,
        mem: &TrackedMemory,
    ) -> Result<Receive, VirtioError> {
        let Some(tap) = self.tap.clone().filter(|_| self.open) else {
            return Ok(Receive::Closed);
        };
        self.marks.turn();
        let index = usize::from(RX_QUEUE);
        let mut used = false;
        loop {
            let head = {
                let mut avail = queue.iter(mem).map_err(|source| VirtioError::AvailRing {
                    queue: index,
                    source,
                })?;
                avail.next().map(|c| c.head_index())
            };
            let Some(head) = head else {
                // Out of buffers: ask the driver to notify when it gives more (it skips
                // that notify while the device has some: the receive thread takes them
                // when a frame comes). Buffers given meanwhile are taken now.
                let more =
                    queue
                        .enable_notification(mem)
                        .map_err(|source| VirtioError::AvailRing {
                            queue: index,
                            source,
                        })?;
                match more {
                    true => continue,
                    false => return Ok(Receive::NoBuffer { used }),
                }
            };
            if head >= queue.size() {
                return Err(VirtioError::Head {
                    queue: index,
                    head,
                    size: queue.size(),
                });
            }
            let n = match self.next_frame(&tap) {
                Ok(Some(n)) => n,
                Ok(None) => {
                    queue.go_to_previous_position();
                    // Buffers wait for frames: the driver need not notify when it gives more.
                    queue
                        .disable_notification(mem)
                        .map_err(|source| VirtioError::AvailRing {
                            queue: index,
                            source,
                        })?;
                    return Ok(Receive::TapEmpty { used });
                }
                Err(e) => {
                    queue.go_to_previous_position();
                    tracing::warn!("{NAME}: reading tap {}: {e}", tap.name());
                    return Ok(Receive::TapEmpty { used });
                }
            };
            if n > MAX_FRAME {
                // Longer than the MTU the device announced: the guest could not take it.
                queue.go_to_previous_position();
                self.stats.rx_dropped += 1;
                continue;
            }
            let len =
                match chain::walk(mem, (queue.desc_table(), queue.size()), head, self.features) {
                    Ok(chain) => self.put_frame(&chain, n, mem),
                    Err(e) => {
                        tracing::warn!("{NAME} receive queue: buffer {head} refused: {e}");
                        self.stats.malformed += 1;
                        0
                    }
                };
            queue
                .add_used(mem, head, len)
                .map_err(|source| VirtioError::UsedRing {
                    queue: index,
                    head,
                    source,
                })?;
            used = true;
        }
    }

    /// Writes the header and the `n`-byte frame in the bounce buffer into `chain`'s writable
    /// buffers; returns the bytes written (0: the frame was dropped).
    fn put_frame(&mut self, chain: &Chain, n: usize, mem: &TrackedMemory) -> u32 {
        let total = HEADER + n;
        let room: u64 = chain.writable().map(|d| u64::from(d.len)).sum();
        if chain.readable().next().is_some() || room < total as u64 {
            self.stats.rx_dropped += 1;
            return 0;
        }
        self.buf[..HEADER].fill(0);
        let at = spec::HEADER_NUM_BUFFERS as usize;
        self.buf[at..at + 2].copy_from_slice(&1u16.to_le_bytes());
        let mut done = 0;
        for d in chain.writable() {
            let take = (d.len as usize).min(total - done);
            if mem
                .write_slice(&self.buf[done..done + take], GuestAddress(d.addr))
                .is_err()
            {
                self.stats.malformed += 1;
                return 0;
            }
            done += take;
            if done == total {
                break;
            }
        }
        self.stats.rx_frames += 1;
        self.stats.rx_bytes += n as u64;
        self.marks.received();
        total as u32
    }

    /// Sends the frame in one transmit chain.
    fn transmit(&mut self, chain: &Chain, mem: &TrackedMemory) -> Disposition {
        let head = chain.head;
        let Some(bytes) = chain.read(mem, HEADER + MAX_FRAME + 1) else {
            self.stats.malformed += 1;
            return Disposition::Return { head, len: 0 };
        };
        let frame = bytes.get(HEADER..).unwrap_or_default();
        if frame.is_empty() || frame.len() > MAX_FRAME {
            self.stats.tx_errors += 1;
            return Disposition::Return { head, len: 0 };
        }
        let Some(tap) = &self.tap else {
            self.stats.tx_errors += 1;
            return Disposition::Return { head, len: 0 };
        };
        match tap.send(frame) {
            Ok(()) => {
                self.marks.sent();
                self.stats.tx_frames += 1;
                self.stats.tx_bytes += frame.len() as u64;
            }
            Err(e) => {
                self.stats.tx_errors += 1;
                tracing::debug!("{NAME}: tap {} refused a frame: {e}", tap.name());
            }
        }
        Disposition::Return { head, len: 0 }
    }

    fn config(&self) -> [u8; spec::CONFIG_SIZE as usize] {
        let mut c = [0u8; spec::CONFIG_SIZE as usize];
        c[..6].copy_from_slice(&self.mac.0);
        c[6..8].copy_from_slice(&S_LINK_UP.to_le_bytes());
        c[8..10].copy_from_slice(&1u16.to_le_bytes());
        c[10..12].copy_from_slice(&spec::MTU.to_le_bytes());
        c
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        super::spec::DEVICE_TYPE
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn features(&self) -> u64 {
        OFFERED
    }

    fn max_queues(&self) -> usize {
        2
    }

    fn queue_count(&self, _features: u64) -> usize {
        2
    }

    fn queue_max_size(&self, _features: u64, index: usize) -> u16 {
        match index {
            0 | 1 => QUEUE_SIZE,
            _ => 0,
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config();
        read_config_bytes(&c, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The MAC is writable only with VIRTIO_NET_F_CTRL_MAC_ADDR's legacy path, not offered.
        tracing::debug!("{NAME}: driver write to its read-only config ignored");
    }

    fn activate(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        self.features = 0;
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        ram: &GuestRam,
    ) -> Result<bool, VirtioError> {
        let mem = ram.memory();
        match u16::try_from(index) {
            Ok(RX_QUEUE) => {
                // The driver gave buffers: fill them now from what waits in the tap, and let
                // the receive thread look at the tap again.
                let r = self.receive(queue, mem)?;
                self.poke();
                Ok(r.used())
            }
            Ok(TX_QUEUE) => {
                let features = self.features;
                let drained = drain(index, queue, mem, features, |chain| {
                    self.transmit(&chain, mem)
                })?;
                self.stats.malformed += drained.malformed;
                Ok(drained.used)
            }
            _ => Ok(false),
        }
    }

    fn save(&self) -> Vec<u8> {
        self.state().encode()
    }

    fn restore(
        &mut self,
        data: &[u8],
        negotiated: &Negotiated<'_>,
    ) -> Result<(), DeviceStateError> {
        let s = NetState::decode(data)?;
        self.mac = s.mac;
        self.stats = s.stats;
        self.pending = s.pending.into();
        self.features = negotiated.features;
        Ok(())
    }
}
