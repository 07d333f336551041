//! What a source migration is asked to do: [`SourceParams`] with its defaults and the check
//! that refuses what the protocol cannot carry, and the faults a test may inject
//! ([`TestHooks`]). Plain values, below the session and its senders.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use crate::control::{Settings, Tuning};
use crate::error::{ConfigError, MigrateError};
use crate::policy::Policy;
use crate::scan::{ZeroDetection, ZeroDetectorFactory};
use crate::wire;

/// How to migrate.
#[derive(Clone, Debug)]
pub struct SourceParams {
    pub policy: Policy,
    /// Bytes per second, `None` = unlimited.
    pub max_bandwidth: Option<u64>,
    /// Caps each vCPU's dirty rate at this many bytes per second from the start of precopy
    /// ([`SourceVm::set_dirty_limit`](crate::SourceVm::set_dirty_limit)); `None`: no cap
    /// (auto-converge may still set one, [`crate::ConvergeBy::DirtyLimit`]).
    pub dirty_limit: Option<u64>,
    pub uuid: [u8; 16],
    /// Data channels (QEMU: multifd-channels), 1..=[`wire::MAX_CHANNELS`].
    pub channels: u16,
    /// Pages per batch (QEMU: the multifd packet size / 4096), 1..=512.
    pub packet_pages: u32,
    /// How the senders find zero pages: the factory that builds each sending thread's
    /// [`ZeroDetector`](crate::scan::ZeroDetector). One of the engine's own is a
    /// [`ZeroDetection`] choice `.into()` this; a VMM may bring its own (`scan.rs` has the
    /// contract: a page reported zero arrives as zeros). Default: [`ZeroDetection::Inline`].
    pub zero: Arc<dyn ZeroDetectorFactory>,
    /// What kind of migration: precopy, precopy that may switch to postcopy (with
    /// postcopy's own settings), or a local handover. One value, so that a setting of one
    /// mode cannot be given to another.
    pub mode: Mode,
    /// Ask the VMM for free page hints (virtio-balloon) and skip the pages the guest reports
    /// free (see `source/hints.rs` for the rule). On by default: a VMM or guest that cannot
    /// hint simply sends every page.
    pub free_page_hints: bool,
    /// Checksum page data as well as everything else
    /// ([`Capabilities::CHECKSUM_PAGES`](wire::Capabilities::CHECKSUM_PAGES)): each sender
    /// copies a page before it checksums and sends it, and the destination checks it before
    /// the page counts as received. Device state, control records, headers and page addresses
    /// are always checksummed.
    pub checksum_pages: bool,
    /// Compress precopy's page data ([`Compression`](crate::Compression), `compress.rs`;
    /// [`Capabilities::COMPRESS`](wire::Capabilities::COMPRESS)). Off by default: on a link
    /// as fast as loopback it only costs CPU. With it on, the bandwidth limit (and the downtime
    /// estimate) count a page at what data pages lately cost on the wire
    /// (`compress::WireShare`), not at 4 KiB.
    pub compression: crate::Compression,
    /// Longest a write to the destination may block, on every connection: a destination that
    /// takes nothing for this long (stopped, overloaded, its host gone without a reset) fails
    /// the migration like a broken connection (before the handover the guest runs on here;
    /// in postcopy with recovery both sides pause). `None`: writes wait for ever.
    pub peer_timeout: Option<Duration>,
    /// With a Unix socket ([`Mode::Local`], or a copying migration over `unix:`): uids besides this process's own effective uid whose
    /// destination may take guest RAM. The destination's uid is read from the socket
    /// (`SO_PEERCRED`) before any descriptor is sent (`transport/peer.rs`); by default only a
    /// process of this VMM's own uid gets its guest's memory. The same holds for a migration
    /// that copies guest RAM over a Unix socket: the uid is read before the first page.
    pub allow_uids: Vec<u32>,
}

