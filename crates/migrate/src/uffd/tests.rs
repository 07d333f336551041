//! Faults on a memfd mapped `MAP_SHARED`, as destination guest RAM is. These need userfaultfd
//! for missing faults on shmem and fail, with the reason, where it cannot be opened.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;

use super::*;

/// How long a test waits for something that takes microseconds (a reader thread faulting, a
/// woken one finishing): room for a loaded 2-core machine, and a bound so a lost wake fails the
/// test instead of hanging it.
const EVENT_WAIT: Duration = Duration::from_secs(5);

/// How long a reader must stay blocked to count as not woken. One-sided: a wrong wake that
/// came later would go unseen, but one seen is always a bug.
const STAYS_BLOCKED: Duration = Duration::from_millis(200);

fn open_uffd() -> Uffd {
    Uffd::new()
        .unwrap_or_else(|e| panic!("these tests need userfaultfd, and opening it failed: {e}"))
}

/// `pages` pages of a fresh memfd, mapped shared and registered for missing faults.
struct Guest {
    uffd: Uffd,
    addr: usize,
    len: usize,
    _memfd: OwnedFd,
}

impl Guest {
    fn new(pages: usize) -> Guest {
        Guest::registered(pages, Faults::Missing)
    }

    fn registered(pages: usize, faults: Faults) -> Guest {
        let uffd = open_uffd();
        let len = pages * PAGE;
        // SAFETY: a NUL-terminated name and flags; returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"ferry-uffd-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: a new fd nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own memfd.
        let ret = unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) };
        assert_eq!(ret, 0, "ftruncate: {}", io::Error::last_os_error());
        // SAFETY: a new shared mapping of the memfd at an address the kernel picks; it
        // overlaps nothing of ours.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            io::Error::last_os_error()
        );
        let addr = ptr as usize;
        // SAFETY: the mapping is ours, lives until `Guest` drops (after the reader threads are
        // joined), and the tests reach it only through raw pointers (`read_pages`).
        let ranges = unsafe { uffd.register(addr, len, faults) }
            .unwrap_or_else(|e| panic!("registering a memfd mapping: {e}"));
        assert!(ranges.zeropage, "shmem offers UFFDIO_ZEROPAGE");
        assert_eq!(
            ranges.continue_,
            faults == Faults::MissingAndMinor,
            "UFFDIO_CONTINUE with minor faults"
        );
        Guest {
            uffd,
            addr,
            len,
            _memfd: memfd,
        }
    }

    fn page(&self, i: usize) -> usize {
        self.addr + i * PAGE
    }

    /// Ends the registration under a blocked reader, which then reads the page as the memfd
    /// has it (zeros), and joins it.
    fn unregister_and_join(&self, reader: Reader) {
        self.uffd.unregister(self.addr, self.len).unwrap();
        assert_eq!(reader.finish(), vec![vec![0u8; PAGE]]);
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A reader may still be blocked in the mapping; dropping the `Uffd` wakes it, and
            // unmapping under it would turn the test's failure into a SIGSEGV. Leak it.
            return;
        }
        // SAFETY: our mapping, with no reader left (every test joins its readers).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// For each of `addrs`, touches that byte, then copies out the page that holds it, through raw
/// pointers (blocking on missing pages).
fn read_pages(addrs: &[usize]) -> Vec<Vec<u8>> {
    addrs
        .iter()
        .map(|&addr| {
            let start = addr & !(PAGE - 1);
            let mut page = vec![0u8; PAGE];
            // SAFETY: a byte and then a page of a `Guest` mapping, alive until the test joins
            // this thread; read without making a reference to guest memory.
            unsafe {
                std::ptr::read_volatile(addr as *const u8);
                std::ptr::copy_nonoverlapping(start as *const u8, page.as_mut_ptr(), PAGE);
            }
            page
        })
        .collect()
}

/// A thread that reads `addrs` in order: it sends its thread id, then the pages it read.
struct Reader {
    tid: u32,
    pages: Receiver<Vec<Vec<u8>>>,
    thread: JoinHandle<()>,
}

impl Reader {
    fn spawn(addrs: Vec<usize>) -> Reader {
        let (tid_tx, tid_rx) = mpsc::channel();
        let (pages_tx, pages) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tid_tx.send(unsafe { libc::gettid() } as u32).unwrap();
            pages_tx.send(read_pages(&addrs)).unwrap();
        });
        let tid = tid_rx
            .recv_timeout(EVENT_WAIT)
            .expect("reader thread started");
        Reader { tid, pages, thread }
    }

    fn finish(self) -> Vec<Vec<u8>> {
        let pages = self
            .pages
            .recv_timeout(EVENT_WAIT)
            .expect("the reader was woken and finished");
        self.thread.join().unwrap();
        pages
    }
}

/// The next fault, waiting up to `EVENT_WAIT`; exactly one is expected.
fn one_fault(uffd: &Uffd) -> Fault {
    let mut faults = Vec::new();
    let n = uffd.read_faults(&mut faults, EVENT_WAIT).unwrap();
    assert_eq!(n, 1, "one blocked reader, one fault: {faults:?}");
    faults[0]
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (i as u8).wrapping_mul(7) ^ seed)
        .collect()
}

