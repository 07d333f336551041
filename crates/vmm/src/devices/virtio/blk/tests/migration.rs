//! The block device's state across a save and a restore into a fresh device over the same
//! RAM and image, the deferred open that a destination uses, and refused states.

use super::*;
use crate::devices::device::{Device, DeviceStateError};
use crate::devices::virtio::device::Negotiated;
use crate::devices::virtio::mmio::VERSION;

/// A fresh transport around `dest` over `d`'s RAM, restored from `d`'s saved state; the test
/// driver's own bookkeeping (in a real guest, guest memory) comes along.
fn migrate(d: &Driver<Block>, dest: Block) -> Result<Driver<Block>, DeviceStateError> {
    let mut e = Driver::with_ram(dest, d.ram.clone());
    e.t.restore(VERSION, &d.t.save())?;
    e.queues = d.queues.clone();
    Ok(e)
}

fn get_id(d: &mut Driver<Block>) -> Vec<u8> {
    request(d, T_GET_ID, 0, &[], &[20]).data
}

#[test]
fn state_round_trips_through_a_deferred_device() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    write(&mut d, 0, &[1; 4096]);
    read(&mut d, 0, 512);
    let saved = d.t.save();
    let e = migrate(&d, Block::deferred(&options(&f))).unwrap();
    assert_eq!(e.t.save(), saved, "the same bytes again");
    assert_eq!(e.t.device().capacity(), Some(SECTORS));
    assert_eq!(e.t.device().stats(), d.t.device().stats());
    assert!(!e.t.device().is_attached());
}

#[test]
fn a_pending_request_is_served_once_on_the_destination_after_attach() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let id = get_id(&mut d);
    assert_eq!(write(&mut d, 0, &[1; 512]), S_OK);
    // Made available but not notified when the vCPUs stop.
    let mut header = [0u8; 16];
    header[..4].copy_from_slice(&T_OUT.to_le_bytes());
    header[8..].copy_from_slice(&8u64.to_le_bytes());
    let bufs = [
        (d.buffer(&header), 16, false),
        (d.buffer(&[2; 512]), 512, false),
        (d.buffer(&[0xff]), 1, true),
    ];
    let pending = d.add(Q, &bufs);
    d.t.device().flush().unwrap();

    let mut e = migrate(&d, Block::deferred(&options(&f))).unwrap();
    e.t.attach().unwrap();
    e.notify(Q);
    assert_eq!(
        e.used(Q),
        [(u32::from(pending), 1)],
        "only the pending request"
    );
    assert_eq!(file_bytes(&f, 8 * 512, 512), [2; 512]);
    assert_eq!(file_bytes(&f, 0, 512), [1; 512]);
    assert_eq!(e.t.device().stats().writes, 2, "the source's count and one");
    assert_eq!(get_id(&mut e), id, "the guest's disk id does not change");
}

#[test]
fn a_deferred_device_answers_io_errors_until_attached() {
    let f = image(IMAGE);
    let mut d = Driver::running(Block::deferred(&options(&f)), ALL);
    assert_eq!(d.config32(0), 0, "capacity unknown");
    assert_eq!(read(&mut d, 0, 512).status, S_IOERR);
    assert_eq!(write(&mut d, 0, &[1; 512]), S_IOERR);
    assert_eq!(request(&mut d, T_FLUSH, 0, &[], &[]).status, S_IOERR);
    assert_eq!(request(&mut d, T_GET_ID, 0, &[], &[20]).status, S_IOERR);
    d.t.device().flush().unwrap();
    d.take_interrupts();
    // Tracking started before the size is known covers the image once attached.
    d.t.device_mut().start_tracking();
    d.t.attach().unwrap();
    assert_eq!(d.config32(0), SECTORS as u32);
    assert_eq!(
        d.take_interrupts() & 2,
        2,
        "the driver hears of the capacity"
    );
    assert_eq!(write(&mut d, SECTORS - 1, &[1; 512]), S_OK);
    assert_eq!(d.t.device().write_log().take(), [IMAGE / DIRTY_CHUNK - 1]);
    assert_eq!(read(&mut d, SECTORS - 1, 512).data, [1; 512]);
    assert!(matches!(
        d.t.attach(),
        Err(BlockError::AlreadyAttached { .. })
    ));
    let stats = d.t.device().stats();
    assert_eq!((stats.errors, stats.writes, stats.reads), (4, 1, 1));
    let shown = serde_json::to_string(&stats).unwrap();
    assert!(shown.contains("\"errors\":4"), "{shown}");
}

#[test]
fn a_destination_disk_that_cannot_carry_on_is_refused_and_nothing_changes() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    write(&mut d, 0, &[1; 512]);

    let ro = DiskOptions {
        readonly: true,
        ..options(&f)
    };
    let mut e = Driver::with_ram(Block::deferred(&ro), d.ram.clone());
    let before = e.t.save();
    let err = e.t.restore(VERSION, &d.t.save()).unwrap_err().to_string();
    assert!(
        err.contains("read-write") && err.contains("read-only"),
        "{err}"
    );
    assert_eq!(e.t.save(), before, "nothing changed");

    let small = image(IMAGE / 2);
    let mut e = Driver::with_ram(Block::open(&options(&small)).unwrap(), d.ram.clone());
    let before = e.t.save();
    let err = e.t.restore(VERSION, &d.t.save()).unwrap_err().to_string();
    assert!(
        err.contains(&SECTORS.to_string()) && err.contains(&(SECTORS / 2).to_string()),
        "{err}"
    );
    assert_eq!(e.t.save(), before);

    // A deferred device takes the state, then refuses the wrong image at attach.
    let mut e = migrate(&d, Block::deferred(&options(&small))).unwrap();
    let err = e.t.attach().unwrap_err();
    assert!(
        matches!(
            err,
            BlockError::SizeMismatch { image_sectors, expected_sectors, .. }
                if image_sectors == SECTORS / 2 && expected_sectors == SECTORS
        ),
        "{err}"
    );
    assert!(err.to_string().contains("truncate -s 8388608"), "{err}");
    assert!(!e.t.device().is_attached());
}

