//! The API server: one thread answering requests against a [`VmHandle`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde_json::json;
use tiny_http::{Header, Method, Request, Response, Server};

use std::time::Duration;

use ferry_migrate::{AutoConverge, Tuning};

use crate::migration::{MigrationRequest, RecoveryError, StartError, TuneError};
use crate::vm::handle::VmHandle;
use crate::vm::state::StopReason;

#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    #[error(
        "API socket {path} is in use by a running process; choose another --api-socket path or stop that process"
    )]
    InUse { path: PathBuf },
    #[error(
        "cannot listen on API socket {path}: {reason}; check that its directory exists and is writable"
    )]
    Listen { path: PathBuf, reason: String },
    #[error(
        "--api-socket {path} exists and is not a socket; it was left as it is: give a path that does not exist yet (or a stale socket)"
    )]
    NotASocket { path: PathBuf },
}

/// The API socket's default mode: only the VMM's own user may connect (whoever can connect can
/// migrate the guest anywhere or stop it).
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

/// A running API server. Dropping it stops the thread and removes the socket file.
pub struct ApiServer {
    server: Arc<Server>,
    /// The VM it answers for; a VMM that receives its guest again after migrating it away
    /// points its one server at the new VM ([`ApiServer::serve`]).
    vm: Arc<Mutex<VmHandle>>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl ApiServer {
    /// Listens on `path` with [`DEFAULT_SOCKET_MODE`] (replacing a stale socket file left by
    /// a dead process).
    pub fn start(path: &Path, vm: VmHandle) -> Result<ApiServer, ApiServerError> {
        Self::start_with_mode(path, DEFAULT_SOCKET_MODE, vm)
    }

    /// Listens on `path`, a socket of permission bits `mode` whatever the process's umask: it
    /// is bound in a private directory beside `path`, given its mode there, and renamed into
    /// place, so it is never reachable with looser permissions. A path that exists and is not a
    /// socket is refused and left alone.
    pub fn start_with_mode(
        path: &Path,
        mode: u32,
        vm: VmHandle,
    ) -> Result<ApiServer, ApiServerError> {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let listen_error = |reason: String| ApiServerError::Listen {
            path: path.into(),
            reason,
        };
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(ApiServerError::NotASocket { path: path.into() });
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ApiServerError::InUse { path: path.into() });
            }
            let _ = std::fs::remove_file(path);
        }
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        // 0700 whatever the umask: nobody else reaches the socket before its mode is set.
        let private = tempfile::Builder::new()
            .prefix(".ferry-api-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(dir)
            .map_err(|e| listen_error(e.to_string()))?;
        let staged = private.path().join("api.sock");
        let server = Server::http_unix(&staged).map_err(|e| listen_error(e.to_string()))?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))
            .and_then(|()| std::fs::rename(&staged, path))
            .map_err(|e| listen_error(e.to_string()))?;
        let server = Arc::new(server);
        let listener = server.clone();
        let vm = Arc::new(Mutex::new(vm));
        let current = vm.clone();
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                for request in listener.incoming_requests() {
                    let vm = current.lock().unwrap().clone();
                    answer(request, &vm);
                }
            })
            .map_err(|e| ApiServerError::Listen {
                path: path.into(),
                reason: e.to_string(),
            })?;
        Ok(ApiServer {
            server,
            vm,
            thread: Some(thread),
            path: path.into(),
        })
    }
}

impl ApiServer {
    /// Answers for `vm` from the next request on; the VM answered for until now is no longer
    /// held here.
    pub fn serve(&self, vm: VmHandle) {
        *self.vm.lock().unwrap() = vm;
    }
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The body of `PATCH /migration`: new settings for the running migration, each field
/// optional; `null` lifts a bandwidth limit or a timeout.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuneBody {
    pub downtime_limit_ms: Option<u64>,
    /// Bytes per second; `null`: unlimited.
    #[serde(default, deserialize_with = "present")]
    pub max_bandwidth: Option<Option<u64>>,
    /// Counted from the migration's start; `null`: none.
    #[serde(default, deserialize_with = "present")]
    pub timeout_ms: Option<Option<u64>>,
    /// Throttle the guest when precopy stalls; `false` also lifts a throttle in force.
    pub auto_converge: Option<bool>,
    /// Auto-converge's highest throttle, percent (1 to 99); turns auto-converge on.
    pub max_throttle: Option<u8>,
}

/// A field that is present, `null` or not: `Some(None)` for `null` (absent is the field's
/// default, `None`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    <Option<T> as serde::Deserialize>::deserialize(d).map(Some)
}

