//! The fuzz targets' regression tier: every committed seed and every input the fuzzer once
//! broke ferry with (`fuzz/regressions/TARGET/`, each named after what it found) replayed
//! through the same harness the targets run (`ferry_migrate_testkit::fuzz`), under plain
//! `cargo test`.

use std::path::{Path, PathBuf};

use ferry_migrate::snapshot::{FileOptions, Writer, state};
use ferry_migrate::{Section, wire::SectionId};
use ferry_migrate_testkit::fuzz::{self, Outcome, SnapshotInput, SnapshotOutcome, Streams};

fn inputs(dir: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz")
        .join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&root)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep"));
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

#[test]
fn every_incoming_seed_is_a_whole_migration_that_resumes_with_what_was_sent() {
    let seeds = inputs("corpus/incoming");
    assert!(seeds.len() >= 4, "the seed corpus is committed");
    for (path, bytes) in seeds {
        assert_eq!(
            fuzz::incoming(&bytes),
            Outcome::Resumed,
            "{}",
            path.display()
        );
    }
}

fn seed(name: &str) -> Streams {
    let (_, bytes) = inputs("corpus/incoming")
        .into_iter()
        .find(|(p, _)| p.ends_with(name))
        .unwrap_or_else(|| panic!("the seed {name}"));
    Streams::decode(&bytes)
}

#[test]
fn a_seed_cut_short_is_refused() {
    let streams = seed("one-channel-idle");
    assert_eq!(Streams::decode(&streams.encode()), streams);
    // Cut the main connection before its Complete: the destination must not resume.
    let mut cut = streams.clone();
    cut.main.truncate(cut.main.len() - 8);
    assert!(matches!(fuzz::incoming(&cut.encode()), Outcome::Refused(_)));
}

/// The black-box replay, a small number of cases (the `flip-replay` example runs hundreds):
/// a recorded migration with one bit changed is refused wherever a checksum covers it, which
/// is everywhere with page checksums, and everywhere but page data without.
#[test]
fn a_recorded_migration_with_a_bit_changed_is_refused_wherever_a_checksum_covers_it() {
    let plain = seed("one-channel-idle");
    let f = fuzz::flips(&plain, 40, 7);
    assert_eq!(f.covered + f.uncovered, 40);
    // Page data is most of the bytes: a changed page lands as sent, which the harness checks
    // page by page (so the model is not fooled either way).
    assert!(
        f.uncovered > 0 && f.uncovered_resumed == f.uncovered,
        "{f:?}"
    );
    // Every kind of place, on purpose: the hello, a header, an address, page data.
    let mut f = fuzz::Flips::default();
    for at in [20, 64 + 3, 64 + 24 + 2, 64 + 24 + 8 * 16 + 100] {
        fuzz::flip(&plain, 1, at, 1, &mut f);
    }
    assert_eq!((f.covered, f.uncovered, f.uncovered_resumed), (3, 1, 1));
    let checked = seed("one-channel-idle-page-checksums");
    let f = fuzz::flips(&checked, 40, 11);
    assert_eq!((f.covered, f.uncovered), (40, 0), "{f:?}");
}

#[test]
fn every_wire_seed_and_regression_passes_the_wire_target() {
    let seeds = inputs("corpus/wire");
    assert!(!seeds.is_empty(), "the seed corpus is committed");
    for (_, bytes) in seeds.iter().chain(&inputs("regressions/wire")) {
        fuzz::wire(bytes);
    }
}

#[test]
fn every_incoming_regression_ends_as_the_harness_demands() {
    for (path, bytes) in inputs("regressions/incoming") {
        let outcome = fuzz::incoming(&bytes);
        eprintln!("{}: {outcome:?}", path.display());
    }
}

const MIB: u64 = 1 << 20;

