//! The transport driven through its registers by the test driver, with a balloon behind it.

use super::super::balloon::{Balloon, F_STATS_VQ};
use super::super::device::{VIRTIO_F_VERSION_1, status};
use super::super::testdriver::{Driver, RAM, TestQueue, reg};
use super::*;

const V1: u64 = VIRTIO_F_VERSION_1;

fn balloon() -> Driver<Balloon> {
    Driver::new(Balloon::new())
}

fn needs_reset(d: &mut Driver<Balloon>) -> bool {
    d.status() & status::DEVICE_NEEDS_RESET != 0
}

#[test]
fn registers_identify_a_version_2_balloon() {
    let mut d = balloon();
    assert_eq!(d.read(reg::MAGIC_VALUE), 0x7472_6976);
    assert_eq!(d.read(reg::VERSION), 2);
    assert_eq!(d.read(reg::DEVICE_ID), 5);
    assert_eq!(d.device_features(), V1 | 0b11_1010);
    let mut short = [0u8; 2];
    d.t.read(reg::MAGIC_VALUE, &mut short);
    assert_eq!(short, [0, 0], "registers are 32-bit only");
    assert_eq!(
        cmdline_fragment(0xd000_0000, 5),
        "virtio_mmio.device=4K@0xd0000000:5"
    );
}

#[test]
fn features_ok_needs_version_1_and_only_offered_features() {
    let mut d = balloon();
    assert!(!d.negotiate(F_STATS_VQ), "VERSION_1 missing");
    assert_eq!(
        d.status() & status::DEVICE_NEEDS_RESET,
        0,
        "a refusal, not an error"
    );
    assert!(!d.negotiate(V1 | 1), "MUST_TELL_HOST was not offered");
    assert!(d.negotiate(V1 | F_STATS_VQ));
    d.write_features(V1);
    assert_eq!(
        d.t.driver_features(),
        V1 | F_STATS_VQ,
        "features are frozen at FEATURES_OK"
    );
}

#[test]
fn queue_setup_is_validated_before_the_queue_is_used() {
    let mut d = balloon();
    d.add_status(status::ACKNOWLEDGE | status::DRIVER);
    assert!(!d.setup_queue(0, 64), "no queue setup before FEATURES_OK");

    assert!(d.negotiate(V1));
    assert_eq!(d.queue_max(0), 128);
    assert_eq!(d.queue_max(2), 0, "no statsq without STATS_VQ");
    assert!(!d.setup_queue(2, 64), "a queue that does not exist");
    assert!(!needs_reset(&mut d));

    let good = |d: &mut Driver<Balloon>| {
        assert!(d.setup_queue(0, 64));
        d.queues[0]
    };
    let base = good(&mut d);
    let bad: [(&str, TestQueue); 5] = [
        ("size not a power of two", TestQueue { size: 48, ..base }),
        ("size above the maximum", TestQueue { size: 256, ..base }),
        (
            "misaligned descriptor table",
            TestQueue {
                desc: base.desc + 8,
                ..base
            },
        ),
        (
            "used ring outside RAM",
            TestQueue {
                used: RAM - 16,
                ..base
            },
        ),
        (
            "available ring in no RAM at all",
            TestQueue {
                avail: 1 << 40,
                ..base
            },
        ),
    ];
    for (what, q) in bad {
        assert!(d.negotiate(V1));
        assert!(!d.setup_queue_at(0, q), "{what}");
        assert!(needs_reset(&mut d), "{what}");
    }
    assert!(d.negotiate(V1), "writing 0 to status resets");
    assert!(!needs_reset(&mut d));
    good(&mut d);
    d.driver_ok();
    assert!(d.t.driver_ok());
    d.write(reg::QUEUE_SEL, 1);
    d.write(reg::QUEUE_NUM, 64);
    d.write(reg::QUEUE_READY, 1);
    assert_eq!(
        d.read(reg::QUEUE_READY),
        0,
        "no queue setup after DRIVER_OK"
    );
}

#[test]
fn status_bits_only_grow_and_zero_resets() {
    let mut d = Driver::running(Balloon::new(), V1);
    d.write(reg::QUEUE_SEL, 0);
    assert_eq!(d.read(reg::QUEUE_READY), 1);
    d.write(reg::STATUS, status::ACKNOWLEDGE);
    assert!(needs_reset(&mut d), "the driver may not clear a bit");
    assert!(!d.t.driver_ok());
    assert_ne!(
        d.take_interrupts() & INT_CONFIG,
        0,
        "needs-reset is announced"
    );
    d.write(reg::STATUS, 0);
    assert_eq!(d.status(), 0);
    d.write(reg::QUEUE_SEL, 0);
    assert_eq!(d.read(reg::QUEUE_READY), 0, "reset forgets the queues");
    assert_eq!(d.read(reg::INTERRUPT_STATUS), 0);

    d.add_status(status::ACKNOWLEDGE | status::DRIVER);
    d.add_status(status::DRIVER_OK);
    assert!(needs_reset(&mut d), "DRIVER_OK without FEATURES_OK");
    d.write(reg::STATUS, 0);
    d.add_status(status::ACKNOWLEDGE | status::FEATURES_OK);
    assert!(needs_reset(&mut d), "FEATURES_OK without DRIVER");
}

