//! What virtio 1.2 §5.5 fixes for the balloon, and the plain values every part of the device
//! shares: feature bits, the queues and their numbering, the config space layout, when pages
//! may go back to the host, and the counters of what the balloon did.

#![forbid(unsafe_code)]

/// The balloon's virtio device id (virtio 1.2 §5).
pub const DEVICE_TYPE: u32 = 5;
/// Feature bits (virtio 1.2 §5.5.3).
pub const F_STATS_VQ: u64 = 1 << 1;
pub const F_FREE_PAGE_HINT: u64 = 1 << 3;
pub const F_PAGE_POISON: u64 = 1 << 4;
pub const F_REPORTING: u64 = 1 << 5;
pub(super) const OFFERED: u64 = F_STATS_VQ | F_FREE_PAGE_HINT | F_PAGE_POISON | F_REPORTING;
pub(super) const NAME: &str = "virtio-balloon";

/// Config space (virtio 1.2 §5.5.4): four le32 fields.
pub(super) const CFG_NUM_PAGES: usize = 0;
pub(super) const CFG_ACTUAL: usize = 4;
pub(super) const CFG_CMD_ID: usize = 8;
pub(super) const CFG_POISON: usize = 12;
pub(super) const CONFIG_SIZE: usize = 16;

/// A balloon queue's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vq {
    Inflate,
    Deflate,
    Stats,
    FreePage,
    Reporting,
}

/// Every queue in spec order, the feature it needs (0: always there) and its maximum size.
/// Sizes are QEMU's: 128 for inflate, deflate and stats (Linux keeps one buffer in each),
/// 1024 (`VIRTQUEUE_MAX_SIZE`) for free page hints (Linux queues one buffer per free 4 MiB
/// block while the queue has room), 32 for reporting (Linux's `PAGE_REPORTING_CAPACITY`).
pub(super) const QUEUES: [(Vq, u64, u16); 5] = [
    (Vq::Inflate, 0, 128),
    (Vq::Deflate, 0, 128),
    (Vq::Stats, F_STATS_VQ, 128),
    (Vq::FreePage, F_FREE_PAGE_HINT, 1024),
    (Vq::Reporting, F_REPORTING, 32),
];

pub(super) fn existing(features: u64) -> impl Iterator<Item = Vq> {
    QUEUES
        .into_iter()
        .filter(move |&(_, f, _)| f == 0 || features & f != 0)
        .map(|(vq, _, _)| vq)
}

/// The index of queue `vq` for a driver that negotiated `features`, if it exists.
pub fn queue_index(features: u64, vq: Vq) -> Option<usize> {
    existing(features).position(|v| v == vq)
}

/// Whether inflated and reported pages may be given back to the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Discard {
    #[default]
    Allowed,
    /// While a migration runs: a page punched on the source would not be punched on the
    /// destination, and the migration would have to learn of it.
    Forbidden,
}

/// What the balloon did, since it was created (they migrate).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BalloonCounters {
    /// Pages in guest RAM the driver put in the balloon.
    pub inflated_pages: u64,
    /// Pages in guest RAM the driver took out of the balloon.
    pub deflated_pages: u64,
    /// Pages given back to the host (inflated or reported).
    pub discarded_pages: u64,
    /// Inflate or deflate PFNs outside guest RAM.
    pub ignored_pfns: u64,
    /// Whole pages in guest RAM the driver reported free.
    pub reported_pages: u64,
    /// Buffers refused as malformed (returned unused).
    pub malformed_buffers: u64,
}
