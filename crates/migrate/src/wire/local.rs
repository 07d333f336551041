//! A local handover's payloads: a LocalRam record's regions of guest RAM and a LocalDevices
//! record's device descriptors, each naming by index one of the descriptors that rode on the
//! record's bytes (`SCM_RIGHTS`). The descriptors themselves are the connection's business
//! (`conn.rs`); here only the numbers that name them are checked.

#![forbid(unsafe_code)]

use super::error::WireError;
use super::format::{
    LOCAL_DEVICE_SIZE, LOCAL_REGION_SIZE, MAX_LOCAL_DEVICES, MAX_LOCAL_REGIONS, PAGE_SIZE,
};
use super::header::Header;
use super::kind::Kind;
use super::records::SectionId;

/// One region of guest RAM in a LocalRam record: `size` bytes at guest address `gpa`, backed by
/// the record's `fd`-th file descriptor at `file_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRegion {
    pub gpa: u64,
    pub size: u64,
    pub file_offset: u64,
    /// Index into the descriptors the record carries.
    pub fd: u32,
}

impl LocalRegion {
    /// A LocalRam record of `regions`.
    pub fn encode_all(regions: &[LocalRegion]) -> (Header, Vec<u8>) {
        let mut b = Vec::with_capacity(regions.len() * LOCAL_REGION_SIZE as usize);
        for r in regions {
            b.extend_from_slice(&r.gpa.to_le_bytes());
            b.extend_from_slice(&r.size.to_le_bytes());
            b.extend_from_slice(&r.file_offset.to_le_bytes());
            b.extend_from_slice(&r.fd.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
        }
        let h = Header::new(Kind::LocalRam, regions.len() as u32, b.len() as u64).seal(&b);
        (h, b)
    }

    /// A LocalRam payload's regions, each checked: page aligned, not empty, not wrapping, and
    /// naming one of the `fds` descriptors that came with it.
    pub fn decode_all(payload: &[u8], fds: usize) -> Result<Vec<LocalRegion>, WireError> {
        let mut out = Vec::new();
        for (index, c) in payload.chunks(LOCAL_REGION_SIZE as usize).enumerate() {
            let bad = |why| WireError::LocalRegion { index, why };
            if c.len() != LOCAL_REGION_SIZE as usize {
                return Err(bad("the record's length is not a whole number of regions"));
            }
            if out.len() >= MAX_LOCAL_REGIONS as usize {
                return Err(bad("more regions than a LocalRam record may carry"));
            }
            let u64_at = |at: usize| u64::from_le_bytes(c[at..at + 8].try_into().unwrap());
            let r = LocalRegion {
                gpa: u64_at(0),
                size: u64_at(8),
                file_offset: u64_at(16),
                fd: u32::from_le_bytes(c[24..28].try_into().unwrap()),
            };
            if c[28..32] != [0; 4] {
                return Err(WireError::Reserved("local region"));
            }
            if r.size == 0 || !(r.gpa | r.size | r.file_offset).is_multiple_of(PAGE_SIZE) {
                return Err(bad("empty, or not on page boundaries"));
            }
            if r.gpa.checked_add(r.size).is_none() || r.file_offset.checked_add(r.size).is_none() {
                return Err(bad("it runs past the end of the address space"));
            }
            if r.fd as usize >= fds {
                return Err(bad("it names a file descriptor the record did not carry"));
            }
            out.push(r);
        }
        Ok(out)
    }
}

/// One device descriptor in a LocalDevices record: the record's `fd`-th descriptor belongs to
/// the device whose state travels as section `id`, instance `instance` (a disk's image, a
/// tap). The engine carries it by that name and never looks at the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalDevice {
    pub id: SectionId,
    pub instance: u32,
    /// Index into the descriptors the record carries.
    pub fd: u32,
}

impl LocalDevice {
    /// A LocalDevices record of `devices`.
    pub fn encode_all(devices: &[LocalDevice]) -> (Header, Vec<u8>) {
        let mut b = Vec::with_capacity(devices.len() * LOCAL_DEVICE_SIZE as usize);
        for d in devices {
            b.extend_from_slice(&d.id.0.to_le_bytes());
            b.extend_from_slice(&d.instance.to_le_bytes());
            b.extend_from_slice(&d.fd.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
        }
        let h = Header::new(Kind::LocalDevices, devices.len() as u32, b.len() as u64).seal(&b);
        (h, b)
    }

    /// A LocalDevices payload's entries, each checked: a valid section id, no device named
    /// twice, and the `fds` descriptors that came with it each named exactly once (a
    /// descriptor no entry names would be held for nothing).
    pub fn decode_all(payload: &[u8], fds: usize) -> Result<Vec<LocalDevice>, WireError> {
        let mut out: Vec<LocalDevice> = Vec::new();
        for (index, c) in payload.chunks(LOCAL_DEVICE_SIZE as usize).enumerate() {
            let bad = |why| WireError::LocalDevice { index, why };
            if c.len() != LOCAL_DEVICE_SIZE as usize {
                return Err(bad("the record's length is not a whole number of entries"));
            }
            if out.len() >= MAX_LOCAL_DEVICES as usize {
                return Err(bad("more entries than a LocalDevices record may carry"));
            }
            let word = |at: usize| u32::from_le_bytes(c[at..at + 4].try_into().unwrap());
            let d = LocalDevice {
                id: SectionId(word(0)),
                instance: word(4),
                fd: word(8),
            };
            if word(12) != 0 {
                return Err(WireError::Reserved("local device"));
            }
            if d.id.0 == 0 {
                return Err(bad("section id 0 names no device"));
            }
            if d.fd as usize >= fds {
                return Err(bad("it names a file descriptor the record did not carry"));
            }
            if out.iter().any(|o| (o.id, o.instance) == (d.id, d.instance)) {
                return Err(bad("a device named twice"));
            }
            if out.iter().any(|o| o.fd == d.fd) {
                return Err(bad("a file descriptor named twice"));
            }
            out.push(d);
        }
        if out.len() != fds {
            return Err(WireError::LocalDevice {
                index: out.len(),
                why: "a file descriptor came that no entry names",
            });
        }
        Ok(out)
    }
}