/// Small real snapshots as the [`Writer`] writes them, each as the snapshot target's input:
/// (name, input, pages of data written). `FERRY_SNAPSHOT_SEEDS=DIR` writes them to `DIR`
/// (fuzz/corpus/snapshot holds them, made so).
fn written_snapshots() -> Vec<(&'static str, Vec<u8>, u64)> {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let page = |seed: u8| vec![seed | 1; 4096];
    let section = |id, data: &[u8]| Section {
        id: SectionId(id),
        instance: 0,
        version: 1,
        data: data.to_vec(),
    };
    type Case = (&'static str, Vec<(u64, u64)>, Vec<u64>, Vec<(u64, u64)>);
    let cases: Vec<Case> = vec![
        // Below and above a hole: pages in both, a zero page, two hot chunks.
        (
            "two-regions-pages-and-hot",
            vec![(0, MIB), (4 * MIB, MIB / 2)],
            vec![0x1000, 0x2000, 0x3000, 4 * MIB + 0x5000, 4 * MIB + 0x6000],
            vec![(0, 256), (4 * MIB, 128)],
        ),
        // Nothing written: all holes.
        ("one-region-empty", vec![(0, 64 << 10)], vec![], vec![]),
        // A region across a 2 MiB boundary: a hot run on each side of it.
        (
            "unaligned-region",
            vec![(MIB, 2 * MIB)],
            vec![MIB, 2 * MIB - 0x1000, 2 * MIB],
            vec![(2 * MIB, 256), (MIB, 256)],
        ),
    ];
    let mut out = Vec::new();
    for (name, regions, pages, hot) in cases {
        let path = dir.path().join(name);
        let w = Writer::create(&path, 1, [9; 16], &regions, b"{}", &FileOptions::default());
        let w = w.unwrap();
        for (i, &gpa) in pages.iter().enumerate() {
            let data = if i == 1 { vec![0; 4096] } else { page(i as u8) };
            w.write_page(gpa, &data).unwrap();
        }
        let sections = [section(1, b"cpu"), section(7, &[5; 40])];
        w.finish(&state::encode(&sections), &hot).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let input = SnapshotInput::of_file(&file, 0).unwrap().encode();
        if let Some(seeds) = std::env::var_os("FERRY_SNAPSHOT_SEEDS") {
            std::fs::write(Path::new(&seeds).join(name), &input).unwrap();
            // The same with its checksums resealed by the harness: where changes reach past them.
            let mut resealed = input.clone();
            resealed[0] = SnapshotInput::RESEAL_AREAS | SnapshotInput::RESEAL_TABLE;
            let name = format!("{name}-resealed");
            std::fs::write(Path::new(&seeds).join(name), &resealed).unwrap();
        }
        let data_pages = pages.len().saturating_sub(1) as u64;
        out.push((name, input, data_pages));
    }
    out
}

#[test]
fn a_snapshot_the_writer_wrote_reads_whole_through_the_snapshot_target() {
    for (name, input, data_pages) in written_snapshots() {
        let mut decoded = SnapshotInput::decode(&input);
        assert_eq!(decoded.encode(), input, "{name}");
        let hot_pages = match fuzz::snapshot(&input) {
            SnapshotOutcome::Read { pages } => pages - data_pages,
            refused => panic!("{name}: {refused:?}"),
        };
        // Resealed, the same file reads the same.
        decoded.flags = SnapshotInput::RESEAL_AREAS | SnapshotInput::RESEAL_TABLE;
        assert_eq!(
            fuzz::snapshot(&decoded.encode()),
            SnapshotOutcome::Read {
                pages: data_pages + hot_pages
            },
            "{name}"
        );
        // A page changed: refused as it is, read whole once resealed.
        let ram_at = u64::from_le_bytes(decoded.pieces[0].1[128..136].try_into().unwrap());
        let Some(page) = decoded.pieces.iter_mut().rfind(|p| p.0 >= ram_at) else {
            continue;
        };
        page.1[100] ^= 0x40;
        assert!(matches!(
            fuzz::snapshot(&decoded.encode()),
            SnapshotOutcome::Read { .. }
        ));
        decoded.flags = 0;
        let outcome = fuzz::snapshot(&decoded.encode());
        assert!(
            matches!(&outcome, SnapshotOutcome::Refused(e) if e.contains("damaged")),
            "{name}: {outcome:?}"
        );
    }
}

#[test]
fn every_snapshot_seed_and_regression_passes_the_snapshot_target() {
    let seeds = inputs("corpus/snapshot");
    assert!(seeds.len() >= 6, "the seed corpus is committed");
    for (path, bytes) in &seeds {
        let outcome = fuzz::snapshot(bytes);
        assert!(
            matches!(outcome, SnapshotOutcome::Read { .. }),
            "{}: {outcome:?}",
            path.display()
        );
    }
    for (path, bytes) in inputs("regressions/snapshot") {
        let outcome = fuzz::snapshot(&bytes);
        eprintln!("{}: {outcome:?}", path.display());
        // Issue 48's files claim RAM they do not hold: refused from the holes, unread.
        if path.to_string_lossy().contains("issue-48") {
            assert!(
                matches!(&outcome, SnapshotOutcome::Refused(e) if e.contains("is a hole in")),
                "{}: {outcome:?}",
                path.display()
            );
        }
    }
}
