//! What a migration is asked to do: [`MigrationRequest`], the one type that `PUT /migration`
//! deserializes, `ferry migrate` serializes, and the demo, the benches and the tests build.
//! Each default is written once, in its `Default`, from the engine's own defaults; a new
//! option is a field here, its use in [`MigrationRequest::source_params`], and the CLI's flag.
//!
//! What a request gets wrong is a [`RequestError`] (a snapshot's request, `snapshot.rs`, shares
//! it, both refused the same way by `VmHandle`): the field and the figure for what only a
//! request can get wrong; the engine's or the TLS layer's own error, kept whole, for the rest.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use ferry_migrate::error::ConfigError;
use ferry_migrate::scan::ZeroDetection;
use ferry_migrate::source::{self, Mode, Postcopy, PostcopyOrder, Preempt, SourceParams};
use ferry_migrate::transport::Address;
use ferry_migrate::transport::tls::{SourceTls, TlsError, TlsFiles};
use ferry_migrate::{AutoConverge, ConvergeBy, MigrateError, Policy, TimeoutAction};
use serde::{Deserialize, Serialize};

/// Why a migration or snapshot request cannot be run; each names the field to fix.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("a migration request needs \"to\": the destination's tcp:HOST:PORT or unix:PATH")]
    NoDestination,
    #[error("packet_size {packet_size} must be a multiple of 4096 between 4K and 2M")]
    PacketSize { packet_size: u64 },
    #[error("peer_timeout_ms 0 would fail the first write that waits; give a positive timeout")]
    PeerTimeout,
    /// A setting the engine's request rules refuse (`local` without a Unix address, or with
    /// TLS), refused here before the engine is asked.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// What the engine's own check of the parameters refused (`SourceParams::check`).
    #[error(transparent)]
    Engine(#[from] MigrateError),
    /// The files of `tls` could not be loaded.
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(
        "disk_copy with a local handover: the destination takes the image's descriptor with RAM's, so no block is copied; leave disk_copy out"
    )]
    LocalDiskCopy,
    #[error("a snapshot request needs \"to\": the file to write, a path on the VMM's host")]
    NoSnapshotFile,
    #[error(
        "a snapshot's \"mode\" is permission bits in octal, such as \"0600\" or \"0640\", not {mode:?}"
    )]
    SnapshotMode { mode: String },
}

/// A migration request: the body of `PUT /migration`, every field but `to` optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationRequest {
    /// Where a `ferry run --incoming` destination waits: `tcp:HOST:PORT`, `unix:PATH`, or a
    /// bare `HOST:PORT` (TCP).
    pub to: String,
    /// The longest pause the switchover may cause at the measured bandwidth.
    pub downtime_limit_ms: u64,
    /// Bytes per second, an average; `None`: unlimited.
    pub max_bandwidth: Option<u64>,
    /// Give up converging this long after the start; `None`: never.
    pub timeout_ms: Option<u64>,
    /// What the timeout does.
    pub timeout_action: TimeoutAction,
    /// Throttle the guest when precopy stalls.
    pub auto_converge: bool,
    /// Auto-converge's highest throttle, percent (1 to 99).
    pub max_throttle: u8,
    /// How auto-converge slows the guest: `throttle` (every vCPU) or `dirty_limit` (only the
    /// vCPUs that dirty memory fast; needs the VM's dirty ring, else it throttles).
    pub auto_converge_by: ConvergeBy,
    /// Cap each vCPU's dirty rate at this many bytes per second for the whole migration
    /// (needs the VM's dirty ring, `ferry run --dirty-ring`); `None`: no cap.
    pub dirty_limit: Option<u64>,
    /// Data channels.
    pub channels: u16,
    /// Bytes per batch, a multiple of 4096 up to 2 MiB.
    pub packet_size: u64,
    /// Where zero pages are found.
    pub zero_detection: ZeroDetection,
    /// What kind of migration: `"precopy"`, `{"postcopy": {...}}` (precopy that may switch
    /// to postcopy, with its settings) or `"local"` (hand the guest over to a destination on
    /// this host, `to` a `unix:` address: guest RAM's memfd goes over the socket and only the
    /// device state is sent).
    pub mode: MigrationMode,
    /// Ask the guest's balloon for free page hints and skip the pages it reports free.
    pub free_page_hints: bool,
    /// Copy the VM's disk to the destination beside RAM (a disk no host shares); without it
    /// the destination opens the same image (shared storage).
    pub disk_copy: bool,
    /// What the checksums cover beyond state, control records and page addresses.
    pub checksum: Checksum,
    /// Compress precopy's pages: `off`, `zstd[:LEVEL]` or `auto[:LEVEL]` (compress only
    /// while the link is slower than what compression frees).
    pub compression: ferry_migrate::Compression,
    /// Run every connection over TLS with these files (paths on this host); `None`: plain.
    pub tls: Option<TlsRequest>,
    /// Longest a write to the destination may wait.
    pub peer_timeout_ms: u64,
    /// With a `unix:` destination: uids besides this VMM's own whose destination may take guest RAM
    /// (`ferry migrate --allow-uid`). The destination's uid is read from the socket before
    /// any descriptor is sent; by default only a process of this VMM's uid gets it.
    pub allow_uids: Vec<u32>,
    /// An in-process caller's loaded TLS configuration, used instead of `tls`' files.
    #[serde(skip)]
    pub tls_config: Option<Arc<SourceTls>>,
}