#[test]
fn notifications_before_driver_ok_or_to_absent_queues_are_ignored() {
    let mut d = balloon();
    assert!(d.negotiate(V1));
    assert!(d.setup_queue(0, 64));
    let pfns = d.buffer(&1u32.to_le_bytes());
    d.add(0, &[(pfns, 4, false)]);
    d.notify(0);
    assert!(d.used(0).is_empty(), "not before DRIVER_OK");
    d.driver_ok();
    d.write(reg::QUEUE_NOTIFY, 9);
    d.write(reg::QUEUE_NOTIFY, 2);
    assert!(d.used(0).is_empty());
    assert!(!needs_reset(&mut d));
    d.notify(0);
    assert_eq!(d.used(0).len(), 1);
    assert_eq!(d.take_interrupts(), INT_USED_BUFFER);
}

#[test]
fn interrupt_bits_raise_the_line_and_ack_clears_them() {
    let mut d = Driver::running(Balloon::new(), V1);
    let generation = d.read(reg::CONFIG_GENERATION);
    assert!(!d.raised());
    d.t.set_target(100);
    assert!(d.raised());
    assert_ne!(d.read(reg::CONFIG_GENERATION), generation);
    assert_eq!(d.read(reg::INTERRUPT_STATUS), INT_CONFIG);
    d.t.raise_pending();
    assert!(d.raised(), "pending bits are raised again");
    d.write(reg::INTERRUPT_ACK, INT_CONFIG);
    assert_eq!(d.read(reg::INTERRUPT_STATUS), 0);
    d.t.raise_pending();
    assert!(!d.raised(), "nothing pending, nothing raised");
}

#[test]
fn an_available_index_beyond_the_queue_needs_a_reset() {
    let mut d = Driver::running(Balloon::new(), V1);
    let avail = d.queues[0].avail;
    d.ram.write(avail + 2, &200u16.to_le_bytes()).unwrap();
    d.notify(0);
    assert!(needs_reset(&mut d));
    assert_eq!(d.take_interrupts(), INT_CONFIG);
    d.notify(0);
    assert!(
        d.used(0).is_empty(),
        "a device that needs a reset does nothing"
    );
}

#[test]
fn a_saved_transport_restores_into_a_fresh_one() {
    let mut d = Driver::running(Balloon::new(), V1 | F_STATS_VQ);
    let pfns = d.buffer(&1u32.to_le_bytes());
    d.add(1, &[(pfns, 4, false)]);
    d.notify(1);
    d.t.set_target(7);
    let saved = d.t.save();
    let mut e = Driver::with_ram(Balloon::new(), d.ram.clone());
    e.t.restore(VERSION, &saved).unwrap();
    assert_eq!(e.t.save(), saved);
    assert_eq!(e.status(), d.status());
    assert_eq!(e.read(reg::INTERRUPT_STATUS), INT_USED_BUFFER | INT_CONFIG);
    assert_eq!(e.config32(0), 7);
    assert!(matches!(
        e.t.restore(VERSION + 1, &saved),
        Err(DeviceStateError::Version { .. })
    ));
}

/// `saved` with `patch` applied at byte `at`.
fn patched(saved: &[u8], at: usize, patch: &[u8]) -> Vec<u8> {
    let mut b = saved.to_vec();
    b[at..at + patch.len()].copy_from_slice(patch);
    b
}

#[test]
fn malformed_transport_states_are_refused_by_field_and_change_nothing() {
    let d = Driver::running(Balloon::new(), V1);
    let saved = d.t.save();
    let mut fresh = Driver::with_ram(Balloon::new(), d.ram.clone());
    let before = fresh.t.save();
    // Offsets: device type 0, status 4, driver features 16, InterruptStatus 28, queue count
    // 36, queue 0 from 38 (its desc at 42, used at 58).
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("device type", patched(&saved, 0, &4u32.to_le_bytes())),
        ("status", patched(&saved, 4, &0x30u32.to_le_bytes())),
        (
            "status",
            patched(&saved, 4, &status::DRIVER_OK.to_le_bytes()),
        ),
        ("never offered", patched(&saved, 16, &1u64.to_le_bytes())),
        ("VERSION_1", patched(&saved, 16, &0u64.to_le_bytes())),
        ("InterruptStatus", patched(&saved, 28, &4u32.to_le_bytes())),
        ("queues", patched(&saved, 36, &4u16.to_le_bytes())),
        ("queues", patched(&saved, 36, &1000u16.to_le_bytes())),
        (
            "descriptor table",
            patched(&saved, 42, &(RAM - 16).to_le_bytes()),
        ),
        (
            "alignment",
            patched(&saved, 42, &0x10_0008u64.to_le_bytes()),
        ),
        ("trailing", [saved.as_slice(), &[0]].concat()),
        ("queue ready", patched(&saved, 40, &[2])),
    ];
    for (what, bytes) in cases {
        let err = fresh.t.restore(VERSION, &bytes).unwrap_err();
        assert!(
            matches!(err, DeviceStateError::Malformed { .. }),
            "{what}: {err}"
        );
        assert_eq!(fresh.t.save(), before, "{what}: nothing changed");
    }
    for len in 0..saved.len() {
        assert!(
            fresh.t.restore(VERSION, &saved[..len]).is_err(),
            "cut at {len}"
        );
    }
    assert_eq!(fresh.t.save(), before);
}
