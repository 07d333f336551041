//! What the checks share: unwrapping an operation that must work, asserting one that must be
//! refused, reading and writing guest memory by its mapping or its file, a dirty fetch as the
//! engine makes one, and the VMs a check starts from. Below every check file, so that none of
//! them imports another or the module that re-exports them.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use ferry_migrate::bitmap::{Cursor, DirtyBitmap};
use ferry_migrate::ram::{Ram, RamRegion};
use ferry_migrate::wire::{LocalRegion, PAGE_SIZE};
use ferry_migrate::{DestinationVm, PageLanding, Section, SourceVm, StatePart, VmError};

use crate::conformance::fixture::Fixture;

/// Unwraps an operation's result; `Unsupported` and failures fail the check, named.
pub(crate) fn ok<T>(operation: &str, r: Result<T, VmError>) -> T {
    match r {
        Ok(v) => v,
        Err(e @ VmError::Unsupported { .. }) => {
            panic!("{operation}: {e}; the engine needs it to migrate a VM")
        }
        Err(e) => panic!("{operation} failed: {e}"),
    }
}

/// Asserts that `op` refuses `what` with an error: not a panic, not a silent success, and not
/// `Unsupported` (the VMM does the operation, so it must say what is wrong with this one).
pub(crate) fn refused(what: &str, op: impl FnOnce() -> Result<(), VmError>) {
    match std::panic::catch_unwind(AssertUnwindSafe(op)) {
        Ok(Err(VmError::Unsupported { operation })) => {
            panic!("{what}: refused as unsupported ({operation}), though the VMM does it")
        }
        Ok(Err(_)) => {}
        Ok(Ok(())) => panic!("{what}: accepted"),
        Err(_) => panic!("{what}: panicked instead of refusing"),
    }
}

pub(crate) fn sorted(mut regions: Vec<RamRegion>) -> Vec<RamRegion> {
    regions.sort_by_key(|r| r.gpa);
    regions
}

/// The regions as `(gpa, size)`, in address order: what a layout comparison looks at.
pub(crate) fn layout(regions: Vec<RamRegion>) -> Vec<(u64, u64)> {
    sorted(regions).iter().map(|r| (r.gpa, r.size)).collect()
}

/// One `fetch_dirty` into a fresh bitmap: the reported pages, in address order.
pub(crate) fn fetch(src: &mut impl SourceVm) -> Vec<u64> {
    let mut bitmap = DirtyBitmap::new(&sorted(src.ram()));
    ok("fetch_dirty", src.fetch_dirty(&mut bitmap));
    let (mut cursor, mut pages) = (Cursor::default(), Vec::new());
    while !cursor.at_end(&bitmap) {
        bitmap.take(&mut cursor, usize::MAX, &mut pages);
    }
    pages
}

/// Has the VMM write, unchanged, a byte in the first and the last page of every region (a
/// page boundary apart from any other), and returns those pages in address order.
pub(crate) fn touch_each_region<F: Fixture>(f: &mut F, src: &mut F::Source) -> Vec<u64> {
    let mut pages = Vec::new();
    for r in sorted(src.ram()) {
        for page in [r.gpa, r.gpa + r.size - PAGE_SIZE] {
            let gpa = page + 100;
            f.vmm_write(src, gpa, host_byte(&r, gpa));
            pages.push(page);
        }
    }
    pages.dedup();
    pages
}

/// A paused source with dirty tracking on (started after the pause, so the log is empty):
/// nothing writes but the suite.
pub(crate) fn tracking_paused_source<F: Fixture>(f: &mut F) -> F::Source {
    let mut src = f.source();
    ok("pause", src.pause());
    start_tracking(&mut src, "start_dirty_log");
    src
}

/// Starts dirty tracking and arms all of RAM, as the engine's pass 1 arms what it reads
/// (`SourceVm::arm_dirty`; a VMM whose log starts whole answers unsupported).
pub(crate) fn start_tracking<S: SourceVm>(src: &mut S, what: &str) {
    ok(what, src.start_dirty_log());
    for r in src.ram() {
        match src.arm_dirty(r.gpa, r.size) {
            Ok(()) | Err(VmError::Unsupported { .. }) => {}
            Err(e) => panic!("arm_dirty({:#x}, {:#x}): {e}", r.gpa, r.size),
        }
    }
}

