//! A mapped restore's guest RAM (`ferry run --restore FILE --map`): each region is a private,
//! copy-on-write mapping of the snapshot file at the region's offset, made over this VM's own
//! RAM at the same host addresses (as `adopt.rs` maps a handover's memfd), so KVM's memory
//! slots, vm-memory's regions and every device keep the addresses they hold. The guest reads
//! the file's pages from the page cache on first touch (every VM mapped from one file shares
//! them) and a page it writes becomes its own anonymous copy. The memfd stays, empty: it no
//! longer backs RAM.
//!
//! What assumes the memfd, and what a mapped VM does instead:
//! - finding populated memory (`SEEK_DATA` on the memfd), which an outgoing migration, a
//!   snapshot and a local handover start from: refused (`StartError::Mapped`), naming the fix,
//!   since the memfd would say RAM is empty;
//! - the balloon's discard (`GuestRam::punch_hole`, a hole punched in the memfd): here
//!   `MADV_DONTNEED` drops the guest's own copies of the pages, which then read as the file
//!   again, and the pages the file has data for are written with zeros, so a discarded page
//!   reads as zeros as on any VM (only pages the guest wrote over a hole of the file go back
//!   to the host);
//! - a lazy restore or an incoming migration: never into a mapped VM (it is made running).
//!
//! **The file must not change while a VM runs from it.** A private mapping keeps the guest's
//! own writes from the file, not a writer of the file from the guest: a page the guest has
//! not written yet shows what the file holds when it is first touched, and a file cut short
//! makes the guest's next touch past its end fail. Nothing here can stop another process
//! from writing the file later; `map_file` refuses a file that some process holds open for
//! writing when it maps it (a read lease taken and let go at once: `F_SETLEASE` fails then;
//! where a lease cannot be taken at all, not this process's file without `CAP_LEASE`, or a
//! file system without leases, it is not checked), keeps it open (a file removed or renamed
//! stays mapped), and the README says to treat the file as read-only while its VMs run.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};

use ferry_migrate::FileRegion;
use ferry_migrate::ram::next_data_in_file;

use super::{GuestRam, Mapped, Size};

/// Why a snapshot file could not be mapped as guest RAM, each with the fix.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error(
        "the snapshot's guest RAM is laid out as {theirs}, this VM's as {ours}: restore it into a VM of the snapshot's --memory"
    )]
    Layout { theirs: String, ours: String },
    #[error(
        "the snapshot file holds {} and its guest RAM needs {}: the file is cut short; restore another copy",
        Size(*len),
        Size(*needs)
    )]
    Short { len: u64, needs: u64 },
    #[error(
        "the snapshot file is open for writing in another process, and a VM mapped from it would see what it writes: restore once it is closed, or without --map"
    )]
    Written,
    #[error("guest RAM is already mapped from a snapshot file: a VM is restored once")]
    Twice,
    #[error("cannot {what} the snapshot file as guest RAM: {source}; restore it without --map")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

fn describe(regions: impl Iterator<Item = (u64, u64)>) -> String {
    let parts: Vec<String> = regions
        .map(|(gpa, size)| format!("{} at {gpa:#x}", Size(size)))
        .collect();
    parts.join(", ")
}

/// Whether some process holds `file` open for writing: a read lease cannot be taken then
/// (`EAGAIN`). One that is taken is let go at once (held, a writer's open would signal this
/// process). Any other failure (no right to a lease, a file system without them) says no.
fn open_for_writing(file: &File) -> bool {
    // SAFETY: fcntl on a descriptor this function borrows; F_SETLEASE takes an int.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    if r < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN);
    }
    // SAFETY: as above; F_UNLCK lets the lease just taken go.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
    false
}

