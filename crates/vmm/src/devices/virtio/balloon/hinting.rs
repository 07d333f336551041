//! Free page hinting (virtio 1.2 §5.5.6.7): rounds in which the guest tells the host which
//! pages it considers free, so a migration can skip sending them.
//!
//! A round, as the spec has it: the device writes a new command id (at least [`CMD_ID_MIN`],
//! never reused) into `free_page_hint_cmd_id` and raises a config interrupt; the driver answers
//! on free_page_vq with a device-readable buffer holding that id, then device-writable buffers
//! each of whose descriptors is a free range; it ends its round with a readable buffer holding
//! [`CMD_ID_STOP`]. The device may end the round early by writing STOP into the config, and
//! writes [`CMD_ID_DONE`] when it no longer needs the hinted pages kept free (the driver may then
//! reuse them).
//!
//! Invariants:
//! - A range is recorded only in phase [`HintPhase::Started`], which only the driver's buffer
//!   holding the current round's id enters: hints with an old or wrong id, before a round, after
//!   DONE, or after the host stopped the round are returned to the driver unrecorded (and
//!   counted: `stale_commands`, `ignored_buffers`, `late_buffers`).
//! - Nothing is recorded while the guest poisons free pages with a non-zero value
//!   (`poisoned_buffers`): the destination would read zeros where the guest expects poison.
//! - The id counter migrates, so a destination never reuses an id the source handed out.
//!
//! What a hint means for a migration (where it bites): a hinted page was free when its buffer
//! was processed. A guest write after that is in KVM's dirty log, so a migration must apply
//! the hints it takes to pages it has not yet sent *before* its next dirty-log sync, or it
//! would drop a page the guest has since reused.

#![forbid(unsafe_code)]

use super::pages::{PAGE, ram_pages};
use super::spec::BalloonCounters;
use crate::devices::virtio::chain::Chain;
use crate::memory::GuestRam;

/// Config value ending a round (virtio 1.2 §5.5.6.7: `VIRTIO_BALLOON_CMD_ID_STOP`).
pub const CMD_ID_STOP: u32 = 0;
/// Config value releasing the hinted pages (`VIRTIO_BALLOON_CMD_ID_DONE`).
pub const CMD_ID_DONE: u32 = 1;
/// The first round id, as QEMU (`VIRTIO_BALLOON_FREE_PAGE_HINT_CMD_ID_MIN`): after
/// `u32::MAX` the ids wrap to it again, 2^31 rounds later.
pub const CMD_ID_MIN: u32 = 0x8000_0000;
/// Ranges held between two takes. Linux hints free blocks of 4 MiB (MAX_ORDER pages on x86),
/// so a 512 GiB guest sends at most 131072 per round; twice that (4 MiB of host memory) leaves
/// slack. Beyond it ranges are dropped and counted, which only costs pages sent in vain.
const MAX_PENDING: usize = 1 << 18;

/// Where a round stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HintPhase {
    /// No round, or the last one is DONE.
    #[default]
    Idle = 0,
    /// The host wrote a new id; the driver has not answered yet.
    Requested = 1,
    /// The driver answered with the id: hints are recorded.
    Started = 2,
    /// The host wrote STOP, or the driver sent STOP: hints arriving now are late.
    Stopped = 3,
}

impl HintPhase {
    pub(super) fn from_u8(v: u8) -> Option<HintPhase> {
        [Self::Idle, Self::Requested, Self::Started, Self::Stopped]
            .into_iter()
            .find(|p| *p as u8 == v)
    }
}

/// Free page hinting since the device was created (they migrate).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HintCounters {
    /// Rounds the host requested.
    pub rounds_requested: u64,
    /// Rounds the driver started with the requested id.
    pub rounds_started: u64,
    /// Rounds the driver ended itself with STOP.
    pub driver_stops: u64,
    /// Pages recorded as free.
    pub hinted_pages: u64,
    /// Hint buffers after the round stopped, returned unrecorded.
    pub late_buffers: u64,
    /// Hint buffers outside any started round, returned unrecorded.
    pub ignored_buffers: u64,
    /// Command buffers with an id that is not the requested round's.
    pub stale_commands: u64,
    /// Hint buffers dropped because the guest poisons free pages with a non-zero value.
    pub poisoned_buffers: u64,
    /// Ranges dropped because the host had not taken the pending ones.
    pub dropped_ranges: u64,
}

impl HintCounters {
    pub(super) const WORDS: usize = 9;