/// What kind of migration a request asks for: the engine's [`Mode`], with this VMM's
/// defaults and times in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum MigrationMode {
    #[default]
    Precopy,
    Postcopy(PostcopyRequest),
    Local,
}

/// Postcopy's settings in a request (`{"mode": {"postcopy": {...}}}`), each optional.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostcopyRequest {
    /// Switch after this many passes; `None`: only when asked (`PUT /migration/postcopy`), on
    /// a stall, or at the timeout.
    pub after_passes: Option<u32>,
    /// Where requested pages travel: `off` (the main connection), `urgent` (a preempt
    /// connection of their own, packets marked urgent) or `unmarked`.
    pub preempt: Preempt,
    /// How long after the guest resumed on the destination only the pages it asks for go,
    /// before the background stream starts.
    pub quiet_start_ms: u64,
    /// The background push's order, `hot` (the most recently and most often dirtied 2 MiB
    /// first) or `address`.
    pub order: PostcopyOrder,
    /// The largest readahead window a vCPU faulting in order pulls forward, in 4 KiB pages
    /// (0: only the pages asked for).
    pub prefetch_pages: u64,
    /// The bandwidth limit from the switch on, bytes per second (the background push only);
    /// `None`: `max_bandwidth` carries on.
    pub max_bandwidth: Option<u64>,
    /// Switch to postcopy when precopy stalls, before throttling.
    pub on_stall: bool,
    /// Let the prediction choose: after each pass, switch to postcopy when it pauses least
    /// among the ways within 1.1x of the fastest predicted.
    pub auto: bool,
    /// A connection that breaks in postcopy pauses both sides until a recovery instead of
    /// failing and losing the guest. On by default in this VMM, which can be told to recover
    /// on both sides.
    pub recover: bool,
}

impl Default for PostcopyRequest {
    fn default() -> PostcopyRequest {
        let engine = Postcopy::default();
        PostcopyRequest {
            after_passes: engine.after_passes,
            preempt: engine.preempt,
            quiet_start_ms: engine.quiet_start.as_millis() as u64,
            order: engine.order,
            prefetch_pages: engine.prefetch_pages,
            max_bandwidth: engine.max_bandwidth,
            on_stall: engine.on_stall,
            auto: engine.auto,
            recover: true,
        }
    }
}