#[test]
fn features_are_reported() {
    let uffd = open_uffd();
    let f = uffd.features();
    eprintln!("userfaultfd features: {f:?}");
    assert!(f.missing_shmem, "destination RAM is a memfd: {f:?}");
    assert_ne!(f.available & UFFD_FEATURE_THREAD_ID, 0);
}

#[test]
fn fault_carries_page_and_thread_and_copy_releases_it() {
    let guest = Guest::new(4);
    let page = guest.page(2);
    // Read from the middle of the page: the fault still names the page.
    let reader = Reader::spawn(vec![page + 100]);
    let fault = one_fault(&guest.uffd);
    assert_eq!(
        fault,
        Fault {
            addr: page,
            write: false,
            minor: false,
            thread_id: reader.tid,
        }
    );
    let data = pattern(0x5a);
    let outcome = guest.uffd.copy(page, &data, Wake::Now).unwrap();
    assert_eq!(outcome, CopyOutcome::Copied);
    assert_eq!(reader.finish(), vec![data]);
}

#[test]
fn write_fault_is_marked_write() {
    let guest = Guest::new(2);
    let page = guest.page(1);
    let (tid_tx, tid_rx) = mpsc::channel();
    let writer = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() } as u32).unwrap();
        // SAFETY: a byte of a `Guest` mapping, alive until the test joins this thread; written
        // without making a reference to guest memory.
        unsafe { std::ptr::write_volatile((page + 8) as *mut u8, 0xee) };
    });
    let tid = tid_rx.recv_timeout(EVENT_WAIT).unwrap();
    let fault = one_fault(&guest.uffd);
    assert_eq!(
        fault,
        Fault {
            addr: page,
            write: true,
            minor: false,
            thread_id: tid,
        }
    );
    let data = pattern(0x77);
    assert_eq!(
        guest.uffd.copy(page, &data, Wake::Now).unwrap(),
        CopyOutcome::Copied
    );
    writer.join().unwrap();
    // The write lands on the placed page, after the copy.
    let mut expected = data;
    expected[8] = 0xee;
    assert_eq!(read_pages(&[page]), vec![expected]);
}

#[test]
fn zeropage_releases_a_reader_with_zeros() {
    let guest = Guest::new(2);
    let page = guest.page(0);
    let reader = Reader::spawn(vec![page]);
    assert_eq!(one_fault(&guest.uffd).addr, page);
    let outcome = guest.uffd.zeropage(page, PAGE, Wake::Now).unwrap();
    assert_eq!(outcome, CopyOutcome::Copied);
    assert_eq!(reader.finish(), vec![vec![0u8; PAGE]]);
    // The zero page is a placed page like any other.
    let outcome = guest.uffd.copy(page, &pattern(1), Wake::Now).unwrap();
    assert_eq!(outcome, CopyOutcome::AlreadyThere);
    assert_eq!(read_pages(&[page]), vec![vec![0u8; PAGE]]);
}

#[test]
fn copy_over_a_present_page_is_already_there_and_changes_nothing() {
    let guest = Guest::new(2);
    let page = guest.page(1);
    let first = pattern(0x11);
    assert_eq!(
        guest.uffd.copy(page, &first, Wake::Now).unwrap(),
        CopyOutcome::Copied
    );
    let second = pattern(0x22);
    assert_eq!(
        guest.uffd.copy(page, &second, Wake::Now).unwrap(),
        CopyOutcome::AlreadyThere
    );
    assert_eq!(read_pages(&[page]), vec![first]);
}

#[test]
fn copy_of_a_run_skips_the_page_already_there() {
    let guest = Guest::new(4);
    let present = pattern(0x33);
    assert_eq!(
        guest.uffd.copy(guest.page(1), &present, Wake::Now).unwrap(),
        CopyOutcome::Copied
    );
    let run: Vec<u8> = (0..3).flat_map(|i| pattern(0x40 + i)).collect();
    let outcome = guest.uffd.copy(guest.page(0), &run, Wake::Now).unwrap();
    assert_eq!(outcome, CopyOutcome::Partly { copied: 2 * PAGE });
    let pages = read_pages(&[guest.page(0), guest.page(1), guest.page(2)]);
    assert_eq!(pages, vec![pattern(0x40), present, pattern(0x42)]);
    // Page 3 was not in the run: still missing, so still registered and faulting.
    let reader = Reader::spawn(vec![guest.page(3)]);
    assert_eq!(one_fault(&guest.uffd).addr, guest.page(3));
    guest.unregister_and_join(reader);
}