/// What kind of migration ([`SourceParams::mode`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Passes while the guest runs, then a pause for the rest and the device state.
    #[default]
    Precopy,
    /// Precopy that may switch to postcopy (QEMU's postcopy-ram capability): the destination
    /// must offer it, and the switch comes after [`Postcopy::after_passes`] passes, when
    /// [`Control::start_postcopy`](crate::Control::start_postcopy) asks, or when the policy
    /// says so ([`Postcopy::on_stall`], [`crate::TimeoutAction::Postcopy`]).
    Postcopy(Postcopy),
    /// Hand the guest over to a destination on this host instead of sending it
    /// ([`Capabilities::LOCAL`](wire::Capabilities::LOCAL)): guest RAM's descriptors go over
    /// the Unix socket, no page is sent and no dirty page tracked; only the device state
    /// follows, with the guest paused. The connection must be a Unix socket.
    Local,
}

/// Postcopy's settings ([`Mode::Postcopy`]); [`Postcopy::default`] is the engine's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Postcopy {
    /// Switch to postcopy after this many precopy passes (pass 1 counts); `None`: only when
    /// asked.
    pub after_passes: Option<u32>,
    /// Where the pages the destination asks for travel.
    pub preempt: Preempt,
    /// How long after the guest resumed on the destination only requested pages (with their
    /// readahead) go, before the background stream starts (see
    /// [`DEFAULT_POSTCOPY_QUIET_START`]); zero starts it at once.
    pub quiet_start: Duration,
    /// The order of the background push (`source/heat.rs`): by default the chunks the guest
    /// dirtied most recently and most often first, following a vCPU that faults in order.
    pub order: PostcopyOrder,
    /// The largest readahead window, in pages, that a vCPU faulting in order pulls forward
    /// after its page (the window starts at 16 and doubles per request in order); 0 sends
    /// only the pages asked for.
    pub prefetch_pages: u64,
    /// The bandwidth limit from the switch on, bytes per second (QEMU's
    /// max-postcopy-bandwidth): it paces the background push only, never the pages the
    /// destination asks for. `None`: [`SourceParams::max_bandwidth`] carries on.
    pub max_bandwidth: Option<u64>,
    /// Ask for recovery, so that a connection that breaks in postcopy pauses both sides until
    /// [`Control::resume_postcopy`](crate::Control::resume_postcopy) instead of failing. Off
    /// by default in the engine: ask for it only when both VMMs can be told to recover (the
    /// destination's needs [`crate::destination::IncomingControl::recover_on`]); a
    /// destination without a way to get a listener would wait paused until cancelled. The
    /// reference VMM asks for it.
    pub recover: bool,
    /// Switch to postcopy when precopy stalls (and the destination granted postcopy), before
    /// the policy's auto-converge throttles the guest.
    pub on_stall: bool,
    /// Let the prediction choose (`crate::predict`, `--postcopy-auto`): after each pass,
    /// switch to postcopy when it is the way with the least downtime among those within 1.1x
    /// of the fastest predicted; otherwise precopy goes on under the policy.
    pub auto: bool,
}

impl Default for Postcopy {
    fn default() -> Postcopy {
        Postcopy {
            after_passes: None,
            preempt: Preempt::Off,
            quiet_start: DEFAULT_POSTCOPY_QUIET_START,
            order: PostcopyOrder::default(),
            prefetch_pages: super::readahead::MAX_WINDOW,
            max_bandwidth: None,
            recover: false,
            on_stall: false,
            auto: false,
        }
    }
}

/// Where postcopy's requested pages travel ([`Postcopy::preempt`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preempt {
    /// On the main connection, which carries nothing else in postcopy.
    #[default]
    Off,
    /// On a connection of their own (QEMU's postcopy-preempt), never behind the background
    /// stream, its packets marked urgent (`Stream::set_urgent`) so that a link whose queue
    /// has priority bands sends them ahead of it.
    Urgent,
    /// On a connection of their own, its packets not marked.
    Unmarked,
}

impl Preempt {
    /// A preempt connection, its packets marked urgent, when `on` (a flag's value, as
    /// `--postcopy-preempt`); none otherwise.
    pub fn urgent_when(on: bool) -> Preempt {
        match on {
            true => Preempt::Urgent,
            false => Preempt::Off,
        }
    }

    /// Whether requested pages have a connection of their own.
    pub fn is_on(self) -> bool {
        self != Preempt::Off
    }
}