impl MigrationMode {
    /// The engine's mode.
    pub fn engine(&self) -> Mode {
        match self {
            MigrationMode::Precopy => Mode::Precopy,
            MigrationMode::Local => Mode::Local,
            MigrationMode::Postcopy(p) => Mode::Postcopy(Postcopy {
                after_passes: p.after_passes,
                preempt: p.preempt,
                quiet_start: Duration::from_millis(p.quiet_start_ms),
                order: p.order,
                prefetch_pages: p.prefetch_pages,
                max_bandwidth: p.max_bandwidth,
                recover: p.recover,
                on_stall: p.on_stall,
                auto: p.auto,
            }),
        }
    }

    /// Postcopy's settings, when the request allows postcopy.
    pub fn postcopy(&self) -> Option<&PostcopyRequest> {
        match self {
            MigrationMode::Postcopy(p) => Some(p),
            _ => None,
        }
    }
}

/// What a migration's checksums cover: device state, control records, record headers and page
/// addresses always (`state`), page data too (`pages`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Checksum {
    #[default]
    State,
    Pages,
}

/// The source's TLS in a migration request: the CA, this side's certificate and key (PEM
/// files), and the name the destination's certificate must carry when it is not the host of
/// `to`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsRequest {
    pub ca: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    #[serde(default)]
    pub name: Option<String>,
}

impl Default for MigrationRequest {
    fn default() -> MigrationRequest {
        let engine = SourceParams::new(Policy::default(), [0; 16]);
        let policy = engine.policy;
        MigrationRequest {
            to: String::new(),
            downtime_limit_ms: policy.downtime_limit.as_millis() as u64,
            max_bandwidth: engine.max_bandwidth,
            timeout_ms: policy.timeout.map(|t| t.as_millis() as u64),
            timeout_action: policy.timeout_action,
            auto_converge: policy.auto_converge.is_some(),
            max_throttle: AutoConverge::default().max,
            auto_converge_by: policy.converge_by,
            dirty_limit: engine.dirty_limit,
            channels: engine.channels,
            packet_size: u64::from(engine.packet_pages) * ferry_migrate::wire::PAGE_SIZE,
            zero_detection: ZeroDetection::default(),
            mode: MigrationMode::Precopy,
            free_page_hints: engine.free_page_hints,
            disk_copy: false,
            checksum: Checksum::State,
            compression: engine.compression,
            tls: None,
            peer_timeout_ms: engine
                .peer_timeout
                .unwrap_or(source::DEFAULT_PEER_TIMEOUT)
                .as_millis() as u64,
            allow_uids: engine.allow_uids,
            tls_config: None,
        }
    }
}

impl MigrationRequest {
    /// A request to migrate to `to` with every default.
    pub fn to(to: impl Into<String>) -> MigrationRequest {
        MigrationRequest {
            to: to.into(),
            ..MigrationRequest::default()
        }
    }

    /// The engine's policy for this request.
    pub fn policy(&self) -> Policy {
        let auto_converge = self
            .auto_converge
            .then(|| AutoConverge::up_to(self.max_throttle));
        Policy {
            downtime_limit: Duration::from_millis(self.downtime_limit_ms),
            timeout: self.timeout_ms.map(Duration::from_millis),
            timeout_action: self.timeout_action,
            auto_converge,
            converge_by: self.auto_converge_by,
        }
    }