#[test]
fn dontwake_copies_then_one_wake_releases_the_reader() {
    let guest = Guest::new(4);
    let (a, b) = (guest.page(1), guest.page(2));
    let reader = Reader::spawn(vec![a, b]);
    let fault = one_fault(&guest.uffd);
    assert_eq!((fault.addr, fault.thread_id), (a, reader.tid));
    let (pa, pb) = (pattern(0xa0), pattern(0xb0));
    assert_eq!(
        guest.uffd.copy(a, &pa, Wake::Later).unwrap(),
        CopyOutcome::Copied
    );
    assert_eq!(
        guest.uffd.copy(b, &pb, Wake::Later).unwrap(),
        CopyOutcome::Copied
    );
    assert_eq!(
        reader.pages.recv_timeout(STAYS_BLOCKED),
        Err(RecvTimeoutError::Timeout),
        "a DONTWAKE copy woke the reader"
    );
    guest.uffd.wake(a, 2 * PAGE).unwrap();
    assert_eq!(reader.finish(), vec![pa, pb]);
    // Page b was in place before the reader reached it: no second fault.
    let mut faults = Vec::new();
    assert_eq!(
        guest.uffd.read_faults(&mut faults, Duration::ZERO).unwrap(),
        0
    );
}

#[test]
fn read_faults_with_none_pending_times_out_with_zero() {
    let guest = Guest::new(1);
    let timeout = Duration::from_millis(50);
    let mut faults = Vec::new();
    let start = Instant::now();
    assert_eq!(guest.uffd.read_faults(&mut faults, timeout).unwrap(), 0);
    assert!(
        start.elapsed() >= timeout,
        "returned after {:?}",
        start.elapsed()
    );
    assert!(faults.is_empty());
}

#[test]
fn ranges_must_be_whole_pages() {
    let guest = Guest::new(2);
    let unaligned =
        |r: Result<CopyOutcome, UffdError>| matches!(r, Err(UffdError::Unaligned { .. }));
    assert!(unaligned(guest.uffd.copy(
        guest.page(0) + 1,
        &pattern(0),
        Wake::Now
    )));
    assert!(unaligned(guest.uffd.copy(
        guest.page(0),
        &[0; 100],
        Wake::Now
    )));
    assert!(unaligned(guest.uffd.zeropage(guest.page(0), 0, Wake::Now)));
}

#[test]
fn copy_outside_a_registered_range_fails() {
    let guest = Guest::new(2);
    guest.uffd.unregister(guest.page(1), PAGE).unwrap();
    let err = guest
        .uffd
        .copy(guest.page(1), &pattern(0), Wake::Now)
        .unwrap_err();
    let UffdError::Fill { source, .. } = &err else {
        panic!("expected a Fill error, got {err}");
    };
    assert_eq!(source.raw_os_error(), Some(libc::ENOENT), "{err}");
}

/// Writes `data` into the guest's memfd at page `i` (not through the mapping).
fn write_file(guest: &Guest, i: usize, data: &[u8]) {
    let fd = guest._memfd.as_raw_fd();
    // SAFETY: pwrite from a live buffer of `data.len()` bytes into our own memfd.
    let n = unsafe {
        libc::pwrite(
            fd,
            data.as_ptr().cast(),
            data.len(),
            (i * PAGE) as libc::off_t,
        )
    };
    assert_eq!(
        n,
        data.len() as isize,
        "pwrite: {}",
        io::Error::last_os_error()
    );
}

#[test]
fn a_page_in_the_file_but_not_mapped_faults_minor_and_continue_maps_what_the_file_holds() {
    let guest = Guest::registered(4, Faults::MissingAndMinor);
    assert!(
        guest.uffd.features().minor_shmem,
        "this kernel has minor faults on shmem"
    );
    let page = guest.page(1);
    write_file(&guest, 1, &pattern(0x11));
    let reader = Reader::spawn(vec![page + 7]);
    let fault = one_fault(&guest.uffd);
    assert_eq!((fault.addr, fault.minor), (page, true), "{fault:?}");
    // The bytes a receiver writes before mapping are what the reader gets.
    write_file(&guest, 1, &pattern(0x22));
    assert_eq!(
        guest.uffd.continue_range(page, PAGE, Wake::Now).unwrap(),
        CopyOutcome::Copied
    );
    assert_eq!(reader.finish(), vec![pattern(0x22)]);
    // Mapped once: a second continue changes nothing.
    assert_eq!(
        guest.uffd.continue_range(page, PAGE, Wake::Now).unwrap(),
        CopyOutcome::AlreadyThere
    );
    // A hole of the file has nothing to map: that is a copy's to fill.
    assert!(
        guest
            .uffd
            .continue_range(guest.page(2), PAGE, Wake::Now)
            .is_err()
    );
}

#[test]
fn a_hole_still_faults_missing_under_minor_registration() {
    let guest = Guest::registered(2, Faults::MissingAndMinor);
    let page = guest.page(0);
    let reader = Reader::spawn(vec![page]);
    let fault = one_fault(&guest.uffd);
    assert_eq!((fault.addr, fault.minor), (page, false), "{fault:?}");
    let data = pattern(0x33);
    assert_eq!(
        guest.uffd.copy(page, &data, Wake::Now).unwrap(),
        CopyOutcome::Copied
    );
    assert_eq!(reader.finish(), vec![data]);
}
