use std::fs::File;
use std::os::unix::fs::FileExt;

use super::*;

const MIB: u64 = 1 << 20;

/// The device's marks, for a test: granules a test wrote, and whether the copy asked for the
/// mirror.
#[derive(Default)]
struct Marks(Vec<u64>, bool);

impl Written for Marks {
    fn take(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.0)
    }
    fn count(&self) -> u64 {
        self.0.len() as u64
    }
    fn mirror(&mut self, lag: u64) {
        assert!(lag >= 16, "at least a request's worth: {lag}");
        self.1 = true;
    }
}

/// A sparse image of `capacity` bytes with `data` written at its offsets.
fn image(dir: &std::path::Path, capacity: u64, data: &[(u64, &[u8])]) -> File {
    let f = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("source.img"))
        .unwrap();
    f.set_len(capacity).unwrap();
    for (at, bytes) in data {
        f.write_all_at(bytes, *at).unwrap();
    }
    f
}

/// Sends every chunk pending now from `src` into `dst`; returns how many went.
fn send_all(src: &mut SourceCopy, marks: &mut Marks, dst: &mut IncomingCopy) -> u64 {
    let mut n = 0;
    while let Some(c) = src
        .next(ferry_migrate::wire::MAX_SECTION_BYTES as usize, marks)
        .unwrap()
    {
        dst.apply(&Chunk::decode(&c).unwrap()).unwrap();
        n += 1;
    }
    n
}

fn contents(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn a_sparse_image_arrives_whole_with_its_later_writes_and_only_its_data_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let capacity = 64 * MIB;
    let src_file = image(
        dir.path(),
        capacity,
        &[
            (0, &[1; 4096]),
            (10 * MIB, &[2; 3 * MIB as usize]),
            (capacity - 512, &[3; 512]),
        ],
    );
    let mut src = SourceCopy::start(src_file.try_clone().unwrap(), capacity).unwrap();
    let mut marks = Marks::default();
    // What is pending is what is allocated (in whole pages), not the disk's size.
    assert!(src.pending(&marks) < 4 * MIB, "{}", src.pending(&marks));
    let target = dir.path().join("copy.img");
    let mut dst = IncomingCopy::begin(&target, capacity).unwrap();
    send_all(&mut src, &mut marks, &mut dst);
    assert_eq!(src.pending(&marks), 0);
    assert!(src.stats.data_bytes < 4 * MIB, "{:?}", src.stats);
    // The guest writes after the first pass read its range: the mark sends it again.
    src_file.write_all_at(&[9; 512], 10 * MIB + 4096).unwrap();
    marks.0.push((10 * MIB + 4096) / GRANULE);
    // And a discard leaves a range of zeros where data was: it goes as a header alone.
    src_file
        .write_all_at(&vec![0; GRANULE as usize], 12 * MIB)
        .unwrap();
    marks.0.push(12 * MIB / GRANULE);
    assert_eq!(src.pending(&marks), 2 * GRANULE);
    assert_eq!(send_all(&mut src, &mut marks, &mut dst), 2);
    assert_eq!(src.stats.granules_again, 2);
    assert_eq!(src.stats.zero_bytes, GRANULE);
    // Adjacent granules go as one range.
    src_file.write_all_at(&[7; 3 * 4096], 20 * MIB).unwrap();
    let g = 20 * MIB / GRANULE;
    marks.0.extend([g, g + 1, g + 2]);
    assert_eq!(send_all(&mut src, &mut marks, &mut dst), 1);
    assert_eq!(src.stats.granules_again, 5);
    assert!(
        !target.exists(),
        "the image appears only when the copy finishes"
    );
    dst.finish().unwrap();
    assert!(contents(&target) == contents(&dir.path().join("source.img")));
}

#[test]
fn a_copy_that_does_not_finish_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("copy.img");
    let mut dst = IncomingCopy::begin(&target, MIB).unwrap();
    dst.apply(&Chunk {
        capacity: MIB,
        offset: 0,
        len: 512,
        data: Some(&[5; 512]),
    })
    .unwrap();
    let part = dir.path().join("copy.img.ferry-incoming");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&part).unwrap().permissions().mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "the guest's disk is readable by its user alone"
    );
    drop(dst);
    assert!(!part.exists(), "the unfinished copy was removed");
    assert!(!target.exists(), "and no image appeared");
}

