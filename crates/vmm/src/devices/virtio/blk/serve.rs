//! Serving one request against the image, synchronously: checks first (type, feature, range,
//! length, read-only), then the I/O through the bounce buffer, then the status byte.
//!
//! Invariants: every byte of the image touched lies below the capacity the driver was given;
//! a chunk of the image is marked dirty once a write to it was attempted, whatever its result;
//! every chain taken is answered (status byte and used entry) or, with no status byte to
//! write, returned unused; nothing here panics on what a driver sent.

#![forbid(unsafe_code)]

use ferry_guest_abi::virtio::blk::{
    S_IOERR, S_OK, S_UNSUPP, SECTOR_SIZE, SEGMENT_F_UNMAP, SEGMENT_SIZE,
};
use vm_memory::{Bytes, GuestAddress};

use super::dirty::WriteLog;
use super::image::{CHUNK, Image};
use super::request::{Kind, Refusal, Request};
use super::spec::{BlkConfig, DiskId, F_DISCARD, F_WRITE_ZEROES, NAME};
use super::stats::BlockStats;
use crate::devices::virtio::chain::Chain;
use crate::devices::virtio::device::Disposition;
use crate::memory::TrackedMemory;

/// Why a request failed, for its status byte and the log.
#[derive(Debug)]
enum Fail {
    /// S_UNSUPP: a type or flag this device does not serve.
    Unsupported(String),
    /// S_IOERR for a request the driver should not have sent (debug log: a guest can send
    /// many).
    Guest(String),
    /// S_IOERR for the host's file failing (a warning naming the image and the errno).
    Host {
        what: &'static str,
        offset: u64,
        len: u64,
        source: std::io::Error,
    },
    /// S_IOERR: no image is attached yet (a warning: the VMM let the guest run too early).
    NotAttached,
}

/// The block device as one request sees it (built by the device for each buffer).
#[derive(Debug)]
pub(super) struct Serve<'a> {
    pub(super) image: Option<&'a mut Image>,
    /// `None` until the capacity is known (a deferred device before restore or attach).
    pub(super) config: Option<BlkConfig>,
    pub(super) read_only: bool,
    /// The features the driver accepted.
    pub(super) features: u64,
    pub(super) id: Option<DiskId>,
    pub(super) writes: &'a WriteLog,
    pub(super) stats: &'a mut BlockStats,
}

/// A DISCARD or WRITE_ZEROES range, checked.
#[derive(Clone, Copy, Debug)]
struct Zeroing {
    offset: u64,
    len: u64,
    unmap: bool,
}

