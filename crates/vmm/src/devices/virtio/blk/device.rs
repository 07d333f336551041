//! The block device model: the image (open now, or attached later), what the driver reads in
//! config space, and the queue's buffers handed to `serve.rs`. Its migrated state is in
//! `state.rs`, the host's calls through the transport in `host.rs`.

#![forbid(unsafe_code)]

use std::sync::Arc;

use ferry_guest_abi::virtio::blk::CONFIG_SIZE;
use virtio_queue::Queue;

use super::dirty::WriteLog;
use super::error::BlockError;
use super::image::Image;
use super::options::DiskOptions;
use super::serve::Serve;
use super::spec::{BlkConfig, DEVICE_TYPE, DiskId, F_RO, NAME, OFFERED, QUEUE_SIZE};
use super::state::BlockState;
use super::stats::BlockStats;
use crate::devices::device::DeviceStateError;
use crate::devices::virtio::device::{
    Negotiated, VirtioDevice, VirtioError, drain, read_config_bytes,
};
use crate::memory::GuestRam;

/// A virtio-blk device over a raw image file.
#[derive(Debug)]
pub struct Block {
    options: DiskOptions,
    image: Option<Image>,
    /// The source's open image, passed in a local handover, which [`Block::attach`] takes
    /// over instead of opening the path.
    passed: Option<std::fs::File>,
    /// What the driver reads; `None` until the capacity is known (a deferred device before
    /// its state is restored or its image attached).
    config: Option<BlkConfig>,
    /// GET_ID's answer: the image's own, or the source's after a restore.
    id: Option<DiskId>,
    /// The driver's accepted features (set at DRIVER_OK or restore; 0 after a reset).
    features: u64,
    stats: BlockStats,
    /// Chunks written since the last take, while a copy tracks them, shared with the copy.
    writes: Arc<WriteLog>,
}

impl Block {
    /// A device over the image `options` names, opened now.
    pub fn open(options: &DiskOptions) -> Result<Block, BlockError> {
        let mut block = Block::deferred(options);
        block.attach()?;
        Ok(block)
    }

    /// A device whose image is opened later by [`Block::attach`]: on a migration's
    /// destination, after the source let go of it, so two hosts never write it at once. Its
    /// capacity is unknown until its state is restored or it is attached; a request before
    /// the attach is answered S_IOERR.
    pub fn deferred(options: &DiskOptions) -> Block {
        Block {
            options: options.clone(),
            image: None,
            passed: None,
            config: None,
            id: None,
            features: 0,
            stats: BlockStats::default(),
            writes: Arc::default(),
        }
    }

    /// Keeps `file`, the image a local handover's source passed, for [`Block::attach`] to
    /// take over instead of opening the path: the guest's disk is the file the source was
    /// using, whatever became of its path. Kept, not used: until the state is loaded the
    /// source may still write it, and runs on with it if the handover fails.
    pub fn pass_image(&mut self, file: std::fs::File) -> Result<(), BlockError> {
        if self.image.is_some() || self.passed.is_some() {
            return Err(BlockError::AlreadyAttached {
                path: self.options.path.clone(),
            });
        }
        self.passed = Some(file);
        Ok(())
    }

    /// Attaches the image: the one a local handover passed ([`Block::pass_image`]) if one
    /// was, else the file the path names, opened. A device restored from a source's state
    /// refuses an image whose size differs from the source's disk; a device never restored
    /// takes the image's size.
    pub fn attach(&mut self) -> Result<(), BlockError> {
        if self.image.is_some() {
            return Err(BlockError::AlreadyAttached {
                path: self.options.path.clone(),
            });
        }
        let image = match self.passed.take() {
            Some(file) => Image::take_over(file, &self.options)?,
            None => Image::open(&self.options)?,
        };
        if let Some(config) = self.config
            && config.capacity != image.sectors()
        {
            return Err(BlockError::SizeMismatch {
                path: self.options.path.clone(),
                image_sectors: image.sectors(),
                expected_sectors: config.capacity,
            });
        }
        if self.config.is_none() {
            self.config = Some(BlkConfig::new(image.sectors()));
            // Tracking started while the size was unknown covered nothing; nothing was
            // written since (every request failed), so a clean bitmap of the image is exact.
            if self.writes.is_marking() {
                self.start_tracking();
            }
        }
        self.id.get_or_insert(image.id());
        self.image = Some(image);
        Ok(())
    }

    /// Whether the image is open.
    pub fn is_attached(&self) -> bool {
        self.image.is_some()
    }

    pub fn options(&self) -> &DiskOptions {
        &self.options
    }

    /// The capacity the driver sees, in 512-byte sectors, once known.
    pub fn capacity(&self) -> Option<u64> {
        self.config.map(|c| c.capacity)
    }

