//! The block device driven through the transport's registers by the test driver, over a
//! temporary image file: config, reads and writes, flush, discard, write-zeroes, GET_ID,
//! cache=none and write tracking. Hostile drivers and migration have files of their own.

mod hostile;
mod migration;

use std::os::unix::fs::MetadataExt;

use ferry_guest_abi::virtio::blk::{
    S_IOERR, S_OK, S_UNSUPP, SEGMENT_F_UNMAP, T_DISCARD, T_FLUSH, T_GET_ID, T_IN, T_OUT,
    T_WRITE_ZEROES,
};
use tempfile::NamedTempFile;
use vmm_sys_util::seek_hole::SeekHole;

use super::*;
use crate::devices::virtio::device::VIRTIO_F_VERSION_1;
use crate::devices::virtio::testdriver::Driver;

const V1: u64 = VIRTIO_F_VERSION_1;
const ALL: u64 = V1 | F_SEG_MAX | F_BLK_SIZE | F_FLUSH | F_DISCARD | F_WRITE_ZEROES;
const Q: usize = 0;
/// The test image: 8 MiB.
const IMAGE: u64 = 8 << 20;
const SECTORS: u64 = IMAGE / 512;

fn image(bytes: u64) -> NamedTempFile {
    let f = NamedTempFile::new().unwrap();
    f.as_file().set_len(bytes).unwrap();
    f
}

fn options(f: &NamedTempFile) -> DiskOptions {
    DiskOptions {
        path: f.path().into(),
        readonly: false,
        cache: Cache::Writeback,
    }
}

fn running(opts: &DiskOptions) -> Driver<Block> {
    Driver::running(Block::open(opts).unwrap(), ALL)
}

/// The device's answer to one request.
#[derive(Debug)]
struct Reply {
    status: u8,
    /// The used entry's length.
    len: u32,
    /// The writable data buffers after the request, concatenated.
    data: Vec<u8>,
}

/// Sends one request: the header, `out` as readable data buffers, writable data buffers of
/// `ins` bytes each (pre-filled with 0xee), and a status byte; notifies and takes the answer.
fn request(d: &mut Driver<Block>, kind: u32, sector: u64, out: &[&[u8]], ins: &[u32]) -> Reply {
    let mut header = [0u8; 16];
    header[..4].copy_from_slice(&kind.to_le_bytes());
    header[8..].copy_from_slice(&sector.to_le_bytes());
    let mut bufs = vec![(d.buffer(&header), 16, false)];
    for o in out {
        bufs.push((d.buffer(o), o.len() as u32, false));
    }
    let mut writable = Vec::new();
    for &n in ins {
        let at = d.buffer(&vec![0xee; n as usize]);
        writable.push((at, n));
        bufs.push((at, n, true));
    }
    let status = d.buffer(&[0xff]);
    bufs.push((status, 1, true));
    let head = d.add(Q, &bufs);
    d.notify(Q);
    let used = d.used(Q);
    assert_eq!(used.len(), 1, "one answer");
    assert_eq!(used[0].0, u32::from(head));
    let mut data = Vec::new();
    for (at, n) in writable {
        let mut b = vec![0u8; n as usize];
        d.ram.read(at, &mut b).unwrap();
        data.extend(b);
    }
    let mut s = [0u8];
    d.ram.read(status, &mut s).unwrap();
    Reply {
        status: s[0],
        len: used[0].1,
        data,
    }
}

fn read(d: &mut Driver<Block>, sector: u64, len: u32) -> Reply {
    request(d, T_IN, sector, &[], &[len])
}

fn write(d: &mut Driver<Block>, sector: u64, data: &[u8]) -> u8 {
    request(d, T_OUT, sector, &[data], &[]).status
}

