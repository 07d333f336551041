//! The snapshot target's harness ([`snapshot()`]): arbitrary bytes as a snapshot file, opened
//! and read whole by the [`Reader`], which must refuse it or hand out only what it checked.
//! The file is built from pieces in a scratch file on a tmpfs (a sparse file of the header's
//! length costs only the pieces), and the checksums the fuzzer cannot compute are resealed on
//! request, so that its changes reach the checks behind them.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_migrate::ram::next_data_in_file;
use ferry_migrate::snapshot::{Reader, format::Limits, state};
use ferry_migrate::wire::{self, PAGE_SIZE};

/// A snapshot file as an input: a flags byte ([`SnapshotInput::RESEAL_AREAS`] and the others),
/// then pieces, each an offset (u32), a length (u32) and its bytes (the last piece takes what
/// is left), written in order into an empty file (so later pieces win); then the checksums the
/// flags say are rewritten, and the file is sized to the header's length unless
/// [`SnapshotInput::SHORT`]: the rest is holes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotInput {
    pub flags: u8,
    pub pieces: Vec<(u64, Vec<u8>)>,
}

/// Most bytes the harness sums or builds to reseal an area: larger ones are left as they are.
const RESEAL_MAX: u64 = 1 << 20;

impl SnapshotInput {
    /// Rewrite the metadata areas' CRCs in the header to match the file.
    pub const RESEAL_AREAS: u8 = 1;
    /// Rewrite the page CRC table from the pages the file holds (at most 2^18 pages).
    pub const RESEAL_TABLE: u8 = 2;
    /// Leave the header's own CRC as it is (else it is rewritten to match, last).
    pub const KEEP_HEADER_CRC: u8 = 4;
    /// Do not size the file to the header's length.
    pub const SHORT: u8 = 8;

    pub fn decode(input: &[u8]) -> SnapshotInput {
        let Some((&flags, mut rest)) = input.split_first() else {
            return SnapshotInput::default();
        };
        let mut pieces = Vec::new();
        while rest.len() >= 8 {
            let offset = u32::from_le_bytes(rest[..4].try_into().unwrap());
            let len = u32::from_le_bytes(rest[4..8].try_into().unwrap()) as usize;
            let (bytes, left) = rest[8..].split_at(len.min(rest.len() - 8));
            pieces.push((u64::from(offset), bytes.to_vec()));
            rest = left;
        }
        SnapshotInput { flags, pieces }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.flags];
        for (offset, bytes) in &self.pieces {
            v.extend_from_slice(&(*offset as u32).to_le_bytes());
            v.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            v.extend_from_slice(bytes);
        }
        v
    }

    /// The input that writes `file` as it is: its data, as `SEEK_DATA` finds it, in pieces.
    pub fn of_file(file: &File, flags: u8) -> io::Result<SnapshotInput> {
        let len = file.metadata()?.len();
        let mut pieces = Vec::new();
        let mut at = 0;
        while let Some((data, hole)) = next_data_in_file(file.as_raw_fd(), at, len)? {
            let mut bytes = vec![0u8; (hole.min(len) - data) as usize];
            file.read_exact_at(&mut bytes, data)?;
            pieces.push((data, bytes));
            at = hole;
        }
        Ok(SnapshotInput { flags, pieces })
    }
}

