//! A fake device with large state that changes while the guest runs, as a disk's blocks do:
//! the engine's iterative device state ([`ferry_migrate::SourceVm::start_state_iteration`])
//! over the fake VMM. Its state is `blocks` blocks of [`BLOCK`] bytes; on a source, a writer
//! thread rewrites random blocks while the guest runs and marks them changed; a chunk is one
//! block, its index first. On a destination, chunks land block by block, and the device is
//! ready for the switchover once every block came at least once.
//!
//! Without an iteration under way (a destination that does not take chunks, or a file), a
//! disk of at most [`SECTIONS_AT_MOST`] goes in the pause as sections, one per block (its
//! instance the block's index); a larger one cannot, and the fake refuses, loudly, rather than
//! leave the disk behind.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ferry_migrate::wire::SectionId;
use ferry_migrate::{Section, VmError};

/// The fake disk's section id: far from the fake vCPUs' (1) and the ids the crafted streams
/// use as unknown ones.
pub const FAKE_DISK: SectionId = SectionId(0xd15c);
/// The layout version of its chunks.
pub const FAKE_DISK_VERSION: u32 = 1;
/// Bytes per block: a quarter of a chunk's most, so a chunk is one block and its index.
pub const BLOCK: usize = 256 << 10;
/// The largest disk that goes as sections in the pause: a quarter of the state a migration
/// carries ([`ferry_migrate::wire::MAX_STATE_BYTES`]).
pub const SECTIONS_AT_MOST: usize = 16 << 20;

/// The blocks, which changed since they were sent (source) or arrived (destination).
#[derive(Debug)]
pub struct FakeDisk {
    blocks: Vec<Mutex<Vec<u8>>>,
    /// Source: changed since last sent (or never sent). Destination: arrived at least once.
    marks: Vec<AtomicBool>,
    /// Source: an iteration is under way, so chunks carry the blocks.
    iterating: AtomicBool,
    /// Where the search for the next changed block starts.
    cursor: AtomicU64,
    /// Destination: not ready, whatever arrived, while a test holds it.
    held: AtomicBool,
    /// Source: what the engine last said the pause could carry (`state_allowance`); 0 before.
    allowance: AtomicU64,
}

impl FakeDisk {
    /// `bytes` of disk (whole blocks), each block filled from its index.
    pub fn new(bytes: u64) -> FakeDisk {
        let n = (bytes as usize).div_ceil(BLOCK);
        FakeDisk {
            blocks: (0..n)
                .map(|i| Mutex::new(vec![(i % 251) as u8; BLOCK]))
                .collect(),
            marks: (0..n).map(|_| AtomicBool::new(false)).collect(),
            iterating: AtomicBool::new(false),
            cursor: AtomicU64::new(0),
            held: AtomicBool::new(false),
            allowance: AtomicU64::new(0),
        }
    }

    /// Source: what the engine last said the pause could carry of the disk.
    pub fn allowance(&self) -> u64 {
        self.allowance.load(Ordering::Relaxed)
    }

    pub(crate) fn set_allowance(&self, bytes: u64) {
        self.allowance.store(bytes, Ordering::Relaxed);
    }

    /// Destination: holds the device not ready for the switchover, as a device still loading
    /// what came, until [`FakeDisk::release_ready`].
    pub fn hold_ready(&self) {
        self.held.store(true, Ordering::Release);
    }

    /// Destination: the device may be ready again.
    pub fn release_ready(&self) {
        self.held.store(false, Ordering::Release);
    }

    /// All of the disk, block after block.
    pub fn contents(&self) -> Vec<u8> {
        self.blocks
            .iter()
            .flat_map(|b| b.lock().unwrap().clone())
            .collect()
    }

