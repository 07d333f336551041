//! A hostile driver: whatever chain it sends, the device neither panics, loops, nor touches
//! memory outside guest RAM or the image outside its capacity; a chain is answered S_IOERR
//! when it has a status byte, else returned unused and counted.

use super::*;
use crate::devices::virtio::device::status;
use crate::devices::virtio::testdriver::{F_NEXT, F_WRITE, RAM};

fn header(kind: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    h
}

/// A buffer of a chain: `(gpa, len, writable)`.
type Buf = (u64, u32, bool);

fn needs_reset(d: &mut Driver<Block>) -> bool {
    d.status() & status::DEVICE_NEEDS_RESET != 0
}

/// Sends `bufs` as one chain; returns its used entry's length.
fn send(d: &mut Driver<Block>, bufs: &[(u64, u32, bool)]) -> u32 {
    let head = d.add(Q, bufs);
    d.notify(Q);
    let used = d.used(Q);
    assert_eq!(used.len(), 1, "{bufs:x?} is answered");
    assert_eq!(used[0].0, u32::from(head));
    used[0].1
}

fn byte(d: &Driver<Block>, gpa: u64) -> u8 {
    let mut b = [0u8];
    d.ram.read(gpa, &mut b).unwrap();
    b[0]
}

#[test]
fn a_chain_without_a_status_byte_is_returned_unused() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let h = d.buffer(&header(T_OUT, 0));
    let data = d.buffer(&[7; 512]);
    assert_eq!(send(&mut d, &[(h, 16, false), (data, 512, false)]), 0);
    let empty = d.buffer(&[0xff]);
    assert_eq!(send(&mut d, &[(h, 16, false), (empty, 0, true)]), 0);
    assert_eq!(byte(&d, empty), 0xff, "a zero-length buffer is not written");
    assert_eq!(
        send(&mut d, &[(h, 16, false), (RAM + 8, 1, true)]),
        0,
        "status outside RAM"
    );
    assert_eq!(d.t.device().stats().malformed, 3);
    assert!(
        file_bytes(&f, 0, 512).iter().all(|&b| b == 0),
        "nothing written"
    );
    assert!(!needs_reset(&mut d));
}

#[test]
fn a_header_in_a_writable_descriptor_or_too_short_is_an_io_error() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let h = d.buffer(&header(T_IN, 0));
    assert_eq!(send(&mut d, &[(h, 16, true)]), 1);
    assert_eq!(
        byte(&d, h + 15),
        S_IOERR,
        "the status is the last writable byte"
    );
    let h = d.buffer(&header(T_IN, 0));
    let s = d.buffer(&[0xff]);
    assert_eq!(send(&mut d, &[(h, 8, false), (s, 1, true)]), 1);
    assert_eq!(byte(&d, s), S_IOERR);
    // The header split over two descriptors is a request like any other.
    let data = d.buffer(&[0xee; 512]);
    let s = d.buffer(&[0xff]);
    let bufs = [
        (h, 8, false),
        (h + 8, 8, false),
        (data, 512, true),
        (s, 1, true),
    ];
    assert_eq!(send(&mut d, &bufs), 513);
    assert_eq!(byte(&d, s), S_OK);
    assert_eq!(d.t.device().stats().errors, 2);
}

#[test]
fn huge_or_outside_ram_data_buffers_touch_nothing() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let s = d.buffer(&[0xff]);
    let inside = d.buffer(&[0xee; 512]);
    let cases: Vec<(u32, Vec<Buf>)> = vec![
        (T_IN, vec![(inside, u32::MAX, true)]),
        (T_IN, vec![(RAM - 512, 1024, true)]),
        (T_OUT, vec![(inside, u32::MAX, false)]),
        (T_OUT, vec![(3 << 30, 512, false)]),
        (T_DISCARD, vec![(inside, u32::MAX, false)]),
        // In RAM, but 60 x 32 MiB is far past the 8 MiB disk.
        (T_OUT, vec![(0x20_0000, 32 << 20, false); 60]),
    ];
    for (kind, data) in cases {
        let h = d.buffer(&header(kind, 0));
        let mut bufs = vec![(h, 16, false)];
        bufs.extend(&data);
        bufs.push((s, 1, true));
        d.ram.write(s, &[0xff]).unwrap();
        assert_eq!(
            send(&mut d, &bufs),
            1,
            "type {kind}, {} buffers",
            data.len()
        );
        assert_eq!(byte(&d, s), S_IOERR, "type {kind}");
    }
    let mut b = [0u8; 512];
    d.ram.read(inside, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0xee), "no data written");
    assert_eq!(blocks(&f), 0, "nothing written to the image");
    assert!(!needs_reset(&mut d));
}

#[test]
fn loops_and_bad_indices_are_returned_unused_and_counted() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let size = d.queues[Q].size;
    let h = d.buffer(&header(T_OUT, 0));
    let check = |d: &mut Driver<Block>, descs: &[(u64, u32, u16, u16)]| {
        let head = d.add_raw(Q, descs);
        d.notify(Q);
        assert_eq!(d.used(Q), [(u32::from(head), 0)], "{descs:x?}");
    };
    let slot = d.next_slot(Q);
    check(&mut d, &[(h, 16, F_NEXT, slot)]);
    let slot = d.next_slot(Q);
    let ring: Vec<_> = (0..size)
        .map(|i| (h, 16, F_WRITE | F_NEXT, (slot + i + 1) % size))
        .collect();
    check(&mut d, &ring);
    check(&mut d, &[(h, 16, F_NEXT, size + 3)]);
    assert_eq!(d.t.device().stats().malformed, 3);
    assert_eq!(blocks(&f), 0);
    assert!(!needs_reset(&mut d));
    // Still serving.
    assert_eq!(read(&mut d, 0, 512).status, S_OK);
}