#[test]
fn malformed_block_states_are_refused_by_field() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    get_id(&mut d);
    let good = d.t.device().state().encode();
    let negotiated = |features| Negotiated {
        features,
        ready_sizes: &[64],
    };
    assert!(BlockState::decode(&good, &negotiated(ALL)).is_ok());
    // Offsets: version 0, config known 4, capacity 5, seg_max 13, blk_size 17,
    // max_discard_seg 25, max_write_zeroes_seg 37, may_unmap 41, read-only 42, id known 43.
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    };
    let unknown_with_fields = patch(4, &[0]);
    let cases = [
        ("version", patch(0, &2u32.to_le_bytes())),
        ("known flag", patch(4, &[2])),
        ("capacity overflow", patch(5, &u64::MAX.to_le_bytes())),
        ("blk_size", patch(17, &1000u32.to_le_bytes())),
        ("blk_size small", patch(17, &256u32.to_le_bytes())),
        ("max_discard_seg", patch(25, &0u32.to_le_bytes())),
        ("max_write_zeroes_seg", patch(37, &100_000u32.to_le_bytes())),
        ("may_unmap", patch(41, &[7])),
        ("id flag", patch(43, &[9])),
        ("unknown config with fields", unknown_with_fields),
        ("trailing", [good.as_slice(), &[0]].concat()),
    ];
    for (what, bytes) in &cases {
        assert!(
            BlockState::decode(bytes, &negotiated(ALL)).is_err(),
            "{what}"
        );
    }
    for len in 0..good.len() {
        assert!(
            BlockState::decode(&good[..len], &negotiated(ALL)).is_err(),
            "{len}"
        );
    }
    assert!(
        BlockState::decode(&good, &negotiated(ALL | F_RO)).is_err(),
        "the driver negotiated RO on a read-write disk"
    );
}

/// A local handover's destination takes over the source's open image: the path it was given
/// may name nothing any more (the image renamed or unlinked), and the guest still writes the
/// source's file, the same inode.
#[test]
fn a_passed_image_is_taken_over_whatever_became_of_its_path() {
    use std::os::unix::fs::MetadataExt;
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    assert_eq!(write(&mut d, 0, &[7; 512]), S_OK);
    let passed = d.t.device().image_descriptor().unwrap().expect("open");
    let inode = std::fs::metadata(f.path()).unwrap().ino();
    let gone = options(&f);
    let kept = f.into_temp_path().keep().unwrap();
    std::fs::remove_file(&kept).unwrap();

    let mut e = migrate(&d, Block::deferred(&gone)).unwrap();
    assert!(
        Block::open(&gone).is_err(),
        "the path names nothing: opening it fails"
    );
    e.t.device_mut().pass_image(passed.into()).unwrap();
    e.t.attach().unwrap();
    assert_eq!(read(&mut e, 0, 512).data, [7; 512]);
    assert_eq!(write(&mut e, 1, &[8; 512]), S_OK);
    // The source's descriptor sees the destination's write: one file.
    let mine = d.t.device().image_descriptor().unwrap().unwrap();
    let mine = std::fs::File::from(mine);
    assert_eq!(mine.metadata().unwrap().ino(), inode);
    let mut back = [0u8; 512];
    std::os::unix::fs::FileExt::read_exact_at(&mine, &mut back, 512).unwrap();
    assert_eq!(back, [8; 512]);
}

/// A destination asked for another cache mode than the source's reopens the passed image
/// with its own flags, and leaves the source's open file as it was (a status flag changed on
/// the shared description would change the source's mode too).
#[test]
fn a_passed_image_in_another_cache_mode_is_reopened_not_changed() {
    let f = image(IMAGE);
    let d = running(&options(&f));
    let passed = d.t.device().image_descriptor().unwrap().unwrap();
    let direct = DiskOptions {
        cache: Cache::None,
        ..options(&f)
    };
    let mut e = migrate(&d, Block::deferred(&direct)).unwrap();
    e.t.device_mut().pass_image(passed.into()).unwrap();
    match e.t.attach() {
        Ok(()) => {}
        // A file system without O_DIRECT (tmpfs before Linux 6.6) is refused, with the fix.
        Err(BlockError::DirectUnsupported { .. }) => return,
        Err(err) => panic!("{err}"),
    }
    let flags = |fd: std::os::fd::OwnedFd| {
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        ))
        .unwrap();
        let line = info.lines().find(|l| l.starts_with("flags:")).unwrap();
        i32::from_str_radix(line["flags:".len()..].trim(), 8).unwrap()
    };
    let source = flags(d.t.device().image_descriptor().unwrap().unwrap());
    let dest = flags(e.t.device().image_descriptor().unwrap().unwrap());
    assert_eq!(source & libc::O_DIRECT, 0, "the source's mode is its own");
    assert_ne!(dest & libc::O_DIRECT, 0, "the destination's is cache=none");
}
