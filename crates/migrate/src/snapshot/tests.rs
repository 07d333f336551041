//! Unit tests of the snapshot Writer (`file.rs`), read back through the Reader (`read.rs`).

use std::os::unix::fs::MetadataExt;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use super::error::SnapshotError;
use super::file::{FileOptions, Replace, Writer};
use super::format::FormatError;
use super::read::Reader;
use crate::wire::PAGE_SIZE;

const MIB: u64 = 1 << 20;
const REGIONS: [(u64, u64); 2] = [(0, 4 * MIB), (16 * MIB, 2 * MIB)];

/// The `.partial` files in `dir`.
fn partials(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".partial"))
        .collect()
}

fn page(seed: u64) -> Vec<u8> {
    (0..PAGE_SIZE).map(|i| (i * 31 + seed) as u8 | 1).collect()
}

/// Two passes over a few pages (the second overwrites one and zeroes another), then the
/// state: the file is complete only after `finish`, every page reads back in its last
/// version, holes read as zeros, and the file holds little more than what was written.
#[test]
fn a_snapshot_written_in_passes_reads_back_its_last_version() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.snap");
    let w = Writer::create(
        &path,
        2,
        [3; 16],
        &REGIONS,
        b"config",
        &FileOptions::default(),
    )
    .unwrap();
    let partial = partials(dir.path()).pop().expect("a partial file");
    assert!(!path.exists());
    let err = Reader::open(&partial).unwrap_err();
    assert!(matches!(
        err,
        SnapshotError::Format {
            source: FormatError::Incomplete,
            ..
        }
    ));
    let pages = [0x1000, 0x3000, 16 * MIB, 16 * MIB + 0x5000];
    for (i, &gpa) in pages.iter().enumerate() {
        w.write_page(gpa, &page(i as u64)).unwrap();
    }
    // The second pass: one page written again, one now zero.
    w.write_page(0x3000, &page(99)).unwrap();
    w.write_page(16 * MIB, &[0u8; 4096]).unwrap();
    assert!(matches!(
        w.write_page(8 * MIB, &page(1)),
        Err(SnapshotError::OutsideRam { .. })
    ));
    let header = w.finish(b"sections", &[(0x3000, 1), (0x1000, 1)]).unwrap();
    assert!(path.exists() && !partial.exists());

    let r = Reader::open(&path).unwrap();
    assert_eq!(r.header(), &header);
    assert_eq!((r.config(), r.state()), (&b"config"[..], &b"sections"[..]));
    assert_eq!(r.hot(), &[(0x3000, 1), (0x1000, 1)]);
    let mut got = vec![0u8; 4096];
    for (gpa, want) in [
        (0x1000, page(0)),
        (0x3000, page(99)),
        (16 * MIB, vec![0u8; 4096]),
        (16 * MIB + 0x5000, page(3)),
        (0x2000, vec![0u8; 4096]),
    ] {
        r.read_page(gpa, &mut got).unwrap();
        assert!(got == want, "page {gpa:#x}");
    }
    // Sparse: a few pages and the metadata, not 6 MiB of RAM.
    let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
    assert!(allocated < 64 * 4096, "{allocated} bytes allocated");
}

/// A flipped byte in a page, in the state, or in the CRC table is found before use.
#[test]
fn a_damaged_byte_is_refused_naming_what_it_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.snap");
    let w = Writer::create(&path, 1, [4; 16], &REGIONS, b"c", &FileOptions::default()).unwrap();
    w.write_page(0x2000, &page(5)).unwrap();
    let header = w.finish(b"state", &[]).unwrap();
    let flip = |at: u64| {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .read(true)
            .open(&path)
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
    };
    let (page_at, _) = header.locate(0x2000).unwrap();
    flip(page_at + 100);
    let r = Reader::open(&path).unwrap();
    let mut got = vec![0u8; 4096];
    assert!(matches!(
        r.read_page(0x2000, &mut got),
        Err(SnapshotError::PageChecksum { gpa: 0x2000, .. })
    ));
    flip(page_at + 100);
    flip(header.state.offset + 1);
    let e = Reader::open(&path).unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::AreaChecksum {
                area: "device state",
                ..
            }
        ),
        "{e}"
    );
    flip(header.state.offset + 1);
    flip(header.crc_table + 8);
    let e = Reader::open(&path).unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::AreaChecksum {
                area: "page checksums",
                ..
            }
        ),
        "{e}"
    );
    flip(header.crc_table + 8);
    // Cut short: the header says more than the file holds.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(header.file_len() - 4096).unwrap();
    let e = Reader::open(&path).unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
}

