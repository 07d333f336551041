//! A block request read from a descriptor chain (virtio 1.2 §5.2.6): the 16-byte header at the
//! start of the device-readable bytes, the status byte at the end of the device-writable ones,
//! and the data between, wherever the driver's descriptors split them (any layout is allowed
//! since virtio 1.0, so the bytes are treated as two streams, not as descriptor roles).
//!
//! Invariants: a [`Request`] is built only when its status byte and every byte of its data
//! are guest RAM, so serving it touches nothing else; its data is read and written through
//! the dirty-tracked guest memory view only.

#![forbid(unsafe_code)]

use ferry_guest_abi::virtio::blk;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::devices::virtio::chain::{Chain, Desc};
use crate::memory::TrackedMemory;

/// A request's type (virtio 1.2 §5.2.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    Unknown(u32),
}

impl Kind {
    fn from_u32(t: u32) -> Kind {
        match t {
            blk::T_IN => Kind::In,
            blk::T_OUT => Kind::Out,
            blk::T_FLUSH => Kind::Flush,
            blk::T_GET_ID => Kind::GetId,
            blk::T_DISCARD => Kind::Discard,
            blk::T_WRITE_ZEROES => Kind::WriteZeroes,
            t => Kind::Unknown(t),
        }
    }

    /// Whether its data is the device-writable stream (else the readable one after the header).
    fn data_is_writable(self) -> bool {
        matches!(self, Kind::In | Kind::GetId)
    }
}

/// A stream of guest memory ranges, consumed from the front.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Sg {
    /// `(gpa, len)`, none empty.
    pieces: Vec<(u64, u64)>,
    len: u64,
}

impl Sg {
    /// Bytes `[skip, skip + take)` of the concatenation of `descs`.
    fn cut<'a>(descs: impl Iterator<Item = &'a Desc>, mut skip: u64, take: u64) -> Sg {
        let mut sg = Sg::default();
        for d in descs {
            let len = u64::from(d.len);
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = (len - skip).min(take - sg.len);
            if n > 0 {
                sg.pieces.push((d.addr + skip, n));
                sg.len += n;
            }
            skip = 0;
            if sg.len == take {
                break;
            }
        }
        sg
    }

    /// Bytes left.
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// Whether every byte is guest RAM.
    fn in_ram(&self, mem: &TrackedMemory) -> bool {
        self.pieces
            .iter()
            .all(|&(gpa, len)| mem.check_range(GuestAddress(gpa), len as usize))
    }

    /// Takes the next `n` bytes off the front, handing each piece to `f` with its place in a
    /// buffer of `n`.
    fn each(
        &mut self,
        n: usize,
        mut f: impl FnMut(u64, std::ops::Range<usize>) -> Result<(), vm_memory::GuestMemoryError>,
    ) -> Result<(), vm_memory::GuestMemoryError> {
        let mut at = 0;
        while at < n {
            let Some(piece) = self.pieces.first_mut() else {
                return Err(vm_memory::GuestMemoryError::PartialBuffer {
                    expected: n,
                    completed: at,
                });
            };
            let take = (piece.1 as usize).min(n - at);
            f(piece.0, at..at + take)?;
            at += take;
            self.len -= take as u64;
            piece.0 += take as u64;
            piece.1 -= take as u64;
            if piece.1 == 0 {
                self.pieces.remove(0);
            }
        }
        Ok(())
    }

    /// Fills `buf` from the next bytes of guest memory.
    pub(super) fn gather(
        &mut self,
        mem: &TrackedMemory,
        buf: &mut [u8],
    ) -> Result<(), vm_memory::GuestMemoryError> {
        self.each(buf.len(), |gpa, r| {
            mem.read_slice(&mut buf[r], GuestAddress(gpa))
        })
    }

    /// Writes `buf` into the next bytes of guest memory (dirty-tracked).
    pub(super) fn scatter(
        &mut self,
        mem: &TrackedMemory,
        buf: &[u8],
    ) -> Result<(), vm_memory::GuestMemoryError> {
        self.each(buf.len(), |gpa, r| {
            mem.write_slice(&buf[r], GuestAddress(gpa))
        })
    }
}

