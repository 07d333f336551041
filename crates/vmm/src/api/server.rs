//! The API server: one thread answering requests against a [`VmHandle`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use serde_json::json;
use tiny_http::{Header, Method, Request, Response, Server};

use crate::vm::{StopReason, VmHandle};

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
}

/// A running API server. Dropping it stops the thread and removes the socket file.
pub struct ApiServer {
    server: Arc<Server>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl ApiServer {
    /// Listens on `path` (replacing a stale socket file left by a dead process).
    pub fn start(path: &Path, vm: VmHandle) -> Result<ApiServer, ApiServerError> {
        if path.exists() {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ApiServerError::InUse { path: path.into() });
            }
            let _ = std::fs::remove_file(path);
        }
        let server = Server::http_unix(path).map_err(|e| ApiServerError::Listen {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let server = Arc::new(server);
        let listener = server.clone();
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                for request in listener.incoming_requests() {
                    answer(request, &vm);
                }
            })
            .map_err(|e| ApiServerError::Listen {
                path: path.into(),
                reason: e.to_string(),
            })?;
        Ok(ApiServer {
            server,
            thread: Some(thread),
            path: path.into(),
        })
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

/// The status code and JSON body for a request.
pub fn route(method: &Method, url: &str, vm: &VmHandle) -> (u16, serde_json::Value) {
    let path = url.split('?').next().unwrap_or(url).trim_end_matches('/');
    let control = |result: Result<(), crate::vm::ControlError>, state: &str| match result {
        Ok(()) => (200, json!({ "state": state })),
        Err(e) => (409, json!({ "error": e.to_string() })),
    };
    match (method, path) {
        (Method::Get, "/vm") => (200, serde_json::to_value(vm.status()).unwrap_or_default()),
        (Method::Put, "/vm/pause") => control(vm.pause(), "paused"),
        (Method::Put, "/vm/resume") => control(vm.resume(), "running"),
        (Method::Put, "/vm/shutdown") => {
            vm.stop(StopReason::Requested("API shutdown".into()));
            (200, json!({ "state": "stopped" }))
        }
        (_, "/vm" | "/vm/pause" | "/vm/resume" | "/vm/shutdown") => (
            405,
            json!({ "error": format!("{method} is not allowed on {path}; use GET /vm or PUT /vm/pause|resume|shutdown") }),
        ),
        _ => (
            404,
            json!({ "error": format!("no such endpoint {path}; the API has GET /vm and PUT /vm/pause, /vm/resume, /vm/shutdown") }),
        ),
    }
}

fn answer(request: Request, vm: &VmHandle) {
    let (code, body) = route(request.method(), request.url(), vm);
    let header = Header::from_bytes("Content-Type", "application/json").expect("static header");
    let response = Response::from_string(body.to_string())
        .with_status_code(code)
        .with_header(header);
    if let Err(e) = request.respond(response) {
        tracing::debug!("API client went away before the answer: {e}");
    }
}
