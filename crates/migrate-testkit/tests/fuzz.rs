//! The fuzz targets' regression tier: every committed seed and every input the fuzzer once
//! broke ferry with (`fuzz/regressions/TARGET/`, each named after what it found) replayed
//! through the same harness the targets run (`ferry_migrate_testkit::fuzz`), under plain
//! `cargo test`.

use std::path::{Path, PathBuf};

use ferry_migrate_testkit::fuzz::{self, Outcome, Streams};

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