impl TuneBody {
    pub fn tuning(&self) -> Result<Tuning, String> {
        let auto_converge = match (self.auto_converge, self.max_throttle) {
            (Some(false), Some(_)) => {
                return Err("max_throttle with auto_converge false: drop one of them".into());
            }
            (Some(false), None) => Some(None),
            (_, Some(max)) => Some(Some(AutoConverge::up_to(max))),
            (Some(true), None) => Some(Some(AutoConverge::default())),
            (None, None) => None,
        };
        let t = Tuning {
            downtime_limit: self.downtime_limit_ms.map(Duration::from_millis),
            max_bandwidth: self.max_bandwidth,
            timeout: self.timeout_ms.map(|t| t.map(Duration::from_millis)),
            auto_converge,
        };
        if t == Tuning::default() {
            return Err(format!("nothing to change; send any of {TUNE_FIELDS}"));
        }
        Ok(t)
    }
}

/// The fields `PATCH /migration` takes, for the errors that name them.
const TUNE_FIELDS: &str = "{\"downtime_limit_ms\": MS, \"max_bandwidth\": BYTES_PER_S|null, \"timeout_ms\": MS|null, \"auto_converge\": BOOL, \"max_throttle\": PERCENT}";

/// The status code and JSON body for a request.
pub fn route(method: &Method, url: &str, body: &str, vm: &VmHandle) -> (u16, serde_json::Value) {
    let path = url.split('?').next().unwrap_or(url).trim_end_matches('/');
    let control = |result: Result<(), crate::vm::handle::ControlError>, state: &str| match result {
        Ok(()) => (200, json!({ "state": state })),
        Err(e) => (409, json!({ "error": e.to_string() })),
    };
    match (method, path) {
        (Method::Get, "/vm") => (200, serde_json::to_value(vm.status()).unwrap_or_default()),
        (Method::Put, "/vm/pause") => control(vm.pause(), "paused"),
        (Method::Put, "/vm/resume") => {
            #[derive(serde::Deserialize, Default)]
            #[serde(deny_unknown_fields)]
            struct ResumeBody {
                #[serde(default)]
                force: bool,
            }
            let parsed: Result<ResumeBody, _> = match body.trim() {
                "" => Ok(ResumeBody::default()),
                b => serde_json::from_str(b),
            };
            match parsed {
                Err(e) => (
                    400,
                    json!({ "error": format!("PUT /vm/resume takes no body or {{\"force\": true}}: {e}") }),
                ),
                Ok(b) => match vm.resume_guest(b.force) {
                    Ok(()) => (200, json!({ "state": "running" })),
                    Err(e) => (409, json!({ "error": e.to_string() })),
                },
            }
        }
        (Method::Put, "/vm/announce") => {
            let parsed = match body.trim() {
                "" => Ok(crate::vm::Announce::default()),
                b => serde_json::from_str::<crate::vm::Announce>(b),
            };
            match parsed {
                Err(e) => (
                    400,
                    json!({ "error": format!("PUT /vm/announce takes no body or {{\"rounds\", \"initial_ms\", \"step_ms\"}}: {e}") }),
                ),
                Ok(plan) => match vm.announce(plan) {
                    Ok(()) => (200, json!({ "announced": plan })),
                    Err(e) => (409, json!({ "error": e })),
                },
            }
        }
        (Method::Put, "/vm/shutdown") => {
            vm.stop(StopReason::Requested("API shutdown".into()));
            (200, json!({ "state": "stopped" }))
        }
        (Method::Get, "/migration") => match (vm.migration(), vm.incoming()) {
            (Some(mut p), _) => {
                vm.note_read(&p);
                let disk = vm.disk_copy();
                if let (Some(job), Some(disk)) = (p.job.as_mut(), &disk) {
                    disk.fill_job(job);
                }
                let mut v = serde_json::to_value(p).unwrap_or_default();
                if let Some(at) = vm.then_incoming() {
                    v["then_incoming"] = json!(at);
                }
                if let Some(disk) = disk {
                    v["disk"] = serde_json::to_value(disk).unwrap_or_default();
                }
                (200, v)
            }
            (None, Some(p)) => {
                let mut v = serde_json::to_value(p).unwrap_or_default();
                v["role"] = json!("destination");
                if let Some(previous) = vm.previous_migration() {
                    v["previous"] = serde_json::to_value(previous).unwrap_or_default();
                }
                (200, v)
            }
            (None, None) => (
                404,
                json!({ "error": "no migration has been started on this VM; start one with PUT /migration or ferry migrate" }),
            ),
        },
        (Method::Put, "/migration") => {
            match serde_json::from_str::<MigrationRequest>(body) {
                Err(e) => (
                    400,
                    json!({ "error": format!("bad migration request: {e}; send {{\"to\": \"HOST:PORT\", \"downtime_limit_ms\": 300, ...}}") }),
                ),
                Ok(r) => match vm.start_migration(r) {
                    Ok(_) => (202, json!({ "phase": "setup" })),
                    Err(e @ StartError::Request(_)) => (400, json!({ "error": e.to_string() })),
                    // 503: nothing listens there yet (a destination starting up), try again.
                    Err(e @ StartError::Connect(_)) if e.not_listening() => {
                        (503, json!({ "error": e.to_string() }))
                    }
                    Err(e @ StartError::Connect(_)) => (502, json!({ "error": e.to_string() })),
                    Err(e) => (409, json!({ "error": e.to_string() })),
                },
            }
        }
        (Method::Put, "/snapshot") => {
            match serde_json::from_str::<crate::snapshot::SnapshotRequest>(body) {
                Err(e) => (
                    400,
                    json!({ "error": format!("bad snapshot request: {e}; send {{\"to\": \"/path/to/file\", \"stop\": false, ...}}") }),
                ),
                Ok(r) => match vm.start_snapshot(r) {
                    Ok(_) => (202, json!({ "phase": "setup" })),
                    Err(e @ StartError::Request(_)) => (400, json!({ "error": e.to_string() })),
                    Err(e) => (409, json!({ "error": e.to_string() })),
                },
            }
        }
        (Method::Patch, "/migration") => {
            let tuning = serde_json::from_str::<TuneBody>(body)
                .map_err(|e| format!("bad settings: {e}; send any of {TUNE_FIELDS}"))
                .and_then(|b| b.tuning());
            match tuning {
                Err(e) => (400, json!({ "error": e })),
                Ok(t) => match vm.tune_migration(t) {
                    Ok(()) => (
                        200,
                        json!({ "settings": "changing at the migration's next step; GET /migration shows them in force" }),
                    ),
                    Err(e @ TuneError::Refused(_)) => (400, json!({ "error": e.to_string() })),
                    Err(e) => (409, json!({ "error": e.to_string() })),
                },
            }
        }
        (Method::Put, "/migration/postcopy") => match vm.start_postcopy() {
            true => (200, json!({ "phase": "postcopy requested" })),
            false => (
                409,
                json!({ "error": "no migration is in precopy here; start one with postcopy enabled (ferry migrate --postcopy)" }),
            ),
        },
        (Method::Put, "/migration/pause") => match vm.pause_migration() {
            Ok(()) => (200, json!({ "phase": "postcopy_paused" })),
            Err(e) => (409, json!({ "error": e.to_string() })),
        },
        (Method::Put, "/migration/recover") => match address_in(body, "listen") {
            Ok(at) => recovery(
                vm.recover_migration(&at)
                    .map(|local| json!({ "phase": "postcopy_paused", "listening_on": local })),
            ),
            Err(bad) => bad,
        },
        (Method::Put, "/migration/resume") => match address_in(body, "to") {
            Ok(at) => recovery(
                vm.resume_migration(&at)
                    .map(|()| json!({ "phase": "recovering", "to": at })),
            ),
            Err(bad) => bad,
        },
        (Method::Get, "/balloon") => match vm.balloon() {
            Some(b) => (200, serde_json::to_value(b).unwrap_or_default()),
            None => (
                404,
                json!({ "error": "this VM has no balloon; start it without --balloon off" }),
            ),
        },
        (Method::Put, "/balloon") => {
            let target = serde_json::from_str::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("target_bytes").and_then(serde_json::Value::as_u64));
            match target {
                None => (
                    400,
                    json!({ "error": "bad balloon request; send {\"target_bytes\": BYTES}" }),
                ),
                Some(bytes) => match vm.set_balloon_target(bytes) {
                    Ok(b) => (200, serde_json::to_value(b).unwrap_or_default()),
                    Err(e) => (409, json!({ "error": e.to_string() })),
                },
            }
        }
        (Method::Put, "/migration/cancel") => match vm.cancel_migration() {
            true => (200, json!({ "phase": "cancelling" })),
            false => (
                409,
                json!({ "error": "no migration is in precopy or incoming; nothing to cancel (a switchover or postcopy cannot be cancelled: the guest may already run on the destination)" }),
            ),
        },
        (
            _,
            "/vm"
            | "/vm/pause"
            | "/vm/resume"
            | "/vm/shutdown"
            | "/migration"
            | "/migration/cancel"
            | "/migration/postcopy"
            | "/migration/pause"
            | "/migration/recover"
            | "/migration/resume"
            | "/snapshot"
            | "/balloon",
        ) => (
            405,
            json!({ "error": format!("{method} is not allowed on {path}; see {ENDPOINTS}") }),
        ),
        _ => (
            404,
            json!({ "error": format!("no such endpoint {path}; the API has {ENDPOINTS}") }),
        ),
    }
}