impl Serve<'_> {
    /// Answers the request in `chain` and says what to return to the driver.
    pub(super) fn chain(&mut self, chain: &Chain, mem: &TrackedMemory) -> Disposition {
        let head = chain.head;
        let mut req = match Request::parse(chain, mem) {
            Ok(req) => req,
            Err(Refusal {
                status: Some(status),
                why,
            }) => {
                tracing::debug!("{NAME}: buffer {head} refused: {why}");
                self.stats.errors += 1;
                return self.answer(mem, head, status, S_IOERR, 0);
            }
            Err(Refusal { status: None, why }) => {
                tracing::warn!("{NAME}: buffer {head} returned unused: {why}");
                self.stats.malformed += 1;
                return Disposition::Return { head, len: 0 };
            }
        };
        let status = req.status;
        match self.serve(&mut req, mem) {
            Ok(written) => self.answer(mem, head, status, S_OK, written),
            Err(fail) => {
                let code = self.fail(&req, fail);
                self.answer(mem, head, status, code, 0)
            }
        }
    }

    /// Writes the status byte and returns the buffer with `written` data bytes and the status.
    fn answer(
        &self,
        mem: &TrackedMemory,
        head: u16,
        status: u64,
        code: u8,
        written: u64,
    ) -> Disposition {
        // Parsing checked the byte is guest RAM; a failure here would be a bug, not a guest's.
        if let Err(e) = mem.write_obj(code, GuestAddress(status)) {
            tracing::warn!("{NAME}: cannot write the status of buffer {head}: {e}");
            return Disposition::Return { head, len: 0 };
        }
        let len = u32::try_from(written + 1).unwrap_or(u32::MAX);
        Disposition::Return { head, len }
    }

    /// Logs and counts a failure; returns its status byte.
    fn fail(&mut self, req: &Request, fail: Fail) -> u8 {
        let path = self.image.as_ref().map(|i| i.path().display().to_string());
        let path = path.as_deref().unwrap_or("(none attached)");
        match fail {
            Fail::Unsupported(why) => {
                tracing::debug!("{NAME} {path}: {:?} unsupported: {why}", req.kind);
                self.stats.unsupported += 1;
                return S_UNSUPP;
            }
            Fail::Guest(why) => tracing::debug!("{NAME} {path}: {:?} refused: {why}", req.kind),
            Fail::Host {
                what,
                offset,
                len,
                source,
            } => tracing::warn!(
                "{NAME}: {what} of {len} bytes at byte {offset} of {path} failed: {source} (errno {}); the guest sees an I/O error",
                source.raw_os_error().unwrap_or(0)
            ),
            Fail::NotAttached => tracing::warn!(
                "{NAME}: a {:?} request before the image was attached; the VMM let the guest run too early, the guest sees an I/O error",
                req.kind
            ),
        }
        self.stats.errors += 1;
        S_IOERR
    }

    /// Serves `req`; returns the data bytes written into guest memory.
    fn serve(&mut self, req: &mut Request, mem: &TrackedMemory) -> Result<u64, Fail> {
        if let Kind::Unknown(t) = req.kind {
            return Err(Fail::Unsupported(format!("request type {t}")));
        }
        let feature = |f: u64, name: &str| match self.features & f {
            0 => Err(Fail::Unsupported(format!("{name} was not negotiated"))),
            _ => Ok(()),
        };
        match req.kind {
            Kind::Discard => feature(F_DISCARD, "VIRTIO_BLK_F_DISCARD")?,
            Kind::WriteZeroes => feature(F_WRITE_ZEROES, "VIRTIO_BLK_F_WRITE_ZEROES")?,
            _ => {}
        }
        let (Some(image), Some(config)) = (self.image.as_deref_mut(), self.config) else {
            return Err(Fail::NotAttached);
        };
        let writes = matches!(req.kind, Kind::Out | Kind::Discard | Kind::WriteZeroes);
        if writes && self.read_only {
            return Err(Fail::Guest("the disk is read-only".into()));
        }
        let within = |sector: u64, len: u64| range(&config, sector, len);
        match req.kind {
            Kind::In => {
                let len = req.data.len();
                let offset = within(req.sector, len)?;
                read(image, mem, req, offset)?;
                self.stats.reads += 1;
                self.stats.bytes_read += len;
                Ok(len)
            }
            Kind::Out => {
                let offset = within(req.sector, req.data.len())?;
                let done = write(image, mem, req, offset, self.writes);
                self.stats.bytes_written += done?;
                self.stats.writes += 1;
                Ok(0)
            }
            Kind::Flush => {
                // A read-only disk has nothing to flush. cache=none still needs it: O_DIRECT
                // writes may sit in the storage's volatile cache, and a file's newly
                // allocated blocks are not durable until its metadata is.
                if !self.read_only {
                    image.flush().map_err(|source| Fail::Host {
                        what: "fdatasync",
                        offset: 0,
                        len: 0,
                        source,
                    })?;
                }
                self.stats.flushes += 1;
                Ok(0)
            }
            Kind::GetId => {
                let id = self.id.unwrap_or_else(|| image.id());
                let n = req.data.len().min(id.len() as u64) as usize;
                req.data
                    .scatter(mem, &id[..n])
                    .map_err(|e| Fail::Guest(e.to_string()))?;
                Ok(n as u64)
            }
            Kind::Discard | Kind::WriteZeroes => {
                let ranges = zeroings(req, mem, &config)?;
                for z in &ranges {
                    let result = zero(image, req.kind, *z);
                    self.writes.mark(z.offset, z.len);
                    result?;
                }
                self.stats.discards += 1;
                Ok(0)
            }
            Kind::Unknown(t) => Err(Fail::Unsupported(format!("request type {t}"))),
        }
    }
}

/// The byte offset of `len` bytes at `sector`, if they are whole sectors below the capacity.
fn range(config: &BlkConfig, sector: u64, len: u64) -> Result<u64, Fail> {
    if !len.is_multiple_of(SECTOR_SIZE) {
        return Err(Fail::Guest(format!("{len} bytes are not whole sectors")));
    }
    let offset = sector.checked_mul(SECTOR_SIZE);
    let end = offset.and_then(|o| o.checked_add(len));
    match (offset, end) {
        (Some(offset), Some(end)) if end <= config.capacity_bytes() => Ok(offset),
        _ => Err(Fail::Guest(format!(
            "{len} bytes at sector {sector} end past the capacity of {} sectors",
            config.capacity
        ))),
    }
}

fn host(what: &'static str, offset: u64, len: u64) -> impl FnOnce(std::io::Error) -> Fail {
    move |source| Fail::Host {
        what,
        offset,
        len,
        source,
    }
}

