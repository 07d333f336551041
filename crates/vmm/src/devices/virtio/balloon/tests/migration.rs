//! The balloon's state across a save and a restore into a fresh device over the same RAM.

use super::hinting::{command, hint, started, take};
use super::*;
use crate::devices::device::{Device, DeviceStateError};
use crate::devices::virtio::device::{Negotiated, status};
use crate::devices::virtio::mmio::VERSION;
use state::BalloonState;

/// A fresh device over `d`'s RAM, restored from `d`'s saved state; the test driver's own
/// bookkeeping (in a real guest, guest memory) comes along.
fn migrate(d: &Driver<Balloon>) -> Driver<Balloon> {
    let mut e = Driver::with_ram(Balloon::new(), d.ram.clone());
    e.t.restore(VERSION, &d.t.save()).unwrap();
    e.queues = d.queues.clone();
    e
}

#[test]
fn a_round_saved_midway_continues_without_losing_or_repeating_a_buffer() {
    let (mut d, id) = started(ALL);
    let fq = index(&d, Vq::FreePage);
    hint(&mut d, &[(PAGES_AT, 0x2000)]);
    assert_eq!(take(&mut d), [(PAGES_AT, 0x2000)]);
    assert_eq!(d.used(fq).len(), 2);
    // Made available but not yet notified when the vCPUs stop.
    let pending = d.add(fq, &[(PAGES_AT + 0x10000, 0x1000, true)]);

    let mut e = migrate(&d);
    assert_eq!(e.status(), d.status());
    assert_eq!(e.config32(8), id);
    e.notify(fq);
    assert_eq!(e.used(fq), [(pending.into(), 0)], "only the pending buffer");
    assert_eq!(take(&mut e), [(PAGES_AT + 0x10000, 0x1000)]);
    let s = e.t.hint_status();
    assert_eq!((s.phase, s.counters.hinted_pages), (HintPhase::Started, 3));
    command(&mut e, CMD_ID_STOP);
    assert_eq!(e.t.hint_status().counters.driver_stops, 1);
    assert_eq!(
        e.t.start_hinting(),
        Ok(id + 1),
        "the destination never reuses an id"
    );
}

#[test]
fn a_held_statistics_buffer_and_the_counters_migrate() {
    let mut d = running(ALL);
    let sq = index(&d, Vq::Stats);
    let at = d.buffer(&[4, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    let head = d.add(sq, &[(at, 10, false)]);
    d.notify(sq);
    fill(&d, PAGES_AT, 1);
    send_pfns(&mut d, INFLATE, &pfns(PAGES_AT, 1));
    d.write_config32(4, 1);
    d.t.set_target(5);

    let mut e = migrate(&d);
    assert_eq!(e.t.counters(), d.t.counters());
    assert_eq!((e.t.actual(), e.config32(0)), (1, 5));
    assert_eq!(e.t.stats().get(stat_tag::FREE_MEMORY), Some(1));
    assert_eq!(e.t.request_stats(), Ok(true));
    assert_eq!(e.used(sq), [(head.into(), 0)]);
}

fn negotiated(ready_sizes: &[u16]) -> Negotiated<'_> {
    Negotiated {
        features: ALL,
        ready_sizes,
    }
}

#[test]
fn malformed_balloon_states_are_refused_by_field() {
    let (mut d, _) = started(ALL);
    let sq = index(&d, Vq::Stats);
    let at = d.buffer(&[0; 10]);
    d.add(sq, &[(at, 10, false)]);
    d.notify(sq);
    let good = d.t.device().state().encode();
    let sizes = [64, 64, 64, 64, 32];
    assert!(BalloonState::decode(&good, &negotiated(&sizes)).is_ok());
    // Offsets: version 0, phase 16, round 17, cmd id 21, next id 25, held 101, head 102,
    // statistics count 104.
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    };
    let cases = [
        ("version", patch(0, &2u32.to_le_bytes())),
        ("phase", patch(16, &[9])),
        ("round id", patch(17, &5u32.to_le_bytes())),
        ("cmd id", patch(21, &7u32.to_le_bytes())),
        ("cmd id in round", patch(21, &CMD_ID_STOP.to_le_bytes())),
        ("next id", patch(25, &3u32.to_le_bytes())),
        ("held flag", patch(101, &[3])),
        ("held head", patch(102, &64u16.to_le_bytes())),
        ("statistics count", patch(104, &[MAX_STATS as u8 + 1])),
        ("trailing", [good.as_slice(), &[0]].concat()),
    ];
    for (what, bytes) in &cases {
        assert!(
            BalloonState::decode(bytes, &negotiated(&sizes)).is_err(),
            "{what}"
        );
    }
    for len in 0..good.len() {
        assert!(BalloonState::decode(&good[..len], &negotiated(&sizes)).is_err());
    }
    assert!(
        BalloonState::decode(&good, &negotiated(&[64, 64, 0, 64, 32])).is_err(),
        "a held buffer on a queue that is not ready"
    );
    let no_hints = Negotiated {
        features: V1 | F_STATS_VQ,
        ready_sizes: &sizes,
    };
    assert!(
        BalloonState::decode(&good, &no_hints).is_err(),
        "a round without hinting"
    );

    // Through the transport: a refused device state leaves everything as it was.
    let mut e = Driver::with_ram(Balloon::new(), d.ram.clone());
    let before = e.t.save();
    let mut saved = d.t.save();
    let phase_at = saved.len() - good.len() + 16;
    saved[phase_at] = 9;
    assert!(matches!(
        e.t.restore(VERSION, &saved),
        Err(DeviceStateError::Malformed { .. })
    ));
    assert_eq!(e.t.save(), before);
    assert_eq!(e.status() & status::DRIVER_OK, 0);
}