pub(crate) fn saved_state<F: Fixture>(f: &mut F) -> Vec<Section> {
    let mut src = f.source();
    ok("pause", src.pause());
    ok("save_state", src.save_state())
}

/// Bytes of data in `sections`.
pub(crate) fn state_bytes(sections: &[Section]) -> u64 {
    sections.iter().map(|s| s.data.len() as u64).sum()
}

/// What `state_parts` may say about a save or a load that took `took` and moved `bytes` of
/// state: at most [`MAX_STATE_PARTS`](ferry_migrate::wire::MAX_STATE_PARTS) parts (the engine
/// drops the rest), each named in 1 to [`MAX_PART_NAME`](ferry_migrate::wire::MAX_PART_NAME)
/// bytes (it cuts longer names), with a time that is a time and no more in all than the calls
/// took, and no more bytes in all than the sections hold.
pub(crate) fn check_parts(what: &str, parts: &[StatePart], took: Duration, bytes: u64) {
    use ferry_migrate::wire::{MAX_PART_NAME, MAX_STATE_PARTS};
    assert!(
        parts.len() <= MAX_STATE_PARTS as usize,
        "{what}: {} parts, more than {MAX_STATE_PARTS}",
        parts.len()
    );
    for p in parts {
        assert!(
            !p.name.is_empty() && p.name.len() <= MAX_PART_NAME,
            "{what}: a part named {:?} ({} bytes; 1 to {MAX_PART_NAME})",
            p.name,
            p.name.len()
        );
        assert!(
            p.ms.is_finite() && p.ms >= 0.0,
            "{what}: part {:?} took {} ms",
            p.name,
            p.ms
        );
    }
    // The parts are timed inside the calls, so their sum is within the calls' own time (the
    // slack is float rounding, well under a nanosecond's worth).
    let ms: f64 = parts.iter().map(|p| p.ms).sum();
    let limit = took.as_secs_f64() * 1e3;
    assert!(
        ms <= limit + 1e-6,
        "{what}: the parts add up to {ms:.3} ms, and the calls took {limit:.3} ms: {parts:?}"
    );
    let counted: u64 = parts.iter().map(|p| p.bytes).sum();
    assert!(
        counted <= bytes,
        "{what}: the parts count {counted} bytes of state, and the sections hold {bytes}: {parts:?}"
    );
}

/// The byte at `gpa` of region `r`, read through its mapping with `/proc/self/mem`, so that a
/// region that is not mapped fails with an error instead of a fault.
pub(crate) fn host_byte(r: &RamRegion, gpa: u64) -> u8 {
    let mem = File::open("/proc/self/mem").expect("/proc/self/mem");
    let at = r.host_addr as u64 + (gpa - r.gpa);
    let mut b = [0u8];
    mem.read_exact_at(&mut b, at)
        .unwrap_or_else(|e| panic!("guest address {gpa:#x} is not readable at {at:#x}: {e}"));
    b[0]
}

/// Writes `byte` at `gpa` of region `r` through its mapping, with `/proc/self/mem` (which
/// refuses a shared mapping that is not writable, as a store would fault on it).
pub(crate) fn set_host_byte(r: &RamRegion, gpa: u64, byte: u8) {
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")
        .expect("/proc/self/mem");
    let at = r.host_addr as u64 + (gpa - r.gpa);
    mem.write_all_at(&[byte], at)
        .unwrap_or_else(|e| panic!("guest address {gpa:#x} is not writable at {at:#x}: {e}"));
}

/// The file behind region `r` (its `fd`, opened again), for reading and writing.
pub(crate) fn region_file(r: &RamRegion) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", r.fd))
        .unwrap_or_else(|e| panic!("the file of region {:#x} (fd {}): {e}", r.gpa, r.fd))
}

/// The byte at `gpa` of region `r`, read from its file at `file_offset`.
pub(crate) fn file_byte(r: &RamRegion, gpa: u64) -> u8 {
    let mut b = [0u8];
    region_file(r)
        .read_exact_at(&mut b, r.file_offset + (gpa - r.gpa))
        .unwrap_or_else(|e| panic!("reading guest address {gpa:#x} from the file: {e}"));
    b[0]
}