    /// Rewrites 64 bytes of block `index` from `seed`, at a place `seed` picks, and marks the
    /// block changed (the writer holds the VM's gate meanwhile, so a pause waits for it).
    pub(crate) fn write(&self, index: usize, seed: u64) {
        let mut block = self.blocks[index].lock().unwrap();
        let at = (seed as usize >> 8) % (BLOCK - 64);
        for (k, b) in block[at..at + 64].iter_mut().enumerate() {
            *b = (seed >> (k % 56)) as u8 ^ k as u8;
        }
        self.marks[index].store(true, Ordering::Release);
    }

    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }

    fn pending(&self) -> u64 {
        self.marks
            .iter()
            .filter(|m| m.load(Ordering::Acquire))
            .count() as u64
            * BLOCK as u64
    }

    /// Source: every block is to send; returns how many bytes.
    pub(crate) fn start(&self) -> u64 {
        for m in &self.marks {
            m.store(true, Ordering::Release);
        }
        self.iterating.store(true, Ordering::Release);
        self.pending()
    }

    /// Source: the next changed block as a chunk, its mark cleared before it is copied (a
    /// write after the clear marks it again, so nothing is lost).
    pub(crate) fn next_chunk(&self, max_bytes: usize) -> Result<Option<Section>, VmError> {
        if !self.iterating.load(Ordering::Acquire) {
            return Err(VmError::failed(
                "next_state_chunk",
                "no iteration under way",
            ));
        }
        if max_bytes < 4 + BLOCK {
            return Err(VmError::failed(
                "next_state_chunk",
                "a chunk holds less than a block",
            ));
        }
        let n = self.blocks.len();
        let start = self.cursor.load(Ordering::Relaxed) as usize;
        for k in 0..n {
            let index = (start + k) % n;
            if self.marks[index].swap(false, Ordering::AcqRel) {
                self.cursor.store((index + 1) as u64, Ordering::Relaxed);
                let mut data = (index as u32).to_le_bytes().to_vec();
                data.extend_from_slice(&self.blocks[index].lock().unwrap());
                return Ok(Some(Section {
                    id: FAKE_DISK,
                    instance: 0,
                    version: FAKE_DISK_VERSION,
                    data,
                }));
            }
        }
        Ok(None)
    }

    pub(crate) fn pending_bytes(&self) -> Result<u64, VmError> {
        match self.iterating.load(Ordering::Acquire) {
            true => Ok(self.pending()),
            false => Err(VmError::failed(
                "pending_state_bytes",
                "no iteration under way",
            )),
        }
    }

    pub(crate) fn end(&self) {
        self.iterating.store(false, Ordering::Release);
    }

    /// Source: the disk's sections for a save in the pause: none while chunks carry it, a
    /// section per block if it is small enough, else a refusal.
    pub(crate) fn sections(&self) -> Result<Vec<Section>, VmError> {
        if self.iterating.load(Ordering::Acquire) {
            return Ok(Vec::new());
        }
        if self.blocks.len() * BLOCK > SECTIONS_AT_MOST {
            return Err(VmError::failed(
                "save_state",
                "the fake disk's blocks are too many for the pause and go only as iterative state, which this migration does not take",
            ));
        }
        Ok(self
            .blocks
            .iter()
            .enumerate()
            .map(|(index, block)| Section {
                id: FAKE_DISK,
                instance: index as u32,
                version: FAKE_DISK_VERSION,
                data: block.lock().unwrap().clone(),
            })
            .collect())
    }

    /// Destination: a block saved as a section in the pause.
    pub(crate) fn load_section(&self, s: &Section) -> Result<(), VmError> {
        let mut chunk = s.clone();
        chunk.instance = 0;
        chunk.data = s.instance.to_le_bytes().to_vec();
        chunk.data.extend_from_slice(&s.data);
        self.load(&chunk)
    }

    /// Destination: a chunk lands in its block, checked as a real device checks it.
    pub(crate) fn load(&self, chunk: &Section) -> Result<(), VmError> {
        let fail = |why: String| Err(VmError::failed("load_state_chunk", why));
        if chunk.id != FAKE_DISK || chunk.instance != 0 || chunk.version != FAKE_DISK_VERSION {
            return fail(format!(
                "{:?} instance {} version {}: the fake has one disk, version {FAKE_DISK_VERSION}",
                chunk.id, chunk.instance, chunk.version
            ));
        }
        if chunk.data.len() != 4 + BLOCK {
            return fail(format!(
                "a chunk of {} bytes is not one block",
                chunk.data.len()
            ));
        }
        let index = u32::from_le_bytes(chunk.data[..4].try_into().unwrap()) as usize;
        let Some(block) = self.blocks.get(index) else {
            return fail(format!("block {index} is past the disk's end"));
        };
        block.lock().unwrap().copy_from_slice(&chunk.data[4..]);
        self.marks[index].store(true, Ordering::Release);
        Ok(())
    }

    /// Destination: ready once every block arrived at least once, unless held.
    pub(crate) fn ready(&self) -> bool {
        !self.held.load(Ordering::Acquire) && self.marks.iter().all(|m| m.load(Ordering::Acquire))
    }
}