impl GuestRam {
    /// Maps `regions` of `file` copy-on-write over this VM's RAM, as the module says. Only a
    /// VM that never ran is mapped (a restore's, before its state loads).
    pub fn map_file(&self, file: BorrowedFd<'_>, regions: &[FileRegion]) -> Result<(), MapError> {
        let ours = self.regions.iter().map(|r| (r.gpa, r.size));
        let theirs = regions.iter().map(|r| (r.gpa, r.size));
        if !ours.clone().eq(theirs.clone()) {
            return Err(MapError::Layout {
                theirs: describe(theirs),
                ours: describe(ours),
            });
        }
        let io = |what| move |source| MapError::Io { what, source };
        let file = File::from(file.try_clone_to_owned().map_err(io("keep"))?);
        let len = file.metadata().map_err(io("inspect"))?.len();
        let needs = regions
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0);
        if len < needs {
            return Err(MapError::Short { len, needs });
        }
        if open_for_writing(&file) {
            return Err(MapError::Written);
        }
        for (ours, theirs) in self.regions.iter().zip(regions) {
            // SAFETY: replaces exactly this VM's own mapping of the region (`host_addr`,
            // `size`, made by `GuestRam::with_pages` and unmapped only when this value drops)
            // with a private mapping of the same length and protection, of a file checked
            // above to hold it, so every pointer into the region stays valid and readable and
            // writable. Nothing touches guest RAM meanwhile: only a restore's VM, which never
            // ran, is mapped. A failed MAP_FIXED may leave the range unmapped on older kernels;
            // the error then drops this VM before anything reads it (the restore fails).
            let at = unsafe {
                libc::mmap(
                    ours.host_addr as *mut libc::c_void,
                    ours.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    file.as_raw_fd(),
                    theirs.file_offset as libc::off_t,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(io("map")(std::io::Error::last_os_error()));
            }
        }
        self.mapped
            .set(Mapped {
                file,
                regions: regions.to_vec(),
            })
            .map_err(|_| MapError::Twice)
    }

    /// Whether guest RAM is mapped from a snapshot file (`--map`).
    pub fn is_mapped(&self) -> bool {
        self.mapped.get().is_some()
    }