/// The one address a recovery body holds, `{"<field>": "tcp:HOST:PORT"}`; else a 400 answer.
fn address_in(body: &str, field: &str) -> Result<String, (u16, serde_json::Value)> {
    let value: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let only = value
        .as_object()
        .filter(|o| o.len() == 1)
        .and_then(|o| o.get(field))
        .and_then(serde_json::Value::as_str);
    only.map(str::to_string).ok_or_else(|| {
        (
            400,
            json!({ "error": format!("bad request: send {{\"{field}\": \"tcp:HOST:PORT\"}}") }),
        )
    })
}

/// A recovery step's answer: a bad address is the caller's (400), anything else a conflict.
fn recovery(result: Result<serde_json::Value, RecoveryError>) -> (u16, serde_json::Value) {
    match result {
        Ok(v) => (200, v),
        Err(e @ RecoveryError::Address(_)) => (400, json!({ "error": e.to_string() })),
        Err(e) => (409, json!({ "error": e.to_string() })),
    }
}

/// What the API serves, for the errors that name it.
const ENDPOINTS: &str = "GET /vm, PUT /vm/pause|resume|shutdown, GET|PUT|PATCH /migration, PUT /migration/cancel|postcopy|pause|recover|resume, PUT /snapshot, GET|PUT /balloon";