    /// The engine's parameters for this request, for migration `uuid`; what the engine
    /// cannot do is refused by it (`SourceParams::check`), what only this request can get
    /// wrong is refused here, with the field to fix.
    pub fn source_params(&self, uuid: [u8; 16]) -> Result<SourceParams, RequestError> {
        if self.to.is_empty() {
            return Err(RequestError::NoDestination);
        }
        let page = ferry_migrate::wire::PAGE_SIZE;
        let most = u64::from(ferry_migrate::wire::MAX_PAGES_PER_RECORD) * page;
        if self.packet_size == 0
            || !self.packet_size.is_multiple_of(page)
            || self.packet_size > most
        {
            return Err(RequestError::PacketSize {
                packet_size: self.packet_size,
            });
        }
        if self.peer_timeout_ms == 0 {
            return Err(RequestError::PeerTimeout);
        }
        if self.mode == MigrationMode::Local {
            let unix = matches!(self.to.parse::<Address>(), Ok(Address::Unix(_)));
            if !unix {
                let to = self.to.clone();
                return Err(ConfigError::LocalNeedsUnix { to }.into());
            }
            if self.tls.is_some() || self.tls_config.is_some() {
                return Err(ConfigError::LocalWithTls.into());
            }
            if self.disk_copy {
                return Err(RequestError::LocalDiskCopy);
            }
        }
        let params = SourceParams {
            mode: self.mode.engine(),
            allow_uids: self.allow_uids.clone(),
            max_bandwidth: self.max_bandwidth,
            dirty_limit: self.dirty_limit,
            channels: self.channels,
            packet_pages: (self.packet_size / page) as u32,
            zero: self.zero_detection.into(),
            free_page_hints: self.free_page_hints,
            checksum_pages: self.checksum == Checksum::Pages,
            compression: self.compression,
            peer_timeout: Some(Duration::from_millis(self.peer_timeout_ms)),
            ..SourceParams::new(self.policy(), uuid)
        };
        params.check()?;
        Ok(params)
    }