/// A discard or write-zeroes segment.
fn segment(sector: u64, sectors: u32, flags: u32) -> Vec<u8> {
    [
        sector.to_le_bytes().as_slice(),
        &sectors.to_le_bytes(),
        &flags.to_le_bytes(),
    ]
    .concat()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn file_bytes(f: &NamedTempFile, offset: u64, len: usize) -> Vec<u8> {
    std::fs::read(f.path()).unwrap()[offset as usize..offset as usize + len].to_vec()
}

fn blocks(f: &NamedTempFile) -> u64 {
    std::fs::metadata(f.path()).unwrap().blocks()
}

#[test]
fn config_shows_the_image_and_is_read_only_to_the_driver() {
    // A partial last sector is not visible.
    let f = image(IMAGE + 100);
    let mut d = running(&options(&f));
    assert_eq!(d.device_features() & !V1, ALL & !V1, "no RO");
    let capacity = u64::from(d.config32(0)) | u64::from(d.config32(4)) << 32;
    assert_eq!(capacity, SECTORS);
    assert_eq!(d.config32(20), 512, "blk_size");
    assert_eq!(d.config32(12), SEG_MAX);
    d.write_config32(0, 7);
    assert_eq!(
        d.config32(0),
        SECTORS as u32,
        "the driver cannot write config"
    );
    assert_eq!(d.queue_max(0), QUEUE_SIZE);
    assert_eq!(d.queue_max(1), 0);

    let ro = DiskOptions {
        readonly: true,
        ..options(&f)
    };
    let mut d = Driver::new(Block::open(&ro).unwrap());
    assert_eq!(d.device_features() & F_RO, F_RO);
}

#[test]
fn written_bytes_read_back_across_uneven_descriptors() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let data = pattern(3 * 512, 7);
    let r = request(&mut d, T_OUT, 5, &[&data[..700], &data[700..]], &[]);
    assert_eq!((r.status, r.len), (S_OK, 1));
    assert_eq!(
        file_bytes(&f, 5 * 512, data.len()),
        data,
        "on the host file"
    );
    let r = request(&mut d, T_IN, 5, &[], &[100, 3 * 512 - 100]);
    assert_eq!((r.status, r.len), (S_OK, 3 * 512 + 1));
    assert_eq!(r.data, data);
    // Larger than one bounce: 1 MiB + 4 KiB.
    let big = pattern((1 << 20) + 4096, 3);
    assert_eq!(write(&mut d, 2048, &big), S_OK);
    assert_eq!(read(&mut d, 2048, big.len() as u32).data, big);
    let s = d.t.device().stats();
    assert_eq!((s.reads, s.writes, s.errors), (2, 2, 0));
    assert_eq!(s.bytes_written, (data.len() + big.len()) as u64);
    assert_eq!(s.bytes_read, s.bytes_written);
}

#[test]
fn read_data_reaches_guest_memory_dirty_tracked() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    write(&mut d, 0, &pattern(4096, 1));
    d.ram.track_writes(true);
    let at = 0x80_0000;
    d.ram.write(at, &[0; 4096]).unwrap();
    d.ram.take_writes();
    let mut header = [0u8; 16];
    header[..4].copy_from_slice(&T_IN.to_le_bytes());
    let (h, status) = (d.buffer(&header), d.buffer(&[0xff]));
    d.add(Q, &[(h, 16, false), (at, 4096, true), (status, 1, true)]);
    d.notify(Q);
    assert_eq!(d.used(Q).len(), 1);
    let logs = d.ram.take_writes();
    let written: Vec<u64> = logs.iter().flat_map(|l| l.written()).collect();
    assert!(
        written.contains(&at),
        "the read's page is marked: {written:x?}"
    );
    let mut b = vec![0u8; 4096];
    d.ram.read(at, &mut b).unwrap();
    assert_eq!(b, pattern(4096, 1));
}

#[test]
fn requests_past_the_end_or_of_partial_sectors_are_io_errors() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    for (sector, len) in [
        (SECTORS - 1, 1024),
        (SECTORS, 512),
        (u64::MAX, 512),
        (u64::MAX / 512 + 1, 512),
        (0, 100),
    ] {
        let r = read(&mut d, sector, len);
        assert_eq!(
            (r.status, r.len),
            (S_IOERR, 1),
            "sector {sector}, {len} bytes"
        );
        assert!(r.data.iter().all(|&b| b == 0xee), "nothing written");
    }
    assert_eq!(write(&mut d, SECTORS - 1, &[1; 1024]), S_IOERR);
    assert_eq!(write(&mut d, 0, &[1; 513]), S_IOERR);
    assert_eq!(
        read(&mut d, SECTORS - 1, 512).status,
        S_OK,
        "the last sector"
    );
    assert!(file_bytes(&f, 0, 1024).iter().all(|&b| b == 0));
    assert_eq!(d.t.device().stats().errors, 7);
}