#[test]
fn a_copy_refuses_to_overwrite_an_image_that_holds_data_or_a_chunk_of_another_disk() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("data.img");
    std::fs::write(&target, b"keep me").unwrap();
    let e = IncomingCopy::begin(&target, MIB).unwrap_err();
    assert!(matches!(e, IncomingError::NotEmpty { bytes: 7, .. }), "{e}");
    assert_eq!(contents(&target), b"keep me");
    // An empty file is taken (the user made it for the copy).
    let empty = dir.path().join("empty.img");
    File::create(&empty).unwrap();
    let mut dst = IncomingCopy::begin(&empty, MIB).unwrap();
    let other = Chunk {
        capacity: 2 * MIB,
        offset: 0,
        len: 512,
        data: None,
    };
    assert!(matches!(
        dst.apply(&other),
        Err(IncomingError::Capacity(..))
    ));
    // A second copy to the same image finds the first one's file in its way, and leaves it.
    let e = IncomingCopy::begin(&empty, MIB).unwrap_err();
    assert!(matches!(e, IncomingError::InTheWay { .. }), "{e}");
    drop(dst);
    // A link planted where the copy's file goes is not followed.
    let precious = dir.path().join("precious");
    std::fs::write(&precious, b"keep me too").unwrap();
    std::os::unix::fs::symlink(&precious, dir.path().join("empty.img.ferry-incoming")).unwrap();
    let e = IncomingCopy::begin(&empty, MIB).unwrap_err();
    assert!(matches!(e, IncomingError::InTheWay { .. }), "{e}");
    assert_eq!(contents(&precious), b"keep me too");
}

#[test]
fn a_copy_is_ready_for_the_switchover_once_nearly_all_of_it_is_on_storage() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("copy.img");
    let mut dst = IncomingCopy::begin(&target, 128 * MIB).unwrap();
    let data = vec![3u8; MIB as usize];
    for i in 0..64 {
        dst.apply(&Chunk {
            capacity: 128 * MIB,
            offset: i * MIB,
            len: MIB,
            data: Some(&data),
        })
        .unwrap();
    }
    // 64 MiB arrived, more than may be left unsynced: ready only once a sync covered it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !dst.ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "64 MiB not on storage after 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    dst.finish().unwrap();
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 128 * MIB);
}

#[test]
fn the_mirror_starts_when_takes_larger_than_half_the_allowance_stop_shrinking() {
    let dir = tempfile::tempdir().unwrap();
    let granules = 16 * MIB / GRANULE;
    let capacity = 4 * granules * GRANULE;
    let drain = |copy: &mut SourceCopy, marks: &mut Marks| {
        while copy.next(1 << 20, marks).unwrap().is_some() {}
    };
    let mut copy = SourceCopy::start(image(dir.path(), capacity, &[]), capacity).unwrap();
    // The pause could carry 16 MiB: takes of more than 8 MiB that stop shrinking mirror.
    copy.set_allowance(16 * MIB);
    let mut marks = Marks::default();
    drain(&mut copy, &mut marks);
    for (n, mirrors) in [
        (granules, false),
        (granules * 3 / 4, false),
        (granules * 3 / 4, true),
    ] {
        marks.0 = (0..n).collect();
        drain(&mut copy, &mut marks);
        assert_eq!(marks.1, mirrors, "after a take of {n} granules");
    }
    assert!(copy.stats.mirror && copy.stats.dirty_passes == 3);
    // Small takes that do not shrink fit in the pause: no mirror.
    let mut copy = SourceCopy::start(image(dir.path(), capacity, &[]), capacity).unwrap();
    copy.set_allowance(16 * MIB);
    let mut marks = Marks::default();
    drain(&mut copy, &mut marks);
    for _ in 0..3 {
        marks.0 = (0..100).collect();
        drain(&mut copy, &mut marks);
    }
    assert!(!marks.1 && !copy.stats.mirror);
}
