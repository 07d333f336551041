//! A hostile driver: whatever it writes, the device neither crashes, loops, nor touches or
//! records memory outside guest RAM.

use super::hinting::{started, take};
use super::*;
use crate::devices::virtio::device::status;
use crate::devices::virtio::testdriver::{F_INDIRECT, F_NEXT, F_WRITE};

fn needs_reset(d: &mut Driver<Balloon>) -> bool {
    d.status() & status::DEVICE_NEEDS_RESET != 0
}

#[test]
fn malformed_hint_chains_are_returned_unrecorded() {
    let (mut d, _) = started(ALL);
    let fq = index(&d, Vq::FreePage);
    let size = d.queues[fq].size;
    d.used(fq);
    // Each case is processed before the next one reuses the table's slots.
    let check = |d: &mut Driver<Balloon>, descs: &[(u64, u32, u16, u16)]| {
        let head = d.add_raw(fq, descs);
        d.notify(fq);
        assert_eq!(d.used(fq), [(u32::from(head), 0)], "{descs:x?} comes back");
    };
    // A descriptor that chains to itself.
    let s = d.next_slot(fq);
    check(&mut d, &[(PAGES_AT, 0x1000, F_WRITE | F_NEXT, s)]);
    // A chain through every slot and back: longer than the queue.
    let s = d.next_slot(fq);
    let ring: Vec<_> = (0..size)
        .map(|i| (PAGES_AT, 0x1000, F_WRITE | F_NEXT, (s + i + 1) % size))
        .collect();
    check(&mut d, &ring);
    // An indirect table far outside RAM (and indirect was not negotiated).
    check(&mut d, &[(1 << 40, 32, F_INDIRECT, 0)]);
    // A length that wraps the address space.
    check(&mut d, &[(u64::MAX - 0x10, 0x1000, F_WRITE, 0)]);
    // A next index outside the table.
    check(&mut d, &[(PAGES_AT, 0x1000, F_WRITE | F_NEXT, size + 3)]);
    assert!(take(&mut d).is_empty(), "nothing recorded");
    assert_eq!(d.t.counters().malformed_buffers, 5);
    assert_eq!(d.t.hint_status().counters.hinted_pages, 0);
    assert!(!needs_reset(&mut d), "a bad buffer is not a dead device");
}

#[test]
fn hints_outside_ram_are_cut_or_dropped() {
    let (mut d, _) = started(ALL);
    let fq = index(&d, Vq::FreePage);
    let bufs = [
        (1u64 << 40, 0x10000, true),
        (RAM, 0x1000, true),
        (3 << 30, 0x1000, true),
        (PAGES_AT + 1, 0xfff, true),
    ];
    d.add(fq, &bufs);
    d.notify(fq);
    assert!(take(&mut d).is_empty());
    assert_eq!(
        d.t.counters().malformed_buffers,
        0,
        "well-formed, just not RAM"
    );
}

#[test]
fn pfn_buffers_outside_ram_or_too_large_touch_nothing() {
    let mut d = running(V1);
    fill(&d, PAGES_AT, 1);
    d.add(INFLATE, &[(RAM - 2, 8, false)]);
    d.add(INFLATE, &[(PAGES_AT, 1 << 20, false)]);
    d.add(
        INFLATE,
        &[(PAGES_AT, u32::MAX, false), (PAGES_AT, u32::MAX, false)],
    );
    d.notify(INFLATE);
    assert_eq!(d.used(INFLATE).len(), 3);
    let c = d.t.counters();
    assert_eq!(
        (c.malformed_buffers, c.inflated_pages, c.discarded_pages),
        (3, 0, 0)
    );
    assert!(!is_zero(&d, PAGES_AT));
}

#[test]
fn a_head_outside_the_queue_needs_a_reset() {
    let mut d = running(V1);
    d.make_available(INFLATE, 500);
    d.notify(INFLATE);
    assert!(needs_reset(&mut d));
    assert!(d.used(INFLATE).is_empty());
    assert!(d.negotiate(V1), "a reset brings it back");
    assert!(!needs_reset(&mut d));
}

#[test]
fn command_buffers_of_the_wrong_shape_are_refused() {
    let mut d = running(ALL);
    let fq = index(&d, Vq::FreePage);
    let id = d.t.start_hinting().unwrap();
    let at = d.buffer(&id.to_le_bytes());
    d.add(fq, &[(at, 2, false)]);
    d.add(fq, &[(RAM - 2, 4, false)]);
    d.notify(fq);
    assert_eq!(d.used(fq).len(), 2);
    assert_eq!(d.t.counters().malformed_buffers, 2);
    assert_eq!(d.t.hint_status().phase, HintPhase::Requested, "not started");
}
