//! The block device's host side that must go through the transport: attaching the image
//! changes config space when the capacity was unknown, and the driver must hear of it.
//!
//! The VMM keeps an `Arc<Mutex<MmioTransport<Block>>>` beside the bus's handle on the same
//! transport; everything else it asks of the disk (flush, counters, write tracking) is a
//! method of [`Block`] reached through [`MmioTransport::device`] or `device_mut`.

#![forbid(unsafe_code)]

use super::device::Block;
use super::error::BlockError;
use crate::devices::virtio::mmio::MmioTransport;

impl MmioTransport<Block> {
    /// Opens a deferred device's image ([`Block::attach`]); if that made the capacity known,
    /// a new config generation and, once the driver runs, a config interrupt.
    pub fn attach(&mut self) -> Result<(), BlockError> {
        let before = self.device().capacity();
        self.device_mut().attach()?;
        if self.device().capacity() != before {
            self.config_changed();
        }
        Ok(())
    }
}