    /// Makes every completed write durable (fdatasync). The VMM calls it after pausing the
    /// vCPUs and before saving the device's state, so the destination reads what the guest
    /// wrote. Does nothing without an image or on a read-only one.
    pub fn flush(&self) -> Result<(), BlockError> {
        match &self.image {
            Some(image) if !self.options.readonly => {
                image.flush().map_err(|source| BlockError::Flush {
                    path: self.options.path.clone(),
                    source,
                })
            }
            _ => Ok(()),
        }
    }

    pub fn stats(&self) -> BlockStats {
        self.stats
    }

    /// Starts recording which chunks of the image the guest writes, from a clean bitmap
    /// (see `dirty.rs`); costs nothing until called.
    pub fn start_tracking(&mut self) {
        let bytes = self.config.map_or(0, |c| c.capacity_bytes());
        self.writes.start(bytes);
    }

    /// Stops recording, and lets any writer the mirror holds go.
    pub fn stop_tracking(&mut self) {
        self.writes.stop();
    }

    /// The record of writes, which a copy takes from and a vCPU is held by without the
    /// transport's lock (`dirty.rs`).
    pub fn write_log(&self) -> Arc<WriteLog> {
        self.writes.clone()
    }

    /// A descriptor of the image of its own, for a copy that reads it while the guest runs,
    /// and the disk's size in bytes.
    pub fn image_for_copy(&self) -> Result<(std::fs::File, u64), BlockError> {
        let (Some(image), Some(config)) = (&self.image, self.config) else {
            return Err(BlockError::NotAttached {
                path: self.options.path.clone(),
            });
        };
        let file = image.try_clone().map_err(|source| BlockError::Open {
            path: self.options.path.clone(),
            readonly: true,
            source,
        })?;
        Ok((file, config.capacity_bytes()))
    }

    /// A `dup` of the open image (the same open file description), for a local handover to
    /// pass to the VMM that takes the guest over; `None` before the image is attached.
    pub fn image_descriptor(&self) -> Result<Option<std::os::fd::OwnedFd>, BlockError> {
        let Some(image) = &self.image else {
            return Ok(None);
        };
        image
            .descriptor()
            .map(Some)
            .map_err(|source| BlockError::Open {
                path: self.options.path.clone(),
                readonly: self.options.readonly,
                source,
            })
    }

    /// The device as one request sees it (`serve.rs`).
    fn serve(&mut self) -> Serve<'_> {
        Serve {
            image: self.image.as_mut(),
            config: self.config,
            read_only: self.options.readonly,
            features: self.features,
            id: self.id,
            writes: &self.writes,
            stats: &mut self.stats,
        }
    }

    pub(super) fn state(&self) -> BlockState {
        BlockState {
            config: self.config,
            read_only: self.options.readonly,
            id: self.id,
            stats: self.stats,
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn name(&self) -> &'static str {
        NAME
    }

    fn features(&self) -> u64 {
        match self.options.readonly {
            true => OFFERED | F_RO,
            false => OFFERED,
        }
    }

    fn max_queues(&self) -> usize {
        1
    }

    fn queue_count(&self, _features: u64) -> usize {
        1
    }

    fn queue_max_size(&self, _features: u64, index: usize) -> u16 {
        match index {
            0 => QUEUE_SIZE,
            _ => 0,
        }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config.map_or([0; CONFIG_SIZE as usize], |c| c.bytes());
        read_config_bytes(&c, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Every field is the device's (writeback is not offered): virtio 1.2 §5.2.4.
        tracing::debug!("{NAME}: driver write to its read-only config ignored");
    }

    fn activate(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        // The image, its capacity and id, and the counters are the host's; only the
        // negotiation goes.
        self.features = 0;
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        ram: &GuestRam,
    ) -> Result<bool, VirtioError> {
        if index != 0 {
            return Ok(false);
        }
        let features = self.features;
        let mem = ram.memory();
        let drained = drain(index, queue, mem, features, |chain| {
            self.serve().chain(&chain, mem)
        })?;
        self.stats.malformed += drained.malformed;
        Ok(drained.used)
    }

    fn save(&self) -> Vec<u8> {
        self.state().encode()
    }

    fn restore(
        &mut self,
        data: &[u8],
        negotiated: &Negotiated<'_>,
    ) -> Result<(), DeviceStateError> {
        let s = BlockState::decode(data, negotiated)?;
        s.fits(&self.options, self.image.as_ref().map(|i| i.sectors()))?;
        self.config = s.config;
        self.id = s.id;
        self.stats = s.stats;
        self.features = negotiated.features;
        Ok(())
    }
}