/// Reads what `file` holds at `at` into `buf`; zeros past its end (a hole, once it is sized)
/// and past the largest offset a file has.
fn read_upto(file: &File, buf: &mut [u8], at: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() && at.saturating_add(buf.len() as u64) <= i64::MAX as u64 {
        match file.read_at(&mut buf[done..], at + done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    buf[done..].fill(0);
    Ok(())
}

fn field(h: &[u8; 4096], at: usize) -> u64 {
    u64::from_le_bytes(h[at..at + 8].try_into().unwrap())
}

/// Rewrites in `file` (the pieces written) what `flags` say: the CRC table from the pages, the
/// areas' CRCs, the header's CRC. Reads back from the file rather than the pieces: later
/// pieces win there already, and a thousand small pieces cost no more than one.
fn reseal(file: &File, flags: u8, buf: &mut [u8]) -> io::Result<()> {
    let mut h = [0u8; 4096];
    read_upto(file, &mut h, 0)?;
    let pages = field(&h, 24) / PAGE_SIZE;
    let (table_at, ram_at) = (field(&h, 120), field(&h, 128));
    let ram_end = ram_at.checked_add(pages * PAGE_SIZE);
    // (A file takes offsets up to 2^63; the table is put only where pieces may lie.)
    if flags & SnapshotInput::RESEAL_TABLE != 0
        && pages <= 1 << 18
        && table_at <= u64::from(u32::MAX)
        && let Some(ram_end) = ram_end.filter(|&e| e <= i64::MAX as u64)
    {
        let zero = wire::crc(&[0u8; PAGE_SIZE as usize]);
        let mut table: Vec<u8> = (0..pages).flat_map(|_| zero.to_le_bytes()).collect();
        let mut at = ram_at;
        while let Some((data, hole)) = next_data_in_file(file.as_raw_fd(), at, ram_end)? {
            let page = &mut buf[..PAGE_SIZE as usize];
            for off in (data.max(ram_at)..hole.min(ram_end)).step_by(PAGE_SIZE as usize) {
                read_upto(file, page, off)?;
                let k = ((off - ram_at) / PAGE_SIZE) as usize * 4;
                table[k..k + 4].copy_from_slice(&wire::crc(page).to_le_bytes());
            }
            at = hole;
        }
        file.write_all_at(&table, table_at)?;
    }
    if flags & SnapshotInput::RESEAL_AREAS != 0 {
        for (area, crc_at) in [(56, 72), (80, 76), (96, 112), (120, 116)] {
            let (offset, len) = match area {
                120 => (table_at, pages.saturating_mul(4)),
                _ => (field(&h, area), field(&h, area + 8)),
            };
            if len <= RESEAL_MAX && offset.checked_add(len).is_some() {
                let bytes = &mut buf[..len as usize];
                read_upto(file, bytes, offset)?;
                h[crc_at..crc_at + 4].copy_from_slice(&wire::crc(bytes).to_le_bytes());
            }
        }
    }
    if flags & SnapshotInput::KEEP_HEADER_CRC == 0 {
        let crc = wire::crc(&h[..4092]);
        h[4092..].copy_from_slice(&crc.to_le_bytes());
    }
    file.write_all_at(&h, 0)
}

/// How a snapshot input ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SnapshotOutcome {
    /// The reader refused the file, or a page of it, with this error.
    Refused(String),
    /// The reader opened it and read this many pages of data, every one checked.
    Read { pages: u64 },
}

/// This thread's scratch file and a buffer of 2 MiB (a run's pages, or an area to reseal).
struct Scratch {
    file: File,
    path: PathBuf,
    buf: Vec<u8>,
}

thread_local! {
    /// The file inputs are written to, unlinked at once and reopened by its `/proc/self/fd`
    /// path: on a tmpfs when there is one, reused by every input of this thread.
    static SCRATCH: std::cell::RefCell<Scratch> = {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = Some(PathBuf::from("/dev/shm"))
            .filter(|d| d.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("ferry-fuzz-snapshot-{}-{n}", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("a scratch file for the snapshot target");
        std::fs::remove_file(&path).expect("unlinking the scratch file");
        let path = format!("/proc/self/fd/{}", file.as_raw_fd()).into();
        let buf = vec![0u8; (2 << 20).max(RESEAL_MAX as usize)];
        std::cell::RefCell::new(Scratch { file, path, buf })
    };
}

/// The fuzz target over the snapshot reader: see the module's docs. Panics where the reader
/// broke a promise.
pub fn snapshot(input: &[u8]) -> SnapshotOutcome {
    let input = SnapshotInput::decode(input);
    SCRATCH.with_borrow_mut(|s| {
        s.file.set_len(0).unwrap();
        for (at, bytes) in &input.pieces {
            s.file.write_all_at(bytes, *at).unwrap();
        }
        reseal(&s.file, input.flags, &mut s.buf).unwrap();
        let mut h = [0u8; 4096];
        read_upto(&s.file, &mut h, 0).unwrap();
        let claimed = field(&h, 128).saturating_add(field(&h, 24));
        if input.flags & SnapshotInput::SHORT == 0 && claimed > s.file.metadata().unwrap().len() {
            let _ = s.file.set_len(claimed); // past what the file system takes: left short
        }
        read(&s.path, input.flags, &mut s.buf)
    })
}

/// Opens the file at `path` and reads every page its data runs and hot set hold.
fn read(path: &std::path::Path, flags: u8, buf: &mut [u8]) -> SnapshotOutcome {
    let refused = |e: &dyn std::error::Error| SnapshotOutcome::Refused(e.to_string());
    let r = match Reader::open_with(path, &Limits::FILE_ONLY) {
        Ok(r) => r,
        Err(e) => return refused(&e),
    };
    let h = r.header();
    assert_eq!(r.config().len() as u64, h.config.len);
    assert_eq!(r.state().len() as u64, h.state.len);
    assert_eq!(r.hot().len() as u64 * 16, h.hot.len);
    let _ = state::decode(r.state());
    let resealed = SnapshotInput::RESEAL_AREAS | SnapshotInput::RESEAL_TABLE;
    let whole = flags & (resealed | SnapshotInput::KEEP_HEADER_CRC) == resealed;
    let runs = match r.data_runs(512) {
        Ok(runs) => runs,
        Err(e) if !whole => return refused(&e),
        Err(e) => panic!("a resealed file's data runs: {e}"),
    };
    // A hot run's first and last pages (reading the 2 MiB between, mostly holes, would only
    // halve the rate: they are checked like a data run's).
    let hot = r.hot().iter().flat_map(|&(gpa, n)| {
        let last = (n > 1).then(|| (gpa + (n - 1) * PAGE_SIZE, 1));
        std::iter::once((gpa, 1)).chain(last)
    });
    let mut pages = 0;
    for (gpa, n) in runs.iter().copied().chain(hot) {
        match r.read_pages(gpa, &mut buf[..(n * PAGE_SIZE) as usize]) {
            Ok(()) => pages += n,
            Err(e) if !whole => return refused(&e),
            Err(e) => panic!("a resealed file's pages at {gpa:#x}: {e}"),
        }
    }
    SnapshotOutcome::Read { pages }
}
