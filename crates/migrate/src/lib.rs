//! ferry's live-migration engine. It knows nothing of KVM: a VMM implements
//! [`vm::SourceVm`] or [`vm::DestinationVm`] and hands the engine a byte stream
//! ([`transport::Stream`]: TCP, a Unix socket, or its own).
//!
//! - [`wire`]: protocol v5 (reading v4 too), pure encoding and validation (`docs/protocol.md`
//!   is normative).
//! - [`ram`]: guest RAM regions and the raw page operations (with [`zero`]'s SIMD and `uffd`,
//!   the engine's `unsafe`).
//! - [`bitmap`]: the dirty bitmap with its incremental count and bounded walk.
//! - [`policy`]: when to switch over, as a pure function.
//! - [`source`] and [`destination`]: the two sessions, each with its data channels' threads;
//!   [`scan`] and [`zero`]: zero-page detection, inline, offloaded, or the VMM's own
//!   ([`scan::ZeroDetectorFactory`] in [`SourceParams::zero`]).
//! - [`control`], [`stats`]: cancelling and observing a migration, and what it measured;
//!   [`destination::IncomingControl`] is the destination's counterpart; [`events`]: the log
//!   of both sides' events a watcher waits on; [`job`]: the figures named as libvirt's job
//!   statistics.
//! - [`transport`]: the streams and listeners a migration runs over, and the address parser.
//! - [`snapshot`]: snapshots to a file (`docs/snapshot.md`): its format, pure; the writer and
//!   the reader; a live save through a migration session; eager and lazy restores.
//! - `uffd` (internal): userfaultfd, the base of postcopy's destination fault path.

#![deny(unsafe_code)]

pub mod bitmap;
pub mod compress;
mod conn;
pub mod control;
pub mod destination;
pub mod error;
pub mod events;
pub mod job;
pub mod pagebits;
mod phase;
pub mod policy;
pub mod predict;
#[allow(unsafe_code)]
pub mod ram;
pub mod scan;
pub mod snapshot;
pub mod source;
pub mod stage_clock;
mod state_part;
#[allow(unsafe_code)] // one clock_gettime call
pub mod stats;
pub mod transport;
#[allow(unsafe_code)] // the userfaultfd syscall, its ioctls, and reads of its messages
pub(crate) mod uffd;
#[allow(unsafe_code)]
// declares the unsafe VM traits; implementing them is where the promise is made
pub mod vm;
pub mod wire;
#[allow(unsafe_code)] // target_feature functions and SIMD loads
pub mod zero;
#[allow(unsafe_code)] // mmap and munmap of the bitmaps' zeroed memory
pub mod zeroed;

pub use compress::Compression;
pub use control::{Control, Phase, Progress, Settings, Tuning};
pub use error::MigrateError;
pub use policy::{AutoConverge, ConvergeBy, Policy, TimeoutAction};
pub use source::SourceParams;
pub use stats::{MigrationStats, StatePart, VcpuDirty};
pub use vm::{DestinationVm, DeviceFd, FileRegion, PageLanding, Section, SourceVm, VmError};