/// IN: the image's bytes into the driver's buffers, a bounce at a time.
fn read(
    image: &mut Image,
    mem: &TrackedMemory,
    req: &mut Request,
    offset: u64,
) -> Result<(), Fail> {
    let mut at = offset;
    while req.data.len() > 0 {
        let n = req.data.len().min(CHUNK as u64);
        let buf = image.read(at, n as usize).map_err(host("read", at, n))?;
        req.data
            .scatter(mem, buf)
            .map_err(|e| Fail::Guest(e.to_string()))?;
        at += n;
    }
    Ok(())
}

/// OUT: the driver's buffers into the image, a bounce at a time; returns the bytes written.
fn write(
    image: &mut Image,
    mem: &TrackedMemory,
    req: &mut Request,
    offset: u64,
    writes: &WriteLog,
) -> Result<u64, Fail> {
    let mut at = offset;
    while req.data.len() > 0 {
        let n = req.data.len().min(CHUNK as u64);
        req.data
            .gather(mem, image.buffer(n as usize))
            .map_err(|e| Fail::Guest(e.to_string()))?;
        let result = image.write(at, n as usize);
        writes.mark(at, n);
        result.map_err(host("write", at, n))?;
        at += n;
    }
    Ok(at - offset)
}

/// The checked ranges of a DISCARD or WRITE_ZEROES request (virtio 1.2 §5.2.6.2): all are
/// checked before any is served, so a bad segment leaves the image as it was.
fn zeroings(
    req: &mut Request,
    mem: &TrackedMemory,
    config: &BlkConfig,
) -> Result<Vec<Zeroing>, Fail> {
    let (max_segments, max_sectors) = match req.kind {
        Kind::Discard => (config.max_discard_seg, config.max_discard_sectors),
        _ => (config.max_write_zeroes_seg, config.max_write_zeroes_sectors),
    };
    let bytes = req.data.len();
    let size = u64::from(SEGMENT_SIZE);
    if bytes == 0 || !bytes.is_multiple_of(size) || bytes / size > u64::from(max_segments) {
        return Err(Fail::Guest(format!(
            "{bytes} bytes of segments are not 1 to {max_segments} segments of {size}"
        )));
    }
    let mut raw = vec![0u8; bytes as usize];
    req.data
        .gather(mem, &mut raw)
        .map_err(|e| Fail::Guest(e.to_string()))?;
    let mut out = Vec::with_capacity(raw.len() / SEGMENT_SIZE as usize);
    for s in raw.chunks_exact(SEGMENT_SIZE as usize) {
        let sector = u64::from_le_bytes(s[..8].try_into().unwrap());
        let sectors = u32::from_le_bytes(s[8..12].try_into().unwrap());
        let flags = u32::from_le_bytes(s[12..16].try_into().unwrap());
        // The spec's MUSTs: unknown flags, and unmap on a discard, are unsupported.
        if flags & !SEGMENT_F_UNMAP != 0 {
            return Err(Fail::Unsupported(format!("segment flags {flags:#x}")));
        }
        let unmap = flags & SEGMENT_F_UNMAP != 0;
        if unmap && req.kind == Kind::Discard {
            return Err(Fail::Unsupported("the unmap flag on a discard".into()));
        }
        if sectors > max_sectors {
            return Err(Fail::Guest(format!(
                "{sectors} sectors, above the limit of {max_sectors}"
            )));
        }
        let len = u64::from(sectors) * SECTOR_SIZE;
        let offset = range(config, sector, len)?;
        out.push(Zeroing { offset, len, unmap });
    }
    Ok(out)
}

/// Serves one checked range: DISCARD punches a hole (a hint: a file system without holes
/// leaves the data, which the spec allows); WRITE_ZEROES with unmap punches one too (a hole
/// reads as zeros), else zeroes the range keeping it allocated.
fn zero(image: &mut Image, kind: Kind, z: Zeroing) -> Result<(), Fail> {
    if z.len == 0 {
        return Ok(());
    }
    let unsupported = |e: &std::io::Error| e.raw_os_error() == Some(libc::EOPNOTSUPP);
    let result = match (kind, z.unmap) {
        (Kind::Discard, _) => match image.punch(z.offset, z.len) {
            Err(e) if unsupported(&e) => Ok(()),
            r => r,
        },
        (_, true) => match image.punch(z.offset, z.len) {
            Err(e) if unsupported(&e) => image.zero(z.offset, z.len),
            r => r,
        },
        (_, false) => image.zero(z.offset, z.len),
    };
    result.map_err(host("hole punch or zeroing", z.offset, z.len))
}