/// Longest request body read: a migration request is a few hundred bytes.
const MAX_BODY: u64 = 64 * 1024;

/// Longest a `GET /events` waits for an event before it answers with none.
const MAX_EVENTS_WAIT: Duration = Duration::from_secs(60);

/// `GET /events` requests that may wait at once in this process, each on a thread of its own:
/// a client of the socket cannot make the VMM hold more threads than this (a request past it
/// is answered 429 at once). A control plane needs one per VM.
const MAX_EVENT_WAITERS: usize = 32;

static EVENT_WAITERS: Slots = Slots::new(MAX_EVENT_WAITERS);

/// A count of things held at once, up to a bound.
struct Slots {
    used: AtomicUsize,
    max: usize,
}

/// One of [`Slots`], given back when dropped.
struct Slot<'a>(&'a Slots);

impl Slots {
    const fn new(max: usize) -> Slots {
        Slots {
            used: AtomicUsize::new(0),
            max,
        }
    }

    fn take(&self) -> Option<Slot<'_>> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(self))
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `GET /events?after=N&wait_ms=M`: the VM's migration events after number `N` (0: all it
/// keeps), waiting up to `M` ms (at most a minute; 0 by default) for one if there is none
/// yet. A wait runs on a thread of its own, so the API answers other requests meanwhile; at
/// most [`MAX_EVENT_WAITERS`] wait at once.
fn answer_events(request: Request, query: &str, vm: &VmHandle) {
    let mut after = 0;
    let mut wait = Duration::ZERO;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let parsed = match pair.split_once('=') {
            Some(("after", n)) => n.parse().map(|n| after = n).is_ok(),
            Some(("wait_ms", ms)) => ms
                .parse()
                .map(|ms| wait = Duration::from_millis(ms).min(MAX_EVENTS_WAIT))
                .is_ok(),
            _ => false,
        };
        if !parsed {
            let error = json!({ "error": format!("GET /events takes after=N (the last event number read) and wait_ms=MS, not {pair:?}") });
            return respond(request, 400, &error);
        }
    }
    let events = vm.events();
    let answer = move |request: Request, wait| {
        let found = events.since(after, wait);
        respond(
            request,
            200,
            &serde_json::to_value(found).unwrap_or_default(),
        );
    };
    if wait.is_zero() {
        return answer(request, wait);
    }
    let Some(slot) = EVENT_WAITERS.take() else {
        let error = json!({ "error": format!("{MAX_EVENT_WAITERS} GET /events requests already wait on this VMM; retry when one has been answered, or ask with wait_ms=0") });
        return respond(request, 429, &error);
    };
    let waiter = std::thread::Builder::new()
        .name("api-events".into())
        .spawn(move || {
            let _slot = slot;
            answer(request, wait);
        });
    if let Err(e) = waiter {
        tracing::warn!("cannot start a thread for GET /events: {e}");
    }
}

