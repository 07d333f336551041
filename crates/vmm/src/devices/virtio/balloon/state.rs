//! The balloon's own state, carried inside the transport's section: a plain value
//! ([`BalloonState`]), its byte layout (version [`STATE_VERSION`]), and its validation against
//! what the driver negotiated.
//!
//! Layout (little-endian): version 4; num_pages, actual, poison_val 4 each; hint phase 1,
//! round 4, cmd_id 4, next id 4, hint counters 8 × 9; held statistics buffer: flag 1, head 2;
//! statistics: count 1 (at most [`MAX_STATS`]), entries 10 each, updates 8; counters 8 × 6.
//!
//! Not carried: the discard policy (the destination VMM's own), and hint ranges not yet taken
//! (they belong to the source's migration).

#![forbid(unsafe_code)]

use super::hinting::{CMD_ID_DONE, CMD_ID_MIN, CMD_ID_STOP, HintCounters, HintPhase};
use super::spec::{BalloonCounters, F_FREE_PAGE_HINT, NAME, Vq, queue_index};
use super::stats::{BalloonStats, MAX_STATS};
use crate::devices::device::DeviceStateError;
use crate::devices::virtio::codec::{Reader, Writer};
use crate::devices::virtio::device::Negotiated;

/// Version of the balloon's state layout.
pub const STATE_VERSION: u32 = 1;

/// Everything the balloon migrates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalloonState {
    pub num_pages: u32,
    pub actual: u32,
    pub poison_val: u32,
    pub phase: HintPhase,
    pub round: u32,
    pub cmd_id: u32,
    pub next_id: u32,
    pub hint_counters: HintCounters,
    pub stats_held: Option<u16>,
    pub stats: BalloonStats,
    pub counters: BalloonCounters,
}

fn counters_words(c: &BalloonCounters) -> [u64; 6] {
    [
        c.inflated_pages,
        c.deflated_pages,
        c.discarded_pages,
        c.ignored_pfns,
        c.reported_pages,
        c.malformed_buffers,
    ]
}

impl BalloonState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(STATE_VERSION)
            .u32(self.num_pages)
            .u32(self.actual)
            .u32(self.poison_val)
            .u8(self.phase as u8)
            .u32(self.round)
            .u32(self.cmd_id)
            .u32(self.next_id);
        self.hint_counters.words().iter().for_each(|&v| {
            w.u64(v);
        });
        w.bool(self.stats_held.is_some())
            .u16(self.stats_held.unwrap_or(0))
            .u8(self.stats.entries.len() as u8);
        for &(tag, v) in &self.stats.entries {
            w.u16(tag).u64(v);
        }
        w.u64(self.stats.updates);
        counters_words(&self.counters).iter().for_each(|&v| {
            w.u64(v);
        });
        w.into_bytes()
    }

    /// Decodes and validates `b` against what the driver negotiated.
    pub fn decode(b: &[u8], n: &Negotiated<'_>) -> Result<BalloonState, DeviceStateError> {
        let mut r = Reader::new(NAME, b);
        let version = r.u32("balloon state version")?;
        DeviceStateError::check_version(NAME, version, STATE_VERSION..=STATE_VERSION)?;
        let num_pages = r.u32("num_pages")?;
        let actual = r.u32("actual")?;
        let poison_val = r.u32("poison_val")?;
        let phase = r.u8("hint phase")?;
        let phase = HintPhase::from_u8(phase)
            .ok_or_else(|| r.malformed(format!("hint phase {phase} is unknown")))?;
        let round = r.u32("hint round")?;
        let cmd_id = r.u32("free_page_hint_cmd_id")?;
        let next_id = r.u32("next hint id")?;
        let mut words = [0u64; HintCounters::WORDS];
        for w in &mut words {
            *w = r.u64("hint counters")?;
        }
        let held = r.bool("statistics buffer held")?;
        let head = r.u16("statistics buffer head")?;
        let count = r.u8("statistics count")? as usize;
        if count > MAX_STATS {
            return Err(r.malformed(format!("{count} statistics, above {MAX_STATS}")));
        }
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            entries.push((r.u16("statistics tag")?, r.u64("statistics value")?));
        }
        let updates = r.u64("statistics updates")?;
        let mut c = [0u64; 6];
        for w in &mut c {
            *w = r.u64("balloon counters")?;
        }
        r.finish()?;
        let bad = |reason: String| DeviceStateError::Malformed {
            device: NAME,
            reason,
        };

        let hinting = n.features & F_FREE_PAGE_HINT != 0;
        if next_id < CMD_ID_MIN {
            return Err(bad(format!(
                "next hint id {next_id:#x} is below {CMD_ID_MIN:#x}"
            )));
        }
        if phase != HintPhase::Idle && (!hinting || round < CMD_ID_MIN) {
            return Err(bad(format!(
                "hint round {round:#x} in phase {phase:?} without negotiated hinting or a valid id"
            )));
        }
        let in_round = matches!(phase, HintPhase::Requested | HintPhase::Started);
        match cmd_id {
            CMD_ID_STOP | CMD_ID_DONE => {}
            id if id == round && id >= CMD_ID_MIN && phase != HintPhase::Idle => {}
            id => return Err(bad(format!("free_page_hint_cmd_id {id:#x} names no round"))),
        }
        if in_round && cmd_id != round {
            return Err(bad(format!(
                "hint phase {phase:?} but the config holds {cmd_id:#x}"
            )));
        }
        let stats_held = held.then_some(head);
        if let Some(head) = stats_held {
            let size = queue_index(n.features, Vq::Stats)
                .and_then(|i| n.ready_sizes.get(i).copied())
                .unwrap_or(0);
            if head >= size {
                return Err(bad(format!(
                    "held statistics buffer {head} is outside statsq (size {size}, 0: no queue)"
                )));
            }
        }
        Ok(BalloonState {
            num_pages,
            actual,
            poison_val,
            phase,
            round,
            cmd_id,
            next_id,
            hint_counters: HintCounters::from_words(words),
            stats_held,
            stats: BalloonStats { entries, updates },
            counters: BalloonCounters {
                inflated_pages: c[0],
                deflated_pages: c[1],
                discarded_pages: c[2],
                ignored_pfns: c[3],
                reported_pages: c[4],
                malformed_buffers: c[5],
            },
        })
    }
}
