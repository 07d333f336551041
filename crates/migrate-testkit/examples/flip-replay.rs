//! The black-box replay behind issue-level figures: each recorded migration of the committed
//! seed corpus (`fuzz/corpus/incoming`, real migrations over the fake VMM recorded per
//! connection) replayed into a fresh destination N times, one random bit changed per case.
//! Every case under a checksum must be refused (the harness panics otherwise); the figures
//! say how many cases fell where and how many an unchecked page let through.
//!
//! `cargo run --release -p ferry-migrate-testkit --example flip-replay -- [N] [CORPUS]`

use std::path::Path;
use std::time::Instant;

use ferry_migrate_testkit::fuzz::{self, Streams};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .map_or(300, |a| a.parse().expect("N: a number of cases"));
    let dir = args.next().unwrap_or_else(|| "fuzz/corpus/incoming".into());
    let mut names: Vec<_> = std::fs::read_dir(Path::new(&dir))
        .unwrap_or_else(|e| panic!("{dir}: {e} (run from the repository's root)"))
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    println!(
        "{:<40} {:>6} {:>8} {:>10} {:>17} {:>8}",
        "recording", "cases", "covered", "uncovered", "uncovered landed", "ms/case"
    );
    for (i, path) in names.iter().enumerate() {
        let streams = Streams::decode(&std::fs::read(path).unwrap());
        let t = Instant::now();
        let f = fuzz::flips(&streams, n, 0x5eed + i as u64);
        println!(
            "{:<40} {:>6} {:>8} {:>10} {:>17} {:>8.2}",
            path.file_name().unwrap().to_string_lossy(),
            n,
            f.covered,
            f.uncovered,
            f.uncovered_resumed,
            t.elapsed().as_secs_f64() * 1e3 / n as f64
        );
    }
    println!("every covered case was refused, none hung, none crashed");
}
