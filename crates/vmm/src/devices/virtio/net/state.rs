//! The network device's own state, carried inside the transport's section: a plain value
//! ([`NetState`]) and its byte layout (version [`STATE_VERSION`]).
//!
//! Layout (little-endian): version 4; MAC 6; counters 8 × 8; pending frames 4 (at most
//! [`MAX_PENDING`]), then each frame's length 4 (1 to [`MAX_FRAME`]) and bytes.
//!
//! Not carried: the tap (the destination has its own, or the one a local handover passed).
//! The pending frames are the ones the source took from its tap at its save, for the
//! destination's guest (see the module doc of `net`). The queues, with the buffers the driver
//! gave and the device used, are the transport's.

#![forbid(unsafe_code)]

use super::options::Mac;
use super::spec::{MAX_FRAME, MAX_PENDING, NAME};
use crate::devices::device::DeviceStateError;
use crate::devices::virtio::codec::{Reader, Writer};

/// Version of the network device's state layout.
pub const STATE_VERSION: u32 = 1;

/// What the device counted; migrates with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetStats {
    /// Frames given to the guest, and their bytes (without the header).
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// Frames the guest sent that went out on the tap, and their bytes.
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// Frames from the tap dropped: longer than the device passes, or longer than the
    /// buffer the driver gave.
    pub rx_dropped: u64,
    /// Frames the guest sent that the tap refused (or that were longer than the device
    /// passes).
    pub tx_errors: u64,
    /// Chains refused as malformed (returned unused).
    pub malformed: u64,
    /// Rounds of announce frames sent for the guest's MAC.
    pub announces: u64,
}

/// Everything the network device migrates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetState {
    pub mac: Mac,
    pub stats: NetStats,
    /// Frames taken from the source's tap, oldest first, for the guest before any other.
    pub pending: Vec<Vec<u8>>,
}

impl NetState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(STATE_VERSION);
        for b in self.mac.0 {
            w.u8(b);
        }
        let s = &self.stats;
        for v in [
            s.rx_frames,
            s.rx_bytes,
            s.tx_frames,
            s.tx_bytes,
            s.rx_dropped,
            s.tx_errors,
            s.malformed,
            s.announces,
        ] {
            w.u64(v);
        }
        w.u32(self.pending.len() as u32);
        for f in &self.pending {
            w.blob(f);
        }
        w.into_bytes()
    }

    pub fn decode(data: &[u8]) -> Result<NetState, DeviceStateError> {
        let mut r = Reader::new(NAME, data);
        let version = r.u32("net state version")?;
        DeviceStateError::check_version(NAME, version, STATE_VERSION..=STATE_VERSION)?;
        let mut mac = [0u8; 6];
        for b in &mut mac {
            *b = r.u8("MAC")?;
        }
        if mac[0] & 1 != 0 {
            return Err(r.malformed(format!("MAC {} is a multicast address", Mac(mac))));
        }
        let stats = NetStats {
            rx_frames: r.u64("rx frames")?,
            rx_bytes: r.u64("rx bytes")?,
            tx_frames: r.u64("tx frames")?,
            tx_bytes: r.u64("tx bytes")?,
            rx_dropped: r.u64("rx dropped")?,
            tx_errors: r.u64("tx errors")?,
            malformed: r.u64("malformed")?,
            announces: r.u64("announces")?,
        };
        let count = r.u32("pending frames")? as usize;
        if count > MAX_PENDING {
            return Err(r.malformed(format!(
                "{count} pending frames, more than the {MAX_PENDING} a source carries"
            )));
        }
        let mut pending = Vec::with_capacity(count);
        for _ in 0..count {
            let f = r.blob("pending frame", MAX_FRAME)?;
            if f.is_empty() {
                return Err(r.malformed("an empty pending frame"));
            }
            pending.push(f.to_vec());
        }
        r.finish()?;
        Ok(NetState {
            mac: Mac(mac),
            stats,
            pending,
        })
    }
}