fn answer(mut request: Request, vm: &VmHandle) {
    if *request.method() == Method::Get
        && let Some(query) = request
            .url()
            .strip_prefix("/events")
            .and_then(|rest| rest.strip_prefix('?').or(rest.is_empty().then_some("")))
    {
        let query = query.to_string();
        return answer_events(request, &query, vm);
    }
    let mut body = String::new();
    let _ = std::io::Read::read_to_string(
        &mut std::io::Read::take(request.as_reader(), MAX_BODY),
        &mut body,
    );
    let (code, body) = route(request.method(), request.url(), &body, vm);
    respond(request, code, &body);
}

/// Sends `body` as JSON with status `code`.
fn respond(request: Request, code: u16, body: &serde_json::Value) {
    let header = Header::from_bytes("Content-Type", "application/json").expect("static header");
    // Always a Content-Length, never chunked: tiny_http chunks bodies over 32 KiB, which a
    // long migration's statistics exceed, and the CLI's client (like most one-shot clients)
    // reads a plain body.
    let response = Response::from_string(body.to_string())
        .with_status_code(code)
        .with_header(header)
        .with_chunked_threshold(usize::MAX);
    if let Err(e) = request.respond(response) {
        tracing::debug!("API client went away before the answer: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound on `GET /events` waiters: a slot past it is refused, and one given back is
    /// there to take again.
    #[test]
    fn no_more_waiters_than_the_bound_and_a_slot_given_back_is_free_again() {
        let slots = Slots::new(2);
        let (a, b) = (slots.take().unwrap(), slots.take().unwrap());
        assert!(slots.take().is_none(), "a third past a bound of 2");
        drop(a);
        let c = slots.take().expect("the slot given back");
        assert!(slots.take().is_none());
        drop((b, c));
        assert_eq!(slots.used.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_recovery_body_holds_exactly_its_one_address_field() {
        assert_eq!(
            address_in(r#"{"listen": "tcp:127.0.0.1:0"}"#, "listen"),
            Ok("tcp:127.0.0.1:0".to_string())
        );
        for bad in [
            r#"{"to": "tcp:127.0.0.1:1"}"#,
            r#"{"listen": "tcp:127.0.0.1:1", "extra": 1}"#,
            r#"{"listen": 4445}"#,
            "not json",
            "",
        ] {
            let (code, answer) = address_in(bad, "listen").unwrap_err();
            assert_eq!(code, 400, "{bad}");
            assert!(
                answer["error"].as_str().unwrap().contains("\"listen\""),
                "{bad}: {answer}"
            );
        }
    }

    #[test]
    fn a_tuning_body_tells_absent_from_null_and_refuses_what_cannot_apply() {
        let tuning = |body: &str| {
            serde_json::from_str::<TuneBody>(body)
                .map_err(|e| e.to_string())
                .and_then(|b| b.tuning())
        };
        let ms = Duration::from_millis;
        assert_eq!(
            tuning(r#"{"downtime_limit_ms": 500, "max_bandwidth": null}"#),
            Ok(Tuning {
                downtime_limit: Some(ms(500)),
                max_bandwidth: Some(None),
                ..Tuning::default()
            })
        );
        assert_eq!(
            tuning(r#"{"max_bandwidth": 1000000, "timeout_ms": 60000}"#),
            Ok(Tuning {
                max_bandwidth: Some(Some(1_000_000)),
                timeout: Some(Some(ms(60_000))),
                ..Tuning::default()
            })
        );
        assert_eq!(
            tuning(r#"{"auto_converge": false}"#).map(|t| t.auto_converge),
            Ok(Some(None))
        );
        assert_eq!(
            tuning(r#"{"max_throttle": 10}"#)
                .map(|t| t.auto_converge.flatten().map(|a| (a.initial, a.max))),
            Ok(Some((10, 10))),
            "a cap under the initial throttle starts there"
        );
        for bad in [
            "{}",
            r#"{"auto_converge": false, "max_throttle": 50}"#,
            r#"{"downtime": 5}"#,
            "not json",
        ] {
            assert!(tuning(bad).is_err(), "{bad}");
        }
    }
}
