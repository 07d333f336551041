//! The balloon device model: its state as one value, what the driver reads and writes in its
//! config space, and each queue's buffers handed to the part that reads them (`pages.rs`,
//! `stats.rs`, `hinting.rs`). The host's calls on it are in `host.rs`, its migrated state in
//! `state.rs`.

#![forbid(unsafe_code)]

use virtio_queue::Queue;

use super::hinting::HintRound;
use super::pages::PageBuffers;
use super::spec::{
    BalloonCounters, CFG_ACTUAL, CFG_CMD_ID, CFG_NUM_PAGES, CFG_POISON, CONFIG_SIZE, DEVICE_TYPE,
    Discard, F_PAGE_POISON, NAME, OFFERED, QUEUES, Vq, existing,
};
use super::state::BalloonState;
use super::stats::StatsSlot;
use crate::devices::device::DeviceStateError;
use crate::devices::virtio::chain::Chain;
use crate::devices::virtio::device::{
    Disposition, Negotiated, VirtioDevice, VirtioError, drain, read_config_bytes,
};
use crate::memory::GuestRam;

/// The balloon device model.
#[derive(Debug, Default)]
pub struct Balloon {
    /// The driver's accepted features (set at DRIVER_OK or restore; 0 after a reset).
    pub(super) features: u64,
    pub(super) num_pages: u32,
    pub(super) actual: u32,
    pub(super) poison_val: u32,
    pub(super) discard: Discard,
    pub(super) hint: HintRound,
    pub(super) stats: StatsSlot,
    pub(super) counters: BalloonCounters,
}

impl Balloon {
    pub fn new() -> Balloon {
        Balloon::default()
    }

    /// The guest's poison value, if it negotiated PAGE_POISON (else it is meaningless).
    fn poison(&self) -> u32 {
        match self.features & F_PAGE_POISON {
            0 => 0,
            _ => self.poison_val,
        }
    }

    fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        for (at, v) in [
            (CFG_NUM_PAGES, self.num_pages),
            (CFG_ACTUAL, self.actual),
            (CFG_CMD_ID, self.hint.cmd_id),
            (CFG_POISON, self.poison_val),
        ] {
            c[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        c
    }

    /// Whether pages may go back to the host now (see the module doc of `balloon`).
    pub(super) fn may_discard(&self) -> bool {
        self.discard == Discard::Allowed && self.poison() == 0
    }

    /// The page buffers' view of the balloon (`pages.rs`).
    fn pages(&mut self) -> PageBuffers<'_> {
        PageBuffers {
            may_discard: self.may_discard(),
            counters: &mut self.counters,
        }
    }

    fn handle(&mut self, vq: Vq, chain: Chain, ram: &GuestRam) -> Disposition {
        let head = chain.head;
        match vq {
            Vq::Inflate => self.pages().inflate(&chain, ram),
            Vq::Deflate => self.pages().deflate(&chain, ram),
            Vq::Reporting => self.pages().report(&chain, ram),
            Vq::FreePage => {
                let poison = self.poison();
                self.hint.buffer(&chain, ram, poison, &mut self.counters)
            }
            Vq::Stats => return self.stats.buffer(chain, ram, &mut self.counters),
        }
        Disposition::Return { head, len: 0 }
    }

    pub(super) fn state(&self) -> BalloonState {
        BalloonState {
            num_pages: self.num_pages,
            actual: self.actual,
            poison_val: self.poison_val,
            phase: self.hint.phase,
            round: self.hint.round,
            cmd_id: self.hint.cmd_id,
            next_id: self.hint.next_id,
            hint_counters: self.hint.counters,
            stats_held: self.stats.held,
            stats: self.stats.latest.clone(),
            counters: self.counters,
        }
    }

    /// Replaces the state with `s` (validated) for a driver that accepted `features`.
    pub(super) fn apply_state(&mut self, s: BalloonState, features: u64) {
        self.features = features;
        self.num_pages = s.num_pages;
        self.actual = s.actual;
        self.poison_val = s.poison_val;
        self.hint = HintRound {
            phase: s.phase,
            round: s.round,
            cmd_id: s.cmd_id,
            next_id: s.next_id,
            counters: s.hint_counters,
            ..HintRound::default()
        };
        self.stats = StatsSlot {
            held: s.stats_held,
            latest: s.stats,
        };
        self.counters = s.counters;
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn features(&self) -> u64 {
        OFFERED
    }

    fn max_queues(&self) -> usize {
        QUEUES.len()
    }

    fn queue_count(&self, features: u64) -> usize {
        existing(features).count()
    }

    fn queue_max_size(&self, features: u64, index: usize) -> u16 {
        let vq = existing(features).nth(index);
        QUEUES.iter().find(|q| Some(q.0) == vq).map_or(0, |q| q.2)
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config();
        read_config_bytes(&c, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut c = self.config();
        for (i, &b) in data.iter().enumerate() {
            match offset.checked_add(i as u64).map(|a| a as usize) {
                Some(at @ (CFG_ACTUAL..=7 | CFG_POISON..=15)) => c[at] = b,
                _ => tracing::debug!("{NAME}: driver write to a device-owned config byte ignored"),
            }
        }
        let word = |at: usize| u32::from_le_bytes(c[at..at + 4].try_into().unwrap());
        self.actual = word(CFG_ACTUAL);
        self.poison_val = word(CFG_POISON);
    }

    fn activate(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        // What the driver set goes; the host's target, the command id counter (an id is never
        // reused) and the counters stay.
        self.features = 0;
        self.actual = 0;
        self.poison_val = 0;
        self.stats.held = None;
        self.hint.reset();
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        ram: &GuestRam,
    ) -> Result<bool, VirtioError> {
        let Some(vq) = existing(self.features).nth(index) else {
            return Ok(false);
        };
        let features = self.features;
        let drained = drain(index, queue, ram.memory(), features, |chain| {
            self.handle(vq, chain, ram)
        })?;
        self.counters.malformed_buffers += drained.malformed;
        Ok(drained.used)
    }

    fn save(&self) -> Vec<u8> {
        self.state().encode()
    }

    fn restore(
        &mut self,
        data: &[u8],
        negotiated: &Negotiated<'_>,
    ) -> Result<(), DeviceStateError> {
        let s = BalloonState::decode(data, negotiated)?;
        self.apply_state(s, negotiated.features);
        Ok(())
    }
}
