//! The balloon driven through the transport's registers by the test driver: queues, config,
//! inflate and deflate, reporting, statistics. Hinting, hostile drivers and migration have
//! files of their own.

mod hinting;
mod hostile;
mod migration;

use super::*;
use crate::devices::device::Device;
use crate::devices::virtio::device::VIRTIO_F_VERSION_1;
use crate::devices::virtio::mmio::{INT_CONFIG, INT_USED_BUFFER};
use crate::devices::virtio::testdriver::{Driver, RAM};

const V1: u64 = VIRTIO_F_VERSION_1;
const ALL: u64 = V1 | F_STATS_VQ | F_FREE_PAGE_HINT | F_PAGE_POISON | F_REPORTING;
const INFLATE: usize = 0;
const DEFLATE: usize = 1;
/// Pages the tests fill and balloon, well above the rings and buffers.
const PAGES_AT: u64 = 0x100_0000;

fn running(features: u64) -> Driver<Balloon> {
    Driver::running(Balloon::new(), features)
}

/// The index of `vq` for what the driver negotiated.
fn index(d: &Driver<Balloon>, vq: Vq) -> usize {
    queue_index(d.t.driver_features(), vq).unwrap()
}

/// Writes a non-zero pattern into `pages` pages at `gpa`.
fn fill(d: &Driver<Balloon>, gpa: u64, pages: u64) {
    d.ram
        .write(gpa, &vec![0x5a; (pages * PAGE) as usize])
        .unwrap();
}

fn is_zero(d: &Driver<Balloon>, gpa: u64) -> bool {
    let mut b = vec![0u8; PAGE as usize];
    d.ram.read(gpa, &mut b).unwrap();
    b.iter().all(|&x| x == 0)
}

/// Whether any populated extent of guest RAM overlaps `[gpa, gpa + len)`.
fn populated(d: &Driver<Balloon>, gpa: u64, len: u64) -> bool {
    d.ram
        .data_extents()
        .unwrap()
        .iter()
        .any(|&(s, l)| s < gpa + len && gpa < s + l)
}

/// Sends `pfns` on queue `q` in one buffer and notifies; returns the used entries.
fn send_pfns(d: &mut Driver<Balloon>, q: usize, pfns: &[u32]) -> Vec<(u32, u32)> {
    let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
    let at = d.buffer(&bytes);
    let head = d.add(q, &[(at, bytes.len() as u32, false)]);
    d.notify(q);
    let used = d.used(q);
    assert_eq!(used, [(u32::from(head), 0)], "the buffer comes back");
    used
}

fn pfns(gpa: u64, pages: u64) -> Vec<u32> {
    (0..pages).map(|i| ((gpa >> 12) + i) as u32).collect()
}

#[test]
fn queues_are_numbered_over_the_negotiated_ones() {
    let mut d = Driver::new(Balloon::new());
    assert!(d.negotiate(V1 | F_FREE_PAGE_HINT));
    assert_eq!(
        (d.queue_max(2), d.queue_max(3)),
        (1024, 0),
        "free_page_vq takes index 2 without statsq"
    );
    assert!(d.negotiate(ALL));
    let max: Vec<u16> = (0..6).map(|q| d.queue_max(q)).collect();
    assert_eq!(max, [128, 128, 128, 1024, 32, 0]);
    assert!(d.negotiate(V1 | F_REPORTING));
    assert_eq!((d.queue_max(2), d.queue_max(3)), (32, 0));
}

#[test]
fn inflate_punches_pages_out_of_the_memfd_and_ignores_pfns_outside_ram() {
    let mut d = running(V1);
    fill(&d, PAGES_AT, 16);
    assert!(populated(&d, PAGES_AT, 16 * PAGE));
    let before = d.ram.allocated_bytes().unwrap();
    let mut list = pfns(PAGES_AT, 16);
    list.extend([(RAM >> 12) as u32 + 5, u32::MAX]);
    send_pfns(&mut d, INFLATE, &list);
    let c = d.t.counters();
    assert_eq!(
        (c.inflated_pages, c.ignored_pfns, c.discarded_pages),
        (16, 2, 16)
    );
    assert!(!populated(&d, PAGES_AT, 16 * PAGE), "the pages are holes");
    let after = d.ram.allocated_bytes().unwrap();
    // tmpfs block accounting is coarse; the extents above are exact, this only says "less".
    assert!(after < before, "{before} -> {after}");
    assert!(is_zero(&d, PAGES_AT + 5 * PAGE));
    assert_eq!(d.take_interrupts(), INT_USED_BUFFER);
}

#[test]
fn inflate_keeps_pages_while_discarding_is_forbidden_or_the_guest_poisons() {
    let mut d = running(V1 | F_PAGE_POISON);
    fill(&d, PAGES_AT, 4);
    d.t.set_discard(Discard::Forbidden);
    send_pfns(&mut d, INFLATE, &pfns(PAGES_AT, 2));
    d.t.set_discard(Discard::Allowed);
    d.write_config32(12, 0xaa);
    send_pfns(&mut d, INFLATE, &pfns(PAGES_AT + 2 * PAGE, 2));
    let c = d.t.counters();
    assert_eq!((c.inflated_pages, c.discarded_pages), (4, 0));
    assert!(populated(&d, PAGES_AT, 4 * PAGE));
    assert!(!is_zero(&d, PAGES_AT + 3 * PAGE));

    // Without PAGE_POISON negotiated the poison value means nothing.
    let mut d = running(V1);
    fill(&d, PAGES_AT, 1);
    d.write_config32(12, 0xaa);
    send_pfns(&mut d, INFLATE, &pfns(PAGES_AT, 1));
    assert_eq!(d.t.counters().discarded_pages, 1);
}

