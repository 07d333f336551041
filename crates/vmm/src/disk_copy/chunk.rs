//! One chunk of a copied disk on the wire: a 32-byte header, then the bytes of the range, or
//! nothing when the range reads as zeros. The engine carries it as an iterative-state section
//! (`section_ids::DISK_BLOCKS`) without knowing what it holds; this file is the only place that
//! does.
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..8 | the disk's size in bytes (every chunk says it: the destination sizes its image by the first and refuses a chunk that differs) |
//! | 8..16 | the range's offset, a multiple of 512 |
//! | 16..20 | the range's length, a multiple of 512, 1 to [`MAX_RANGE`] bytes |
//! | 20..24 | what follows: 0 = the range's bytes, 1 = none (the range reads as zeros) |
//! | 24..32 | zero (reserved) |

#![forbid(unsafe_code)]

/// The layout version of a chunk, the section's version on the wire.
pub const VERSION: u32 = 1;
/// Bytes of a chunk's header.
pub const HEADER: usize = 32;
/// The largest range one chunk carries: what fits in a section with its header.
pub const MAX_RANGE: u64 = ferry_migrate::wire::MAX_SECTION_BYTES - HEADER as u64;
/// Offsets and lengths are whole sectors.
const SECTOR: u64 = ferry_guest_abi::virtio::blk::SECTOR_SIZE;

const DATA: u32 = 0;
const ZEROS: u32 = 1;

/// One range of a copied disk, over the bytes it was read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk<'a> {
    /// The disk's size in bytes.
    pub capacity: u64,
    pub offset: u64,
    pub len: u64,
    /// The range's bytes (`len` of them), or `None` when it reads as zeros.
    pub data: Option<&'a [u8]>,
}

/// Why a chunk was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChunkError {
    #[error("a disk chunk of {0} bytes is shorter than its {HEADER}-byte header")]
    Short(usize),
    #[error(
        "a disk chunk's range {offset}+{len} is not within the disk's {capacity} bytes in whole sectors of 512, or is longer than {MAX_RANGE}"
    )]
    Range {
        capacity: u64,
        offset: u64,
        len: u64,
    },
    #[error("a disk chunk of kind {0} is neither data (0) nor zeros (1)")]
    Kind(u32),
    #[error("a disk chunk of {len} bytes carries {got} bytes of data")]
    Length { len: u64, got: usize },
}

/// Writes a chunk's header into `out` (its first [`HEADER`] bytes): the range
/// `offset..offset + len` of a disk of `capacity` bytes, followed by its bytes or, with
/// `zeros`, by nothing.
pub fn write_header(out: &mut [u8], capacity: u64, offset: u64, len: u64, zeros: bool) {
    let kind = if zeros { ZEROS } else { DATA };
    out[0..8].copy_from_slice(&capacity.to_le_bytes());
    out[8..16].copy_from_slice(&offset.to_le_bytes());
    out[16..20].copy_from_slice(&(len as u32).to_le_bytes());
    out[20..24].copy_from_slice(&kind.to_le_bytes());
    out[24..HEADER].fill(0);
}

impl Chunk<'_> {
    /// The chunk's bytes, header first.
    pub fn encode(&self) -> Vec<u8> {
        let body = self.data.unwrap_or(&[]);
        let mut out = vec![0; HEADER + body.len()];
        write_header(
            &mut out,
            self.capacity,
            self.offset,
            self.len,
            self.data.is_none(),
        );
        out[HEADER..].copy_from_slice(body);
        out
    }

    /// Reads and checks a chunk: its range within its disk in whole sectors, and as many
    /// bytes as its range when it carries data.
    pub fn decode(bytes: &[u8]) -> Result<Chunk<'_>, ChunkError> {
        if bytes.len() < HEADER {
            return Err(ChunkError::Short(bytes.len()));
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let (capacity, offset, len) = (u64_at(0), u64_at(8), u64::from(u32_at(16)));
        let whole = |v: u64| v.is_multiple_of(SECTOR);
        let within = offset.checked_add(len).is_some_and(|end| end <= capacity);
        if len == 0 || len > MAX_RANGE || !whole(offset) || !whole(len) || !within {
            return Err(ChunkError::Range {
                capacity,
                offset,
                len,
            });
        }
        let body = &bytes[HEADER..];
        let data = match u32_at(20) {
            DATA if body.len() as u64 == len => Some(body),
            ZEROS if body.is_empty() => None,
            DATA | ZEROS => {
                return Err(ChunkError::Length {
                    len,
                    got: body.len(),
                });
            }
            kind => return Err(ChunkError::Kind(kind)),
        };
        Ok(Chunk {
            capacity,
            offset,
            len,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_round_trips_with_data_or_as_zeros() {
        let bytes: Vec<u8> = (0..1024).map(|i| i as u8).collect();
        let data = Chunk {
            capacity: 1 << 20,
            offset: 4096,
            len: 1024,
            data: Some(&bytes),
        };
        assert_eq!(Chunk::decode(&data.encode()), Ok(data.clone()));
        let zeros = Chunk { data: None, ..data };
        let bytes = zeros.encode();
        assert_eq!(bytes.len(), HEADER);
        assert_eq!(Chunk::decode(&bytes), Ok(zeros));
    }

    #[test]
    fn a_chunk_outside_its_disk_or_with_the_wrong_body_is_refused() {
        static ONES: [u8; 512] = [1; 512];
        static SHORT: [u8; 511] = [1; 511];
        let good = Chunk {
            capacity: 1 << 20,
            offset: 0,
            len: 512,
            data: Some(&ONES),
        };
        let with = |f: &dyn Fn(&mut Chunk<'static>)| {
            let mut c = good.clone();
            f(&mut c);
            Chunk::decode(&c.encode()).map(|c| (c.offset, c.len))
        };
        let range = |r: Result<(u64, u64), ChunkError>| matches!(r, Err(ChunkError::Range { .. }));
        assert!(range(with(&|c| c.offset = 100)));
        assert!(range(with(&|c| c.offset = (1 << 20) - 256)));
        assert!(range(with(&|c| c.offset = u64::MAX - 511)));
        assert!(range(with(&|c| {
            c.len = 0;
            c.data = Some(&[]);
        })));
        assert!(range(with(&|c| {
            c.capacity = 1 << 30;
            c.len = 2 << 20;
            c.data = None;
        })));
        assert_eq!(
            with(&|c| c.data = Some(&SHORT)),
            Err(ChunkError::Length { len: 512, got: 511 })
        );
        let mut bytes = good.encode();
        bytes[20] = 7;
        assert_eq!(Chunk::decode(&bytes), Err(ChunkError::Kind(7)));
        assert_eq!(Chunk::decode(&bytes[..10]), Err(ChunkError::Short(10)));
        let mut zeros_with_body = good.encode();
        zeros_with_body[20] = 1;
        assert!(matches!(
            Chunk::decode(&zeros_with_body),
            Err(ChunkError::Length { .. })
        ));
    }
}