/// Issue 48: a snapshot's file holds guest RAM and must not land on what it may not
/// replace. Two snapshots to one path write two partial files; a file that is not a
/// snapshot (or a link, or a directory) at the path is refused and kept unless the request
/// says to replace it; an earlier snapshot is replaced; the file is 0600 whatever the
/// umask, or the mode asked for; a writer dropped early leaves nothing.
#[test]
fn regression_a_snapshot_lands_only_where_it_may_and_only_its_owner_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.snap");
    let create = |options: &FileOptions| Writer::create(&path, 1, [5; 16], &REGIONS, b"c", options);
    let (a, b) = (
        create(&FileOptions::default()).unwrap(),
        create(&FileOptions::default()).unwrap(),
    );
    assert_eq!(partials(dir.path()).len(), 2);
    drop(b);
    assert_eq!(partials(dir.path()).len(), 1);
    a.write_page(0x1000, &page(1)).unwrap();
    a.finish(b"s", &[]).unwrap();
    assert!(partials(dir.path()).is_empty());
    let mode = std::fs::metadata(&path).unwrap().mode() & 0o7777;
    assert_eq!(mode, 0o600, "{mode:o}");

    // An earlier snapshot is replaced, in a mode asked for.
    let w = create(&FileOptions {
        mode: 0o640,
        ..FileOptions::default()
    })
    .unwrap();
    w.finish(b"t", &[]).unwrap();
    assert_eq!(Reader::open(&path).unwrap().state(), b"t");
    assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o7777, 0o640);

    // A victim file, a link to it, a directory: refused, each kept.
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::copy(&victim, &path).unwrap();
    let e = create(&FileOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::Exists {
                what: "a file that is not a ferry snapshot",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("--replace"), "{e}");
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    let e = create(&FileOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::Exists {
                what: "a symbolic link",
                ..
            }
        ),
        "{e}"
    );
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let any = FileOptions {
        replace: Replace::Any,
        ..FileOptions::default()
    };
    assert!(matches!(
        create(&any),
        Err(SnapshotError::Exists {
            what: "a directory",
            ..
        })
    ));
    std::fs::remove_dir(&path).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(partials(dir.path()).is_empty());

    // Replaced on purpose: the link goes, its target stays.
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    create(&any).unwrap().finish(b"u", &[]).unwrap();
    assert_eq!(Reader::open(&path).unwrap().state(), b"u");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

/// Issue 48: something put at the path while the pages were written is not replaced by
/// the rename either; the partial file goes.
#[test]
fn regression_a_file_put_at_the_path_during_the_snapshot_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.snap");
    let w = Writer::create(&path, 1, [6; 16], &REGIONS, b"c", &FileOptions::default()).unwrap();
    std::fs::write(&path, b"someone else's").unwrap();
    assert!(matches!(
        w.finish(b"s", &[]),
        Err(SnapshotError::Exists { .. })
    ));
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    assert!(partials(dir.path()).is_empty());
}

/// Issue 48: a file system that cannot punch holes gets zeros written where a page became
/// zero, and the snapshot reads back right.
#[test]
fn regression_zero_pages_are_written_where_holes_cannot_be_punched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.snap");
    let w = Writer::create(&path, 1, [7; 16], &REGIONS, b"c", &FileOptions::default()).unwrap();
    w.no_punch.store(true, Ordering::Relaxed);
    w.write_pages(&[0x1000, 0x2000], &[page(1), page(2)].concat())
        .unwrap();
    w.write_pages(&[0x1000, 0x2000], &vec![0u8; 2 * 4096])
        .unwrap();
    w.finish(b"s", &[]).unwrap();
    let r = Reader::open(&path).unwrap();
    let mut got = vec![1u8; 2 * 4096];
    r.read_pages(0x1000, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0));
    // Written, not punched: the data runs find them, each a zero page by its checksum.
    assert_eq!(r.data_runs(512).unwrap(), vec![(0x1000, 2)]);
}