#[test]
fn deflate_is_counted_and_leaves_memory_alone() {
    let mut d = running(V1);
    fill(&d, PAGES_AT, 2);
    send_pfns(
        &mut d,
        DEFLATE,
        &[pfns(PAGES_AT, 2), vec![u32::MAX]].concat(),
    );
    let c = d.t.counters();
    assert_eq!(
        (c.deflated_pages, c.ignored_pfns, c.discarded_pages),
        (2, 1, 0)
    );
    assert!(!is_zero(&d, PAGES_AT));
}

#[test]
fn config_fields_belong_to_their_writers() {
    let mut d = running(V1);
    d.take_interrupts();
    d.t.set_target(300);
    assert_eq!(d.config32(0), 300);
    assert_eq!(d.take_interrupts(), INT_CONFIG);
    d.write_config32(0, 9);
    d.write_config32(8, 0x9999_9999);
    assert_eq!(
        (d.config32(0), d.config32(8)),
        (300, CMD_ID_STOP),
        "device-owned"
    );
    d.write_config32(4, 120);
    assert_eq!(d.t.actual(), 120);
    assert_eq!(d.config32(4), 120);
    let mut b = [0xffu8; 8];
    d.t.read(0x100 + 14, &mut b);
    assert_eq!(b, [0; 8], "beyond config space reads zero");
}

#[test]
fn reported_free_pages_are_punched_whole_pages_only() {
    let mut d = running(ALL);
    let rq = index(&d, Vq::Reporting);
    fill(&d, PAGES_AT, 8);
    let head = d.add(
        rq,
        &[
            (PAGES_AT, 4 * PAGE as u32, true),
            (PAGES_AT + 4 * PAGE + 0x800, 4 * PAGE as u32 - 0x800, true),
        ],
    );
    d.notify(rq);
    assert_eq!(d.used(rq), [(u32::from(head), 0)]);
    let c = d.t.counters();
    assert_eq!((c.reported_pages, c.discarded_pages), (7, 7));
    assert!(!populated(&d, PAGES_AT, 4 * PAGE));
    assert!(!is_zero(&d, PAGES_AT + 4 * PAGE), "the partial page stays");
    assert!(!populated(&d, PAGES_AT + 5 * PAGE, 3 * PAGE));

    d.t.set_discard(Discard::Forbidden);
    fill(&d, PAGES_AT, 1);
    d.add(rq, &[(PAGES_AT, PAGE as u32, true)]);
    d.notify(rq);
    assert_eq!(d.t.counters().reported_pages, 8);
    assert!(!is_zero(&d, PAGES_AT), "not punched while forbidden");
}

fn stats_buffer(d: &mut Driver<Balloon>, entries: &[(u16, u64)]) -> u16 {
    let bytes: Vec<u8> = entries
        .iter()
        .flat_map(|&(t, v)| [t.to_le_bytes().as_slice(), &v.to_le_bytes()].concat())
        .collect();
    let at = d.buffer(&bytes);
    let sq = index(d, Vq::Stats);
    let head = d.add(sq, &[(at, bytes.len() as u32, false)]);
    d.notify(sq);
    head
}

#[test]
fn statistics_are_read_held_and_returned_on_request() {
    let mut d = running(ALL);
    let sq = index(&d, Vq::Stats);
    assert_eq!(d.t.request_stats(), Ok(false), "nothing held yet");
    let first = stats_buffer(
        &mut d,
        &[
            (stat_tag::FREE_MEMORY, 1000),
            (stat_tag::TOTAL_MEMORY, 4000),
        ],
    );
    assert!(d.used(sq).is_empty(), "the buffer is held");
    assert_eq!(d.t.stats().get(stat_tag::FREE_MEMORY), Some(1000));
    assert_eq!(d.t.stats().updates, 1);
    d.take_interrupts();
    assert_eq!(d.t.request_stats(), Ok(true));
    assert_eq!(d.used(sq), [(u32::from(first), 0)]);
    assert_eq!(d.take_interrupts(), INT_USED_BUFFER);
    assert_eq!(d.t.request_stats(), Ok(false), "returned once");

    let second = stats_buffer(&mut d, &[(stat_tag::FREE_MEMORY, 900)]);
    let third = stats_buffer(&mut d, &vec![(7, 1); MAX_STATS + 5]);
    assert_eq!(
        d.used(sq),
        [(u32::from(second), 0)],
        "a second buffer returns the first"
    );
    assert_eq!(d.t.stats().entries.len(), MAX_STATS, "bounded");
    assert_eq!(d.t.request_stats(), Ok(true));
    assert_eq!(d.used(sq), [(u32::from(third), 0)]);

    let mut plain = running(V1);
    assert!(matches!(
        plain.t.request_stats(),
        Err(BalloonError::NotNegotiated { .. })
    ));
    assert!(plain.used(0).is_empty());
}
