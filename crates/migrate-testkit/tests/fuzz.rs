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

#[test]
fn a_seed_cut_short_or_with_a_byte_changed_is_refused_or_lands_as_sent() {
    let (_, seed) = inputs("corpus/incoming")
        .into_iter()
        .find(|(p, _)| p.ends_with("one-channel-idle"))
        .expect("the one-channel seed");
    let streams = Streams::decode(&seed);
    assert_eq!(Streams::decode(&streams.encode()), streams);
    // Cut the main connection before its Complete: the destination must not resume.
    let mut cut = streams.clone();
    cut.main.truncate(cut.main.len() - 8);
    assert!(matches!(fuzz::incoming(&cut.encode()), Outcome::Refused(_)));
    // A byte of page data changed: it lands as sent (the harness checks it page by page);
    // a byte of a header changed: refused. Either way nothing the harness checks breaks.
    for at in [64 + 16 + 8 * 16 + 100, 64 + 1] {
        let mut changed = streams.clone();
        changed.data[0][at] ^= 0x40;
        let _ = fuzz::incoming(&changed.encode());
    }
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