#[test]
fn a_read_only_disk_refuses_every_write() {
    let f = image(IMAGE);
    std::fs::write(f.path(), pattern(IMAGE as usize, 9)).unwrap();
    let ro = DiskOptions {
        readonly: true,
        ..options(&f)
    };
    let mut d = Driver::running(Block::open(&ro).unwrap(), ALL | F_RO);
    assert_eq!(write(&mut d, 0, &[0; 512]), S_IOERR);
    let z = segment(0, 8, 0);
    assert_eq!(request(&mut d, T_DISCARD, 0, &[&z], &[]).status, S_IOERR);
    assert_eq!(
        request(&mut d, T_WRITE_ZEROES, 0, &[&z], &[]).status,
        S_IOERR
    );
    assert_eq!(request(&mut d, T_FLUSH, 0, &[], &[]).status, S_OK);
    assert_eq!(read(&mut d, 0, 4096).data, pattern(4096, 9));
    assert_eq!(file_bytes(&f, 0, 4096), pattern(4096, 9), "unchanged");
    d.t.device().flush().unwrap();
}

#[test]
fn flush_syncs_and_is_counted() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    write(&mut d, 0, &[3; 512]);
    let r = request(&mut d, T_FLUSH, 0, &[], &[]);
    assert_eq!((r.status, r.len), (S_OK, 1));
    assert_eq!(d.t.device().stats().flushes, 1);
    d.t.device().flush().unwrap();
}

#[test]
fn discard_punches_a_hole_that_reads_zeros() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    assert_eq!(write(&mut d, 0, &pattern(1 << 20, 5)), S_OK);
    d.t.device().flush().unwrap();
    let before = blocks(&f);
    assert!(before >= 2048, "1 MiB allocated: {before} blocks");
    let r = request(&mut d, T_DISCARD, 0, &[&segment(0, 2048, 0)], &[]);
    assert_eq!((r.status, r.len), (S_OK, 1));
    assert!(blocks(&f) + 2048 <= before, "{before} -> {}", blocks(&f));
    let mut file = std::fs::File::open(f.path()).unwrap();
    assert_eq!(file.seek_hole(0).unwrap(), Some(0), "a hole at 0");
    assert!(read(&mut d, 0, 4096).data.iter().all(|&b| b == 0));
    assert_eq!(d.t.device().stats().discards, 1);

    // The spec's MUSTs: unmap on a discard and unknown flags are unsupported.
    for flags in [SEGMENT_F_UNMAP, 2] {
        let r = request(&mut d, T_DISCARD, 0, &[&segment(0, 8, flags)], &[]);
        assert_eq!(r.status, S_UNSUPP, "flags {flags}");
    }
    // Without the feature negotiated.
    let mut plain = Driver::running(Block::open(&options(&f)).unwrap(), V1);
    let r = request(&mut plain, T_DISCARD, 0, &[&segment(0, 8, 0)], &[]);
    assert_eq!(r.status, S_UNSUPP);
}

#[test]
fn write_zeroes_zeroes_with_or_without_unmap() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    write(&mut d, 0, &pattern(64 << 10, 2));
    d.t.device().flush().unwrap();
    let r = request(&mut d, T_WRITE_ZEROES, 0, &[&segment(1, 8, 0)], &[]);
    assert_eq!(r.status, S_OK);
    let back = read(&mut d, 0, 16 * 512).data;
    assert_eq!(&back[..512], &pattern(512, 2)[..], "sector 0 kept");
    assert!(
        back[512..9 * 512].iter().all(|&b| b == 0),
        "sectors 1 to 8 zeroed"
    );
    assert_eq!(&back[9 * 512..], &pattern(16 * 512, 2)[9 * 512..]);

    let r = request(
        &mut d,
        T_WRITE_ZEROES,
        0,
        &[&segment(32, 64, SEGMENT_F_UNMAP)],
        &[],
    );
    assert_eq!(r.status, S_OK);
    let mut file = std::fs::File::open(f.path()).unwrap();
    assert_eq!(
        file.seek_hole(32 * 512).unwrap(),
        Some(32 * 512),
        "unmapped"
    );
    assert!(read(&mut d, 32, 64 * 512).data.iter().all(|&b| b == 0));

    let two = [segment(0, 8, 0), segment(16, 8, 0)].concat();
    assert_eq!(
        request(&mut d, T_WRITE_ZEROES, 0, &[&two], &[]).status,
        S_IOERR,
        "one segment only"
    );
    let long = segment(0, super::spec::MAX_ZEROING_SECTORS + 1, 0);
    assert_eq!(
        request(&mut d, T_WRITE_ZEROES, 0, &[&long], &[]).status,
        S_IOERR
    );
    let past = segment(SECTORS - 4, 8, 0);
    assert_eq!(
        request(&mut d, T_WRITE_ZEROES, 0, &[&past], &[]).status,
        S_IOERR
    );
    assert_eq!(
        request(&mut d, T_WRITE_ZEROES, 0, &[&[0; 15]], &[]).status,
        S_IOERR
    );
}

