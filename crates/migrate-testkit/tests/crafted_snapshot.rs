//! Issue 48, item 4: a crafted snapshot file cannot hurt the host that opens it. Sparse files of
//! a few KiB on disk whose headers claim 1 GiB to 64 TiB of guest RAM (so CRC tables of 1 MiB to
//! 64 GiB, and hot sets at their bound) are opened by the [`Reader`] in a child process, which
//! reports how far its peak resident memory grew: each must be refused, and grow by less than
//! [`LIMIT`]. Before the fix a file claiming 3 TiB took 3.01 GiB.
//!
//! The measurement is checked too: the same child reading a claimed table the way the reader
//! did before (allocate what the header says, then read it) must be seen growing past the
//! limit, so this test fails if the bound breaks rather than passing for want of a measure.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use ferry_migrate::snapshot::format::{Header, Limits};
use ferry_migrate::snapshot::hot::max_hot_runs;
use ferry_migrate::snapshot::{Reader, SnapshotError};
use ferry_migrate::wire::crc;

const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;
/// Most growth of peak resident memory an open may cause: the chunk a reader reads at once is
/// 1 MiB, and the allocator's and the kernel's own costs are a few more.
const LIMIT: u64 = 64 << 20;
/// Claimed guest RAM of the crafted files (64 TiB: the most ferry maps, plus its MMIO hole).
const CLAIMS: [u64; 5] = [GIB, 64 * GIB, TIB, 16 * TIB, 64 * TIB];
/// Set in the child: what it does (`open` or `control`) and where.
const CHILD: &str = "FERRY_CRAFTED_SNAPSHOT_CHILD";

/// A complete header for one region of `memory`, the file sized to the header's length. With
/// `areas`, a small configuration, device state and hot set are written with their CRCs, so
/// that the page CRC table is the one hole; without, the header claims all three at their
/// bounds (64 KiB, 64 MiB, a run per 2 MiB chunk) and the file holds only the header.
fn crafted(path: &Path, memory: u64, areas: bool) -> std::io::Result<Header> {
    let regions = [(0, memory)];
    let (config, state, runs) = match areas {
        true => (300, 9000, 64),
        false => (64 << 10, 64 << 20, max_hot_runs(&regions)),
    };
    let mut h = Header::layout(1, [4; 16], &regions, config, state, runs);
    h.complete = true;
    let file = std::fs::File::create(path)?;
    file.set_len(h.file_len())?;
    if areas {
        let fill = |offset: u64, len: u64| -> std::io::Result<u32> {
            let bytes = vec![0x5a; len as usize];
            file.write_all_at(&bytes, offset)?;
            Ok(crc(&bytes))
        };
        // The hot set's runs valid too, not only checksummed: a page in each of 64 chunks.
        let hot: Vec<u8> = (0..runs)
            .flat_map(|k| {
                (k << 21)
                    .to_le_bytes()
                    .into_iter()
                    .chain(1u64.to_le_bytes())
            })
            .collect();
        file.write_all_at(&hot, h.hot.offset)?;
        (h.config_crc, h.state_crc, h.hot_crc) = (
            fill(h.config.offset, h.config.len)?,
            fill(h.state.offset, h.state.len)?,
            crc(&hot),
        );
    }
    file.write_all_at(&h.encode(), 0)?;
    Ok(h)
}

/// Reads `name` (KiB) from /proc/self/status.
fn status_kib(name: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find_map(|l| l.strip_prefix(name)).unwrap();
    line.trim().trim_end_matches("kB").trim().parse().unwrap()
}

/// How far peak resident memory grows while `f` runs, in bytes: the peak is reset to what is
/// resident now (`clear_refs` 5), then read after.
fn peak_growth(f: impl FnOnce()) -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting the peak (Linux 4.0 or later)");
    let before = status_kib("VmRSS:");
    f();
    (status_kib("VmHWM:").saturating_sub(before)) << 10
}

/// A tmpfs when there is one: its files may claim 64 TiB (ext4's stop at 16).
fn dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

/// The child's work, run only under [`CHILD`]: prints `growth CLAIM AREAS BYTES` for each
/// crafted file it opens, or for the table it reads the old way.
#[test]
fn child() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let dir = dir();
    let path = dir.path().join("crafted.snap");
    if mode == "control" {
        // The reader before the fix: a table of the claimed size, read from a hole.
        let h = crafted(&path, 256 * GIB, false).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let table = h.crc_area();
        let grew = peak_growth(|| {
            let mut v = vec![0u8; table.len as usize];
            file.read_exact_at(&mut v, table.offset).unwrap();
            std::hint::black_box(&v);
        });
        println!("growth {} control {grew}", 256 * GIB);
        return;
    }
    for memory in CLAIMS {
        for areas in [false, true] {
            if let Err(e) = crafted(&path, memory, areas) {
                println!("skipped {memory}: {e}");
                continue;
            }
            let mut opened = None;
            let grew = peak_growth(|| opened = Some(Reader::open_with(&path, &Limits::FILE_ONLY)));
            println!("growth {memory} {areas} {grew}");
            // Here, not in the parent: a reader that allocates for the claim stops at the
            // first claim it fails, before a larger one takes the host's memory.
            assert!(grew < LIMIT, "peak RSS grew by {grew} bytes, past {LIMIT}");
            match opened.unwrap() {
                Err(e @ SnapshotError::Format { .. }) if e.to_string().contains("is a hole in") => {
                }
                other => panic!("{memory} bytes claimed: {other:?}"),
            }
        }
    }
}

/// Runs [`child`] in a child process in `mode`; its `growth` lines.
fn run_child(mode: &str) -> Vec<String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, mode)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // (The harness's "test child ... " may precede a line.)
    let tagged = |tag: &str| -> Vec<String> {
        stdout
            .lines()
            .filter_map(|l| l.split_once(tag).map(|(_, rest)| format!("{tag}{rest}")))
            .collect()
    };
    for skipped in tagged("skipped ") {
        eprintln!("{skipped}");
    }
    tagged("growth ")
}

fn grew(line: &str) -> u64 {
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn regression_issue_48_a_crafted_sparse_snapshot_is_refused_within_64_mib() {
    let control = run_child("control");
    assert_eq!(control.len(), 1);
    assert!(
        grew(&control[0]) > LIMIT,
        "the measure must see a 256 MiB table read the old way: {control:?}"
    );
    let lines = run_child("open");
    // Every claim up to 16 TiB (ext4's largest file) at least, each with and without its areas.
    assert!(lines.len() >= 8, "{lines:?}");
    for line in &lines {
        eprintln!("{line}");
        assert!(grew(line) < LIMIT, "peak RSS grew past {LIMIT}: {line}");
    }
}