    pub(super) fn words(&self) -> [u64; Self::WORDS] {
        [
            self.rounds_requested,
            self.rounds_started,
            self.driver_stops,
            self.hinted_pages,
            self.late_buffers,
            self.ignored_buffers,
            self.stale_commands,
            self.poisoned_buffers,
            self.dropped_ranges,
        ]
    }

    pub(super) fn from_words(w: [u64; Self::WORDS]) -> HintCounters {
        let [
            rounds_requested,
            rounds_started,
            driver_stops,
            hinted_pages,
            late_buffers,
            ignored_buffers,
            stale_commands,
            poisoned_buffers,
            dropped_ranges,
        ] = w;
        HintCounters {
            rounds_requested,
            rounds_started,
            driver_stops,
            hinted_pages,
            late_buffers,
            ignored_buffers,
            stale_commands,
            poisoned_buffers,
            dropped_ranges,
        }
    }
}

/// What the VMM can see of hinting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HintStatus {
    pub phase: HintPhase,
    /// The current (or last) round's id, 0 before the first.
    pub round: u32,
    /// What `free_page_hint_cmd_id` holds now.
    pub cmd_id: u32,
    /// Ranges recorded and not yet taken.
    pub pending_ranges: usize,
    pub counters: HintCounters,
}

/// Whether the guest poisons free pages with a non-zero value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Poison {
    Zero,
    NonZero,
}

/// The hinting state machine.
#[derive(Clone, Debug)]
pub(super) struct HintRound {
    pub(super) phase: HintPhase,
    pub(super) round: u32,
    pub(super) cmd_id: u32,
    pub(super) next_id: u32,
    pub(super) counters: HintCounters,
    /// Recorded `(gpa, len)` ranges, in order; not migrated (they belong to the source's
    /// migration, which takes them before it ends).
    pub(super) pending: Vec<(u64, u64)>,
}

impl Default for HintRound {
    fn default() -> HintRound {
        HintRound {
            phase: HintPhase::Idle,
            round: 0,
            cmd_id: CMD_ID_STOP,
            next_id: CMD_ID_MIN,
            counters: HintCounters::default(),
            pending: Vec::new(),
        }
    }
}

impl HintRound {
    /// Starts a round; returns its id (the new config value). Hints of earlier rounds that the
    /// host never took are dropped: they were true when given, but a migration that starts now
    /// re-armed dirty tracking after the guest may have reused those pages.
    pub(super) fn begin(&mut self) -> u32 {
        self.drop_pending();
        let id = self.next_id;
        self.next_id = id.checked_add(1).unwrap_or(CMD_ID_MIN);
        self.round = id;
        self.cmd_id = id;
        self.phase = HintPhase::Requested;
        self.counters.rounds_requested += 1;
        id
    }

    /// The host stops the round: returns whether the config changed.
    pub(super) fn stop(&mut self) -> bool {
        if matches!(self.phase, HintPhase::Requested | HintPhase::Started) {
            self.phase = HintPhase::Stopped;
        }
        let changed = self.cmd_id >= CMD_ID_MIN;
        if changed {
            self.cmd_id = CMD_ID_STOP;
        }
        changed
    }

    /// The host releases the hinted pages: returns whether the config changed. Hints not
    /// taken are dropped: once the guest may reuse its pages, they are no longer true.
    pub(super) fn finish(&mut self) -> bool {
        self.drop_pending();
        self.phase = HintPhase::Idle;
        let changed = self.round != 0 && self.cmd_id != CMD_ID_DONE;
        if changed {
            self.cmd_id = CMD_ID_DONE;
        }
        changed
    }

    fn drop_pending(&mut self) {
        self.counters.dropped_ranges += self.pending.len() as u64;
        self.pending.clear();
    }

    /// The driver's device-readable buffer holding command id `id`.
    pub(super) fn command(&mut self, id: u32) {
        match (id, self.phase) {
            (CMD_ID_STOP, HintPhase::Started) => {
                self.phase = HintPhase::Stopped;
                self.counters.driver_stops += 1;
            }
            // Linux also answers the host's STOP with STOP: nothing left to end.
            (CMD_ID_STOP, _) => {}
            (id, HintPhase::Requested) if id == self.round => {
                self.phase = HintPhase::Started;
                self.counters.rounds_started += 1;
            }
            (id, _) => {
                tracing::debug!("virtio-balloon: hint command id {id:#x} is not the round's");
                self.counters.stale_commands += 1;
            }
        }
    }