    /// The balloon's discard on mapped RAM (the module doc): `len` bytes at `gpa`, page
    /// aligned, inside the region `index`, read as zeros afterwards.
    pub(super) fn discard_mapped(
        &self,
        m: &Mapped,
        index: usize,
        gpa: u64,
        len: u64,
    ) -> std::io::Result<()> {
        let (r, f) = (&self.regions[index], &m.regions[index]);
        // SAFETY: `len` bytes at `gpa` lie inside this region (the caller found it), which is
        // mapped for as long as `self` lives; on a private file mapping MADV_DONTNEED drops
        // the guest's own copies of the pages, which then read as the file again (zeroed
        // below where the file has data). The balloon hands over only pages the guest gave up.
        let ret = unsafe {
            libc::madvise(
                (r.host_addr + (gpa - r.gpa)) as *mut libc::c_void,
                len as usize,
                libc::MADV_DONTNEED,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let zeros = [0u8; ferry_guest_abi::PAGE_SIZE as usize];
        let (start, end) = (
            f.file_offset + (gpa - r.gpa),
            f.file_offset + (gpa - r.gpa) + len,
        );
        let mut at = start;
        while let Some((data, hole)) = next_data_in_file(m.file.as_raw_fd(), at, end)? {
            for off in (data.max(start)..hole.min(end)).step_by(zeros.len()) {
                self.write(r.gpa + (off - f.file_offset), &zeros)
                    .map_err(std::io::Error::other)?;
            }
            at = hole;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    use super::*;

    const MIB: u64 = 1 << 20;
    const PAGE: u64 = ferry_guest_abi::PAGE_SIZE;

    /// A 64 MiB VM's RAM and a file holding it at `at`: the page at 0x1000 of RAM is data
    /// (0xaa), the rest a hole.
    /// (The file is opened read-only, as a restore opens it: a descriptor open for writing
    /// would be refused as a writer.)
    fn mapped(at: u64) -> (GuestRam, File) {
        let ram = GuestRam::new(64 * MIB).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.snap");
        let writer = File::create(&path).unwrap();
        writer.set_len(at + 64 * MIB).unwrap();
        writer
            .write_all_at(&[0xaa; PAGE as usize], at + 0x1000)
            .unwrap();
        drop(writer);
        let file = File::open(&path).unwrap();
        let regions = [FileRegion {
            gpa: 0,
            size: 64 * MIB,
            file_offset: at,
        }];
        ram.map_file(file.as_fd(), &regions).unwrap();
        (ram, file)
    }

    fn page(ram: &GuestRam, gpa: u64) -> Vec<u8> {
        let mut b = vec![0u8; PAGE as usize];
        ram.read(gpa, &mut b).unwrap();
        b
    }

    #[test]
    fn guest_ram_reads_the_file_and_its_writes_stay_its_own() {
        let (ram, file) = mapped(2 * MIB);
        assert!(ram.is_mapped());
        assert_eq!(page(&ram, 0x1000), vec![0xaa; PAGE as usize]);
        assert_eq!(page(&ram, 0x2000), vec![0; PAGE as usize]);
        ram.write(0x1000, b"own").unwrap();
        ram.write(0x9000, b"new").unwrap();
        assert_eq!(&page(&ram, 0x1000)[..4], b"own\xaa");
        let mut b = [0u8; 4];
        file.read_exact_at(&mut b, 2 * MIB + 0x1000).unwrap();
        assert_eq!(b, [0xaa; 4], "the file is never written");
        file.read_exact_at(&mut b, 2 * MIB + 0x9000).unwrap();
        assert_eq!(b, [0; 4]);
    }

    /// Item (b) of the mapped restore: `MADV_DONTNEED` alone would bring the file's page back.
    #[test]
    fn a_discarded_page_reads_as_zeros_where_the_file_has_data_and_where_it_has_none() {
        let (ram, _file) = mapped(2 * MIB);
        ram.write(0x1000, b"own").unwrap();
        ram.write(0x9000, b"new").unwrap();
        ram.punch_hole(0, 16 * PAGE).unwrap();
        for gpa in [0x1000, 0x9000] {
            assert_eq!(page(&ram, gpa), vec![0; PAGE as usize], "{gpa:#x}");
        }
    }

    #[test]
    fn a_file_too_short_or_of_another_layout_is_refused_and_ram_maps_once() {
        let (ram, file) = mapped(0);
        let e = ram
            .map_file(
                file.as_fd(),
                &[FileRegion {
                    gpa: 0,
                    size: 64 * MIB,
                    file_offset: 0,
                }],
            )
            .unwrap_err();
        assert!(matches!(e, MapError::Twice), "{e}");
        let ram = GuestRam::new(64 * MIB).unwrap();
        let e = ram
            .map_file(
                file.as_fd(),
                &[FileRegion {
                    gpa: 0,
                    size: 128 * MIB,
                    file_offset: 0,
                }],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("128M at 0x0") && e.contains("--memory"), "{e}");
        let e = ram
            .map_file(
                file.as_fd(),
                &[FileRegion {
                    gpa: 0,
                    size: 64 * MIB,
                    file_offset: 4 * MIB,
                }],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("cut short"), "{e}");
        assert!(!ram.is_mapped());
    }

    #[test]
    fn a_file_open_for_writing_elsewhere_is_refused_naming_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.snap");
        let writer = File::create(&path).unwrap();
        writer.set_len(64 * MIB).unwrap();
        let regions = [FileRegion {
            gpa: 0,
            size: 64 * MIB,
            file_offset: 0,
        }];
        let reader = File::open(&path).unwrap();
        let ram = GuestRam::new(64 * MIB).unwrap();
        let e = ram.map_file(reader.as_fd(), &regions).unwrap_err();
        assert!(matches!(e, MapError::Written), "{e}");
        assert!(e.to_string().contains("without --map"), "{e}");
        drop(writer);
        ram.map_file(reader.as_fd(), &regions).unwrap();
        assert!(ram.is_mapped());
    }
}
