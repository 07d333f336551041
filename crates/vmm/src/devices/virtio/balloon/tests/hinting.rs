//! Free page hinting rounds, as a Linux driver runs them.

use super::*;

/// Sends a command buffer holding `id` on free_page_vq.
pub(super) fn command(d: &mut Driver<Balloon>, id: u32) -> u16 {
    let fq = index(d, Vq::FreePage);
    let at = d.buffer(&id.to_le_bytes());
    let head = d.add(fq, &[(at, 4, false)]);
    d.notify(fq);
    head
}

/// Sends one hint buffer of `(gpa, len)` ranges; returns its head.
pub(super) fn hint(d: &mut Driver<Balloon>, ranges: &[(u64, u32)]) -> u16 {
    let fq = index(d, Vq::FreePage);
    let bufs: Vec<_> = ranges.iter().map(|&(g, l)| (g, l, true)).collect();
    let head = d.add(fq, &bufs);
    d.notify(fq);
    head
}

pub(super) fn take(d: &mut Driver<Balloon>) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    d.t.take_hints(&mut v);
    v
}

/// A running balloon in a round the driver started.
pub(super) fn started(features: u64) -> (Driver<Balloon>, u32) {
    let mut d = running(features);
    let id = d.t.start_hinting().unwrap();
    command(&mut d, id);
    assert_eq!(d.t.hint_status().phase, HintPhase::Started);
    (d, id)
}

#[test]
fn a_full_round_records_whole_pages_of_ram_and_ends_with_done() {
    let mut d = running(ALL);
    let fq = index(&d, Vq::FreePage);
    d.take_interrupts();
    let id = d.t.start_hinting().unwrap();
    assert_eq!(id, CMD_ID_MIN);
    assert_eq!(d.config32(8), id);
    assert_eq!(d.take_interrupts(), INT_CONFIG);
    assert_eq!(d.t.hint_status().phase, HintPhase::Requested);

    let cmd = command(&mut d, id);
    let a = hint(&mut d, &[(PAGES_AT, 0x4000)]);
    let b = hint(&mut d, &[(0x200_0010, 0x3000), (RAM - 0x1000, 0x10000)]);
    let used = d.used(fq);
    assert_eq!(used, [(cmd.into(), 0), (a.into(), 0), (b.into(), 0)]);
    assert_eq!(
        take(&mut d),
        [
            (PAGES_AT, 0x4000),
            (0x200_1000, 0x2000),
            (RAM - 0x1000, 0x1000)
        ]
    );
    assert!(take(&mut d).is_empty(), "drained");
    let s = d.t.hint_status();
    assert_eq!((s.counters.rounds_started, s.counters.hinted_pages), (1, 7));

    command(&mut d, CMD_ID_STOP);
    let s = d.t.hint_status();
    assert_eq!((s.phase, s.counters.driver_stops), (HintPhase::Stopped, 1));
    d.take_interrupts();
    d.t.finish_hinting();
    assert_eq!(d.config32(8), CMD_ID_DONE);
    assert_eq!(d.take_interrupts(), INT_CONFIG);
    assert_eq!(d.t.hint_status().phase, HintPhase::Idle);
    assert_eq!(
        d.t.start_hinting(),
        Ok(CMD_ID_MIN + 1),
        "a new id every round"
    );
}

#[test]
fn hints_under_an_old_or_wrong_id_are_ignored() {
    let mut d = running(ALL);
    let old = d.t.start_hinting().unwrap();
    let id = d.t.start_hinting().unwrap();
    command(&mut d, old);
    command(&mut d, 0x1234);
    hint(&mut d, &[(PAGES_AT, 0x1000)]);
    assert!(take(&mut d).is_empty());
    let c = d.t.hint_status().counters;
    assert_eq!(
        (c.stale_commands, c.ignored_buffers, c.hinted_pages),
        (2, 1, 0)
    );
    command(&mut d, id);
    hint(&mut d, &[(PAGES_AT, 0x1000)]);
    assert_eq!(take(&mut d), [(PAGES_AT, 0x1000)]);
}