/// Writes `byte` at `gpa` of region `r` through its file at `file_offset`.
pub(crate) fn set_file_byte(r: &RamRegion, gpa: u64, byte: u8) {
    region_file(r)
        .write_all_at(&[byte], r.file_offset + (gpa - r.gpa))
        .unwrap_or_else(|e| panic!("writing guest address {gpa:#x} to the file: {e}"));
}

/// Writes `byte` at `gpa` of region `r` the way `landing` lands received pages.
pub(crate) fn land_byte(landing: PageLanding, r: &RamRegion, gpa: u64, byte: u8) {
    match landing {
        PageLanding::Mapping => set_host_byte(r, gpa, byte),
        PageLanding::File => set_file_byte(r, gpa, byte),
    }
}

/// Copies a paused source's guest RAM into a destination that never ran, region by region,
/// landing it the way the destination asks of a migration with one channel (a restore, too,
/// fills RAM before it loads the state). A chunk of zeros is skipped: a destination's RAM
/// starts zero, as the engine assumes when it skips the source's holes.
pub(crate) fn copy_ram(src: &impl SourceVm, dst: &impl DestinationVm) {
    /// 1 MiB at a time: a few dozen reads for a test VM's memory.
    const CHUNK: u64 = 1 << 20;
    let landing = dst.page_landing(1);
    let (from, to) = (sorted(src.ram()), sorted(dst.ram()));
    assert_eq!(
        layout(src.ram()),
        layout(dst.ram()),
        "the destination's RAM layout is the source's"
    );
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")
        .expect("/proc/self/mem");
    let mut buf = vec![0u8; CHUNK as usize];
    for (s, d) in from.iter().zip(&to) {
        let (source, target) = (region_file(s), region_file(d));
        let mut at = 0;
        while at < s.size {
            let n = CHUNK.min(s.size - at) as usize;
            source
                .read_exact_at(&mut buf[..n], s.file_offset + at)
                .unwrap_or_else(|e| panic!("reading the source's RAM at {:#x}: {e}", s.gpa + at));
            if buf[..n].iter().any(|&b| b != 0) {
                let written = match landing {
                    PageLanding::Mapping => mem.write_all_at(&buf[..n], d.host_addr as u64 + at),
                    PageLanding::File => target.write_all_at(&buf[..n], d.file_offset + at),
                };
                written.unwrap_or_else(|e| {
                    panic!(
                        "landing the source's RAM at {:#x} ({landing:?}): {e}",
                        d.gpa + at
                    )
                });
            }
            at += n as u64;
        }
    }
}

/// `src`'s RAM as a local handover hands it to a destination: the regions, and a descriptor
/// of each file they name, of its own; `None` when a region has no file (a handover refuses
/// such a VM before it asks the destination anything).
pub(crate) fn handover(src: &impl SourceVm) -> Option<(Vec<LocalRegion>, Vec<OwnedFd>)> {
    // SAFETY: the regions are `src.ram()`, which `SourceVm`'s contract keeps mapped and
    // readable, each `fd` open, while `src` lives; this `Ram` is dropped at the end of this
    // function, before `src`, and reaches no guest memory: only its descriptors are copied.
    let ram = unsafe { Ram::from_regions(src.ram()) }.expect("ram() is well formed");
    let (regions, fds) = ram.local_layout().ok()?;
    let fds = fds
        .iter()
        .map(|fd| {
            fd.try_clone_to_owned()
                .unwrap_or_else(|e| panic!("a copy of guest RAM's descriptor: {e}"))
        })
        .collect();
    Some((regions, fds))
}

/// A file of one page, sealed against shrinking and growing as a VMM may require of the guest
/// RAM it maps: given as a handover's only file, what a destination must refuse is its length.
pub(crate) fn short_file() -> OwnedFd {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create takes a NUL-terminated name and flags, and returns a new
    // descriptor or -1, checked below.
    let fd = unsafe { libc::memfd_create(c"ferry-conformance-short".as_ptr(), flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just made, and nothing else owns it.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(PAGE_SIZE).expect("sizing the short file");
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: F_ADD_SEALS on a descriptor this function owns, with seal flags for argument.
    let sealed = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(
        sealed,
        0,
        "sealing the short file: {}",
        std::io::Error::last_os_error()
    );
    file.into()
}