/// How the postcopy push orders the pages it sends ([`Postcopy::order`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PostcopyOrder {
    /// The hottest 2 MiB first, by the dirty syncs' history; a vCPU faulting in order is
    /// followed, a random fault does not move the push.
    #[default]
    Hot,
    /// Address order from the lowest, each request moving the push to just after it (the
    /// design before the heat, kept as the reference).
    Address,
}

/// Default [`SourceParams::peer_timeout`]: far above any one write of a live link (a 2 MiB
/// record at 1 MB/s takes 2 s), short enough that a stalled destination does not hold a
/// source for minutes. The source's waits for the destination's Resumed, and for its Done after postcopy's
/// last page, are as long.
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Default [`Postcopy::quiet_start`]: the bulk stream would share the machine's
/// cores with the guest's first faults. `ferry bench postcopy --pause-only` (8 GiB, 1 GiB
/// written flat out, postcopy after pass 1) put the guest-observed pause's medians at 3.1–3.9
/// ms without preempt and 3.9–4.6 ms with it with 10 ms, where the build before it had 8.9–13.9
/// and 6.7–8.4 ms. A recovery does not wait: its guest has run for a while.
pub const DEFAULT_POSTCOPY_QUIET_START: Duration = Duration::from_millis(10);

/// Default data channels: two streams already beat one on loopback, and each costs a thread on
/// both sides of a small machine.
pub const DEFAULT_CHANNELS: u16 = 2;
/// Default batch: 512 KiB (128 pages), QEMU's multifd packet size. 2 MiB batches (one `writev`
/// per 2 MiB) were measured with `ferry bench channels` ("4G random data", 1/2/4 channels, three
/// runs, loaded 2-core machine): the source's CPU fell only from a mean of 0.32 to 0.30 s/GiB
/// (within the noise), and against a slow destination an idle guest's pause grew to 85 ms
/// (the engine test `an_idle_guest_pauses_only_after_a_slow_destination_took_in_pass_1`
/// bounds it at 60 ms): a bigger batch is a bigger tail in the socket buffers at the pause.
pub const DEFAULT_PACKET_PAGES: u32 = 128;

impl SourceParams {
    pub fn new(policy: Policy, uuid: [u8; 16]) -> SourceParams {
        SourceParams {
            policy,
            max_bandwidth: None,
            dirty_limit: None,
            uuid,
            channels: DEFAULT_CHANNELS,
            packet_pages: DEFAULT_PACKET_PAGES,
            zero: ZeroDetection::default().into(),
            mode: Mode::Precopy,
            free_page_hints: true,
            checksum_pages: false,
            compression: crate::Compression::Off,
            peer_timeout: Some(DEFAULT_PEER_TIMEOUT),
            allow_uids: Vec::new(),
        }
    }

    /// Postcopy's settings, when this migration may switch to postcopy.
    pub fn postcopy(&self) -> Option<&Postcopy> {
        match &self.mode {
            Mode::Postcopy(p) => Some(p),
            _ => None,
        }
    }

    /// Whether this is a local handover.
    pub fn is_local(&self) -> bool {
        self.mode == Mode::Local
    }

    /// The settings a running migration can change, as a [`Tuning`] that sets them all.
    pub(super) fn settings_as_tuning(&self) -> Tuning {
        Tuning {
            downtime_limit: Some(self.policy.downtime_limit),
            max_bandwidth: Some(self.max_bandwidth),
            timeout: Some(self.policy.timeout),
            auto_converge: Some(self.policy.auto_converge),
        }
    }

    /// The settings in force, as progress shows them.
    pub(super) fn settings(&self) -> Settings {
        Settings {
            downtime_limit_ms: self.policy.downtime_limit.as_millis() as u64,
            max_bandwidth: self.max_bandwidth,
            timeout_ms: self.policy.timeout.map(|t| t.as_millis() as u64),
            max_throttle: self.policy.auto_converge.map(|a| a.max),
        }
    }