    /// The driver's device-writable buffer of free ranges (already cut to whole RAM pages).
    pub(super) fn hint(&mut self, ranges: impl IntoIterator<Item = (u64, u64)>, poison: Poison) {
        match (self.phase, poison) {
            (HintPhase::Started, Poison::Zero) => ranges.into_iter().for_each(|r| self.record(r)),
            (HintPhase::Started, Poison::NonZero) => self.counters.poisoned_buffers += 1,
            (HintPhase::Stopped, _) => self.counters.late_buffers += 1,
            (HintPhase::Idle | HintPhase::Requested, _) => self.counters.ignored_buffers += 1,
        }
    }

    fn record(&mut self, (gpa, len): (u64, u64)) {
        let full = self.pending.len() >= MAX_PENDING;
        match self.pending.last_mut() {
            Some((start, l)) if *start + *l == gpa => *l += len,
            _ if full => {
                self.counters.dropped_ranges += 1;
                return;
            }
            _ => self.pending.push((gpa, len)),
        }
        self.counters.hinted_pages += len / PAGE;
    }

    /// Moves the ranges recorded since the last take into `into`, in order.
    pub(super) fn take(&mut self, into: &mut Vec<(u64, u64)>) {
        into.append(&mut self.pending);
    }

    /// The driver reset the device: any round is over, its ranges are void.
    pub(super) fn reset(&mut self) {
        self.phase = HintPhase::Idle;
        self.cmd_id = CMD_ID_STOP;
        self.pending.clear();
    }

    pub(super) fn status(&self) -> HintStatus {
        HintStatus {
            phase: self.phase,
            round: self.round,
            cmd_id: self.cmd_id,
            pending_ranges: self.pending.len(),
            counters: self.counters,
        }
    }
}

impl HintRound {
    /// One buffer on free_page_vq: a command (its readable part, a le32 id), then hints (its
    /// writable descriptors, each a free range), as QEMU reads them, from a guest whose poison
    /// value is `poison`; a malformed one is counted in `counters`. Always returned with length
    /// 0: the device writes nothing into hint buffers.
    pub(super) fn buffer(
        &mut self,
        chain: &Chain,
        ram: &GuestRam,
        poison: u32,
        counters: &mut BalloonCounters,
    ) {
        if chain.readable().next().is_some() {
            match chain.read(ram.memory(), 4).filter(|b| b.len() == 4) {
                Some(b) => self.command(u32::from_le_bytes(b.try_into().unwrap())),
                None => {
                    tracing::warn!("virtio-balloon: a hint command is not 4 bytes of guest RAM");
                    counters.malformed_buffers += 1;
                    return;
                }
            }
        }
        if chain.writable().next().is_none() {
            return;
        }
        let ranges = chain
            .writable()
            .flat_map(|d| ram_pages(ram, d.addr, d.len.into()));
        let poison = match poison {
            0 => Poison::Zero,
            _ => Poison::NonZero,
        };
        self.hint(ranges, poison);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_increase_and_wrap_to_the_minimum() {
        let mut h = HintRound::default();
        assert_eq!(h.begin(), CMD_ID_MIN);
        assert_eq!(h.begin(), CMD_ID_MIN + 1);
        h.next_id = u32::MAX;
        assert_eq!(h.begin(), u32::MAX);
        assert_eq!(h.begin(), CMD_ID_MIN);
    }

    #[test]
    fn only_the_current_id_starts_a_round_and_adjacent_ranges_merge() {
        let mut h = HintRound::default();
        let old = h.begin();
        let id = h.begin();
        h.command(old);
        assert_eq!(h.phase, HintPhase::Requested);
        h.hint([(0x1000, 0x1000)], Poison::Zero);
        h.command(id);
        assert_eq!(h.phase, HintPhase::Started);
        h.hint(
            [(0x2000, 0x1000), (0x3000, 0x2000), (0x8000, 0x1000)],
            Poison::Zero,
        );
        h.hint([(0x9000, 0x1000)], Poison::NonZero);
        let mut got = Vec::new();
        h.take(&mut got);
        assert_eq!(got, [(0x2000, 0x3000), (0x8000, 0x1000)]);
        let c = h.counters;
        assert_eq!((c.stale_commands, c.ignored_buffers), (1, 1));
        assert_eq!((c.hinted_pages, c.poisoned_buffers), (4, 1));
        assert!(h.stop());
        h.hint([(0xa000, 0x1000)], Poison::Zero);
        assert_eq!(h.counters.late_buffers, 1);
        assert!(h.finish());
        assert_eq!(h.cmd_id, CMD_ID_DONE);
        assert!(!h.finish(), "DONE once");
    }
}
