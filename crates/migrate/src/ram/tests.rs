//! Unit tests of `ram.rs`: layouts, page lookups, runs and the raw operations.

use super::*;

/// A `Ram` over regions with no mapping, for checking layouts only.
fn layout_only(regions: Vec<RamRegion>) -> Result<Ram, RamError> {
    // SAFETY: the callers only check the layout and address arithmetic (`page`, `size`,
    // `regions`); nothing reads or writes guest memory through this `Ram`.
    unsafe { Ram::from_regions(regions) }
}

#[test]
fn regions_are_checked() {
    let ok = layout_only(vec![
        RamRegion::for_test(1 << 32, 8192),
        RamRegion::for_test(0, 4096),
    ])
    .unwrap();
    assert_eq!(ok.regions()[0].gpa, 0, "sorted");
    assert_eq!(ok.size(), 12288);
    assert!(
        layout_only(vec![
            RamRegion::for_test(0, 8192),
            RamRegion::for_test(4096, 4096)
        ])
        .is_err()
    );
    assert!(layout_only(vec![RamRegion::for_test(100, 4096)]).is_err());
    assert_eq!(ok.page(4097), Err(RamError::Unaligned { gpa: 4097 }));
    assert_eq!(ok.page(8192), Err(RamError::OutOfRange { gpa: 8192 }));
}

#[test]
fn sizes_read_as_the_flags_take_them() {
    for (bytes, said) in [
        (1u64 << 40, "1T"),
        (3 << 30, "3G"),
        (1536 << 20, "1536M"),
        (64 << 10, "64K"),
        (100, "100 bytes"),
        (0, "0 bytes"),
    ] {
        assert_eq!(Size(bytes).to_string(), said);
    }
}

#[test]
fn populated_bytes_counts_what_the_backing_file_holds_once_per_file() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::fs::FileExt;
    // SAFETY: memfd_create with a valid name; the result is checked and owned below.
    let fd = unsafe { libc::memfd_create(c"ferry-populated-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and nothing else owns it.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(1 << 20).unwrap();
    for page in [0u64, 5, 200] {
        file.write_all_at(&[1; 4096], page * PAGE_SIZE).unwrap();
    }
    let region = |gpa: u64, offset: u64, size: u64| RamRegion {
        fd: file.as_raw_fd(),
        file_offset: offset,
        ..RamRegion::for_test(gpa, size)
    };
    let whole = layout_only(vec![region(0, 0, 1 << 20)]).unwrap();
    assert_eq!(whole.populated_bytes(), 3 * PAGE_SIZE);
    // Two regions over one file: the file is counted once, capped at what they cover.
    let split = layout_only(vec![
        region(0, 0, 1 << 19),
        region(1 << 32, 1 << 19, 1 << 19),
    ])
    .unwrap();
    assert_eq!(split.populated_bytes(), 3 * PAGE_SIZE);
    let small = layout_only(vec![region(0, 0, 2 * PAGE_SIZE)]).unwrap();
    assert_eq!(
        small.populated_bytes(),
        2 * PAGE_SIZE,
        "capped at the regions' size"
    );
}

/// Found by the `incoming` fuzz target: a zero run's page count was multiplied before it
/// was bounded, which overflows (a panic in a debug build's receiver thread).
#[test]
fn a_zero_run_of_u64_max_pages_is_refused_not_overflowed() {
    let ram = layout_only(vec![RamRegion::for_test(0, 1 << 20)]).unwrap();
    for pages in [u64::MAX, u64::MAX / PAGE_SIZE + 2, 0] {
        assert_eq!(
            ram.check_run(4096, pages),
            Err(RamError::BadRun { gpa: 4096, pages })
        );
    }
    assert_eq!(ram.check_run(4096, 255), Ok(()));
    assert_eq!(
        ram.check_run(4096, 256),
        Err(RamError::BadRun {
            gpa: 4096,
            pages: 256
        })
    );
}

/// Postcopy over held memory reads a record's pages from the socket straight into the file
/// through the alias: the pages this copy claimed land in the file, the others (another
/// copy's) are read and dropped, and the stream is left just after the record.
#[test]
fn the_alias_reads_claimed_pages_into_the_file_and_drops_the_others() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::fs::FileExt;
    // SAFETY: memfd_create with a valid name; the result is checked and owned below.
    let fd = unsafe { libc::memfd_create(c"ferry-alias-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and nothing else owns it.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(16 * PAGE_SIZE).unwrap();
    let ram = layout_only(vec![RamRegion {
        fd: file.as_raw_fd(),
        ..RamRegion::for_test(0, 16 * PAGE_SIZE)
    }])
    .unwrap();
    let alias = alias::Alias::new(&ram).unwrap();
    let gpas = [PAGE_SIZE, 2 * PAGE_SIZE, 7 * PAGE_SIZE];
    let mine = [true, false, true];
    let mut record: Vec<u8> = Vec::new();
    for k in 1..=3u8 {
        record.extend(std::iter::repeat_n(k, PAGE_SIZE as usize));
    }
    record.extend(b"next record");
    let mut stream = &record[..];
    let mut scratch = Vec::new();
    alias
        .read_pages(&mut stream, &gpas, &mine, &mut scratch)
        .unwrap();
    assert_eq!(stream, b"next record", "the record read whole, no further");
    let page = |n: u64| {
        let mut b = vec![0u8; PAGE_SIZE as usize];
        file.read_exact_at(&mut b, n * PAGE_SIZE).unwrap();
        b
    };
    assert!(page(1).iter().all(|&b| b == 1));
    assert!(
        page(2).iter().all(|&b| b == 0),
        "another copy's page untouched"
    );
    assert!(page(7).iter().all(|&b| b == 3));
    // A record cut short fails (the caller gives its claims back).
    let mut short = &record[..PAGE_SIZE as usize + 10];
    assert!(
        alias
            .read_pages(&mut short, &gpas, &mine, &mut scratch)
            .is_err()
    );
}