#[test]
fn get_id_names_the_image() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    let r = request(&mut d, T_GET_ID, 0, &[], &[20]);
    assert_eq!((r.status, r.len), (S_OK, 21));
    assert_eq!(&r.data[..6], b"ferry-");
    let mut again = running(&options(&f));
    assert_eq!(
        request(&mut again, T_GET_ID, 0, &[], &[20]).data,
        r.data,
        "stable"
    );
    let g = image(IMAGE);
    let mut other = running(&options(&g));
    assert_ne!(request(&mut other, T_GET_ID, 0, &[], &[20]).data, r.data);
    let short = request(&mut d, T_GET_ID, 0, &[], &[8]);
    assert_eq!((short.status, &short.data[..]), (S_OK, &r.data[..8]));
}

#[test]
fn unknown_request_types_are_unsupported() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    for t in [2, 99, u32::MAX] {
        let r = request(&mut d, t, 0, &[], &[512]);
        assert_eq!((r.status, r.len), (S_UNSUPP, 1), "type {t}");
    }
    assert_eq!(d.t.device().stats().unsupported, 3);
}

#[test]
fn cache_none_moves_data_through_o_direct() {
    let f = image(IMAGE);
    let opts = DiskOptions {
        cache: Cache::None,
        ..options(&f)
    };
    let block = match Block::open(&opts) {
        Ok(b) => b,
        // A file system without O_DIRECT (tmpfs before Linux 6.6) is refused, with the fix.
        Err(e @ BlockError::DirectUnsupported { .. }) => {
            assert!(e.to_string().contains("cache=writeback"), "{e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let mut d = Driver::running(block, ALL);
    let data = pattern(5 * 512, 4);
    // Guest buffers at odd addresses: the bounce buffer carries the alignment.
    let r = request(&mut d, T_OUT, 3, &[&data[..13], &data[13..]], &[]);
    assert_eq!(r.status, S_OK);
    assert_eq!(
        request(&mut d, T_IN, 3, &[], &[511, 5 * 512 - 511]).data,
        data
    );
    assert_eq!(file_bytes(&f, 3 * 512, data.len()), data);
    assert_eq!(request(&mut d, T_FLUSH, 0, &[], &[]).status, S_OK);
}

#[test]
fn opening_a_missing_image_names_it_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nothing.raw");
    let opts: DiskOptions = path.display().to_string().parse().unwrap();
    let e = Block::open(&opts).unwrap_err().to_string();
    assert!(
        e.contains(&path.display().to_string()) && e.contains("truncate -s"),
        "{e}"
    );
    let e = Block::open(&DiskOptions {
        path: dir.path().into(),
        ..opts
    })
    .unwrap_err();
    assert!(matches!(e, BlockError::NotAFile { .. }), "{e}");
}

#[test]
fn tracking_marks_the_chunks_that_writes_touch() {
    let f = image(IMAGE);
    let mut d = running(&options(&f));
    write(&mut d, 0, &[1; 512]);
    assert!(d.t.device().write_log().take().is_empty(), "not tracking");
    d.t.device_mut().start_tracking();
    let per_chunk = DIRTY_CHUNK / 512;
    write(&mut d, 0, &[1; 512]);
    write(&mut d, 4 * per_chunk - 1, &[1; 1024]);
    request(&mut d, T_DISCARD, 0, &[&segment(8 * per_chunk, 8, 0)], &[]);
    request(
        &mut d,
        T_WRITE_ZEROES,
        0,
        &[&segment(9 * per_chunk, 8, 0)],
        &[],
    );
    read(&mut d, 20 * per_chunk, 512);
    assert_eq!(write(&mut d, SECTORS, &[1; 512]), S_IOERR);
    assert_eq!(d.t.device().write_log().take(), [0, 3, 4, 8, 9]);
    assert!(d.t.device().write_log().take().is_empty(), "taken");
    d.t.device_mut().stop_tracking();
    write(&mut d, 0, &[1; 512]);
    assert!(d.t.device().write_log().take().is_empty());
}