#[test]
fn hints_after_stop_are_returned_unrecorded_and_counted_late() {
    let (mut d, _) = started(ALL);
    let fq = index(&d, Vq::FreePage);
    hint(&mut d, &[(PAGES_AT, 0x1000)]);
    d.take_interrupts();
    d.t.stop_hinting();
    assert_eq!(d.config32(8), CMD_ID_STOP);
    assert_eq!(d.take_interrupts(), INT_CONFIG);
    d.used(fq);
    let late = hint(&mut d, &[(PAGES_AT + 0x1000, 0x1000)]);
    assert_eq!(d.used(fq), [(late.into(), 0)], "returned to the driver");
    assert_eq!(take(&mut d), [(PAGES_AT, 0x1000)]);
    assert_eq!(d.t.hint_status().counters.late_buffers, 1);
    d.t.finish_hinting();
    assert_eq!(d.config32(8), CMD_ID_DONE);
}

/// A migration cancelled before it took its hints must not hand them to the next one: once
/// the guest may reuse its pages (DONE), or a new migration re-armed dirty tracking, they are
/// no longer true.
#[test]
fn hints_never_taken_do_not_outlive_their_migration() {
    for end in ["finish", "begin again"] {
        let (mut d, _) = started(ALL);
        hint(&mut d, &[(PAGES_AT, 0x2000)]);
        if end == "finish" {
            d.t.finish_hinting();
        }
        let id = d.t.start_hinting().unwrap();
        assert!(
            take(&mut d).is_empty(),
            "{end}: the old round's hints are gone"
        );
        assert_eq!(d.t.hint_status().counters.dropped_ranges, 1, "{end}");
        command(&mut d, id);
        hint(&mut d, &[(PAGES_AT + 0x4000, 0x1000)]);
        assert_eq!(take(&mut d), [(PAGES_AT + 0x4000, 0x1000)], "{end}");
    }
}

#[test]
fn hinting_needs_a_running_driver_that_negotiated_it() {
    let mut d = running(V1 | F_STATS_VQ);
    let e = d.t.start_hinting().unwrap_err();
    assert_eq!(
        e,
        BalloonError::NotNegotiated {
            feature: "VIRTIO_BALLOON_F_FREE_PAGE_HINT"
        }
    );
    assert!(e.to_string().contains("did not accept"), "{e}");
    let mut d = Driver::new(Balloon::new());
    assert!(d.negotiate(ALL));
    let e = d.t.start_hinting().unwrap_err();
    assert!(matches!(e, BalloonError::NotRunning { .. }), "{e}");
    assert_eq!(d.config32(8), CMD_ID_STOP, "nothing was requested");
}

#[test]
fn no_hints_are_recorded_while_the_guest_poisons_free_pages() {
    let mut d = running(ALL);
    d.write_config32(12, 0xaaaa_aaaa);
    let id = d.t.start_hinting().unwrap();
    command(&mut d, id);
    hint(&mut d, &[(PAGES_AT, 0x4000)]);
    assert!(take(&mut d).is_empty());
    let c = d.t.hint_status().counters;
    assert_eq!((c.poisoned_buffers, c.hinted_pages), (1, 0));
}

#[test]
fn a_driver_reset_ends_the_round() {
    let (mut d, id) = started(ALL);
    hint(&mut d, &[(PAGES_AT, 0x1000)]);
    assert!(d.negotiate(ALL));
    assert_eq!(d.t.hint_status().phase, HintPhase::Idle);
    assert!(take(&mut d).is_empty(), "ranges of a reset driver are void");
    assert_eq!(d.config32(8), CMD_ID_STOP);
    assert_eq!(d.t.device().hint.next_id, id + 1, "ids are never reused");
}