    /// Refuses channel counts and packet sizes the protocol cannot carry.
    pub fn check(&self) -> Result<(), MigrateError> {
        if self.channels == 0 || self.channels > wire::MAX_CHANNELS {
            return Err(ConfigError::Channels {
                asked: self.channels,
                max: wire::MAX_CHANNELS,
            }
            .into());
        }
        if let Some(asked) = self.dirty_limit
            && asked < crate::policy::DIRTY_LIMIT_FLOOR
        {
            return Err(ConfigError::DirtyLimitBelowFloor {
                asked,
                floor: crate::policy::DIRTY_LIMIT_FLOOR,
            }
            .into());
        }
        if self.peer_timeout == Some(Duration::ZERO) {
            return Err(ConfigError::ZeroPeerTimeout.into());
        }
        self.settings_as_tuning().check()?;
        // The policy's timeout action is the one way into postcopy outside `Mode::Postcopy`
        // (it is shared with precopy's actions); it needs the mode that has postcopy.
        if self.policy.timeout_action == crate::policy::TimeoutAction::Postcopy
            && self.postcopy().is_none()
        {
            return Err(ConfigError::TimeoutNeedsPostcopy.into());
        }
        if let Some(p) = self.postcopy() {
            if p.after_passes == Some(0) {
                return Err(ConfigError::PostcopyAfterZeroPasses.into());
            }
            if p.max_bandwidth == Some(0) {
                return Err(ConfigError::ZeroBandwidth.into());
            }
            if p.prefetch_pages > MAX_PREFETCH_PAGES {
                return Err(ConfigError::Prefetch {
                    pages: p.prefetch_pages,
                    max: MAX_PREFETCH_PAGES,
                }
                .into());
            }
        }
        if self.packet_pages == 0 || self.packet_pages > wire::MAX_PAGES_PER_RECORD {
            return Err(ConfigError::PacketSize {
                pages: self.packet_pages,
                max: wire::MAX_PAGES_PER_RECORD,
            }
            .into());
        }
        Ok(())
    }
}

/// The largest [`Postcopy::prefetch_pages`]: 16 MiB, the most a request brings
/// (`MAX_REQUEST_PAGES` in `postcopy.rs`); a window holds the faults behind it on their
/// connection for as long as it takes to send.
pub const MAX_PREFETCH_PAGES: u64 = 4096;

/// Faults a test injects into a migration; [`TestHooks::default`] injects none.
///
/// Why a separate value behind a hidden entry point ([`migrate_with_hooks`](super::migrate_with_hooks)) rather than a
/// cargo feature: cargo unifies features across a workspace build, so a `test-hooks` feature
/// enabled by the testkit's dev-dependency would be on in the VMM and CLI too whenever they are
/// built together with the tests, and every check would need running with and without it.
/// This way the hooks are always compiled (and linted), never part of [`SourceParams`], and
/// reachable only by naming the hidden function.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TestHooks {
    /// Make each sender's zero detector report every n-th batch as failed, unscanned, as an
    /// offload engine that fails does.
    pub zero_fail_every: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn impossible_parameters_are_configuration_errors_that_name_the_fix() {
        let ok = SourceParams::new(Policy::default(), [1; 16]);
        assert!(ok.check().is_ok());
        let table = [
            (
                SourceParams {
                    channels: 0,
                    ..ok.clone()
                },
                "use 1 to 64",
            ),
            (
                SourceParams {
                    channels: 65,
                    ..ok.clone()
                },
                "use 1 to 64",
            ),
            (
                SourceParams {
                    packet_pages: 0,
                    ..ok.clone()
                },
                "outside 1..=512",
            ),
            (
                SourceParams {
                    packet_pages: 513,
                    ..ok.clone()
                },
                "outside 1..=512",
            ),
            (
                SourceParams {
                    max_bandwidth: Some(0),
                    ..ok.clone()
                },
                "give a positive limit",
            ),
            // Issue 48: a manual dirty limit had no floor (0 alone was refused).
            (
                SourceParams {
                    dirty_limit: Some(crate::policy::DIRTY_LIMIT_FLOOR - 1),
                    ..ok.clone()
                },
                "give at least 1000000",
            ),
        ];
        for (p, fix) in table {
            let e = p.check().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Configuration, "{e}");
            assert!(e.to_string().contains(fix), "{e}");
        }
    }
}