/// A request ready to serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Request {
    pub(super) kind: Kind,
    pub(super) sector: u64,
    /// IN and GET_ID: the writable bytes before the status byte; every other type: the
    /// readable bytes after the header.
    pub(super) data: Sg,
    /// Where the status byte goes.
    pub(super) status: u64,
}

/// Why a chain is no request: with a status byte the device can write, it is answered
/// S_IOERR; without one it is returned unused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) status: Option<u64>,
    pub(super) why: &'static str,
}

impl Request {
    /// Reads the request `chain` describes.
    pub(super) fn parse(chain: &Chain, mem: &TrackedMemory) -> Result<Request, Refusal> {
        // The status byte is the last byte of the last non-empty writable descriptor.
        let status = chain
            .writable()
            .filter(|d| d.len > 0)
            .last()
            .map(|d| d.addr + u64::from(d.len) - 1)
            .filter(|&gpa| mem.check_range(GuestAddress(gpa), 1));
        let refuse = |why| Refusal { status, why };
        let Some(status) = status else {
            return Err(refuse("no status byte in guest RAM"));
        };
        let readable = chain.readable_len();
        if readable < u64::from(blk::HEADER_SIZE) {
            return Err(refuse("the header is shorter than 16 readable bytes"));
        }
        let header = chain
            .read(mem, blk::HEADER_SIZE as usize)
            .ok_or(refuse("the header is not in guest RAM"))?;
        let kind = Kind::from_u32(u32::from_le_bytes(header[..4].try_into().unwrap()));
        let sector = u64::from_le_bytes(header[8..16].try_into().unwrap());
        let writable: u64 = chain.writable().map(|d| u64::from(d.len)).sum();
        let data = match kind.data_is_writable() {
            true => Sg::cut(chain.writable(), 0, writable - 1),
            false => Sg::cut(
                chain.readable(),
                u64::from(blk::HEADER_SIZE),
                readable - u64::from(blk::HEADER_SIZE),
            ),
        };
        if !data.in_ram(mem) {
            return Err(refuse("a data buffer is not in guest RAM"));
        }
        Ok(Request {
            kind,
            sector,
            data,
            status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(addr: u64, len: u32, writable: bool) -> Desc {
        Desc {
            addr,
            len,
            writable,
        }
    }

    #[test]
    fn streams_are_cut_across_descriptors() {
        let d = [
            desc(0x1000, 10, false),
            desc(0x2000, 0, false),
            desc(0x3000, 20, false),
        ];
        let sg = Sg::cut(d.iter(), 4, 20);
        assert_eq!(sg.pieces, [(0x1004, 6), (0x3000, 14)]);
        assert_eq!(sg.len(), 20);
        assert_eq!(Sg::cut(d.iter(), 30, 0).len(), 0);
    }

    #[test]
    fn gather_and_scatter_walk_the_pieces_in_order() {
        let ram = crate::memory::GuestRam::new(64 << 20).unwrap();
        let d = [desc(0x1000, 3, true), desc(0x2000, 5, true)];
        let mut sg = Sg::cut(d.iter(), 0, 8);
        sg.scatter(ram.memory(), &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        let mut b = [0u8; 5];
        ram.read(0x2000, &mut b).unwrap();
        assert_eq!(b, [4, 5, 6, 7, 8]);
        let mut sg = Sg::cut(d.iter(), 1, 6);
        let mut out = [0u8; 6];
        sg.gather(ram.memory(), &mut out).unwrap();
        assert_eq!(out, [2, 3, 4, 5, 6, 7]);
        assert!(
            sg.gather(ram.memory(), &mut [0u8; 1]).is_err(),
            "nothing left"
        );
    }
}