    /// The TLS to run every connection through: the in-process configuration, or one loaded
    /// from `tls`' files; `None` for plain connections.
    pub fn source_tls(&self) -> Result<Option<Arc<SourceTls>>, RequestError> {
        if let Some(tls) = &self.tls_config {
            return Ok(Some(tls.clone()));
        }
        let Some(t) = &self.tls else {
            return Ok(None);
        };
        let files = TlsFiles {
            ca: t.ca.clone(),
            cert: t.cert.clone(),
            key: t.key.clone(),
        };
        let tls = SourceTls::new(&files, t.name.as_deref())?;
        Ok(Some(Arc::new(tls)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_engines_and_a_body_needs_only_to() {
        let r: MigrationRequest = serde_json::from_str(r#"{"to": "tcp:127.0.0.1:4444"}"#).unwrap();
        let p = r.source_params([1; 16]).unwrap();
        let engine = SourceParams::new(Policy::default(), [1; 16]);
        assert_eq!(p.policy, engine.policy);
        assert_eq!(p.channels, engine.channels);
        assert_eq!(p.packet_pages, engine.packet_pages);
        assert_eq!(p.peer_timeout, engine.peer_timeout);
        assert_eq!(p.max_bandwidth, None);
        assert_eq!(p.mode, Mode::Precopy);
        // A postcopy with no settings has the engine's, but for recovery, which this VMM
        // can always be told to do.
        let r: MigrationRequest =
            serde_json::from_str(r#"{"to": "a:1", "mode": {"postcopy": {}}}"#).unwrap();
        assert_eq!(
            r.source_params([1; 16]).unwrap().mode,
            Mode::Postcopy(Postcopy {
                recover: true,
                ..Postcopy::default()
            })
        );
        // What the CLI serializes reads back the same.
        let back: MigrationRequest =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.source_params([1; 16]).unwrap().policy, p.policy);
    }

    /// `quiet_start_ms` was the option added after the request became one type, and
    /// `max_bandwidth` the first after the modes became types: each is the field here (and
    /// its line in `MigrationMode::engine`), the engine's field, and the CLI's flag
    /// (`--postcopy-quiet-start`, `--postcopy-max-bandwidth`).
    #[test]
    fn a_request_s_postcopy_quiet_start_reaches_the_engine() {
        let r: MigrationRequest = serde_json::from_str(
            r#"{"to": "a:1", "mode": {"postcopy": {"quiet_start_ms": 0, "preempt": "urgent", "max_bandwidth": 200000000}}}"#,
        )
        .unwrap();
        let p = r.source_params([1; 16]).unwrap();
        let postcopy = p.postcopy().unwrap();
        assert_eq!(postcopy.quiet_start, Duration::ZERO);
        assert_eq!(postcopy.preempt, Preempt::Urgent);
        assert_eq!(postcopy.max_bandwidth, Some(200_000_000));
    }

    /// A setting of one mode cannot be given to another: a postcopy setting outside
    /// `{"postcopy": {...}}` is an unknown field, and a typo inside it too.
    #[test]
    fn a_mode_s_settings_live_only_in_that_mode() {
        for body in [
            r#"{"to": "a:1", "postcopy_after_passes": 1}"#,
            r#"{"to": "a:1", "mode": "local", "after_passes": 1}"#,
            r#"{"to": "a:1", "mode": {"postcopy": {"after_pases": 1}}}"#,
            r#"{"to": "a:1", "mode": {"local": {}}}"#,
        ] {
            assert!(
                serde_json::from_str::<MigrationRequest>(body).is_err(),
                "{body} was taken"
            );
        }
        let on_stall: MigrationRequest =
            serde_json::from_str(r#"{"to": "a:1", "mode": {"postcopy": {"on_stall": true}}}"#)
                .unwrap();
        let params = on_stall.source_params([1; 16]).unwrap();
        assert!(params.postcopy().is_some_and(|p| p.on_stall));
    }

    #[test]
    fn a_request_s_allowed_uids_reach_the_engine_and_default_to_none() {
        let r: MigrationRequest =
            serde_json::from_str(r#"{"to": "unix:/run/x.sock", "mode": "local"}"#).unwrap();
        assert!(r.source_params([1; 16]).unwrap().allow_uids.is_empty());
        let r: MigrationRequest = serde_json::from_str(
            r#"{"to": "unix:/run/x.sock", "mode": "local", "allow_uids": [107, 65534]}"#,
        )
        .unwrap();
        assert_eq!(r.source_params([1; 16]).unwrap().allow_uids, [107, 65534]);
    }

    /// A refusal from a layer below keeps that layer's error, not its text.
    #[test]
    fn a_refusal_keeps_the_engine_s_or_the_tls_layer_s_own_error() {
        let r: MigrationRequest =
            serde_json::from_str(r#"{"to": "tcp:a:1", "mode": "local"}"#).unwrap();
        assert!(matches!(
            r.source_params([1; 16]),
            Err(RequestError::Config(ConfigError::LocalNeedsUnix { .. }))
        ));
        let r: MigrationRequest = serde_json::from_str(r#"{"to": "a:1", "channels": 0}"#).unwrap();
        assert!(matches!(
            r.source_params([1; 16]),
            Err(RequestError::Engine(MigrateError::Config(_)))
        ));
        let r: MigrationRequest = serde_json::from_str(
            r#"{"to": "a:1", "tls": {"ca": "/nonexistent/ca.pem", "cert": "c", "key": "k"}}"#,
        )
        .unwrap();
        let e = r.source_tls().unwrap_err();
        assert!(matches!(e, RequestError::Tls(TlsError::Read { .. })), "{e}");
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn a_request_refuses_what_it_alone_can_get_wrong_with_the_field() {
        for (body, want) in [
            (r#"{}"#, "needs \"to\""),
            (r#"{"to": "a:1", "packet_size": 1000}"#, "packet_size 1000"),
            (
                r#"{"to": "a:1", "peer_timeout_ms": 0}"#,
                "peer_timeout_ms 0",
            ),
            (
                r#"{"to": "tcp:a:1", "mode": "local"}"#,
                "tcp:a:1 is not one; give --to unix:PATH",
            ),
        ] {
            let r: MigrationRequest = serde_json::from_str(body).unwrap();
            let e = r.source_params([1; 16]).unwrap_err().to_string();
            assert!(e.contains(want), "{body}: {e}");
        }
        let typo = serde_json::from_str::<MigrationRequest>(r#"{"to": "a:1", "downtime": 5}"#);
        assert!(typo.unwrap_err().to_string().contains("downtime"));
        let action: MigrationRequest =
            serde_json::from_str(r#"{"to": "a:1", "timeout_action": "postcopy"}"#).unwrap();
        assert_eq!(action.timeout_action, TimeoutAction::Postcopy);
    }
}
