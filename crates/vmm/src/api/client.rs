//! A minimal client for the control API (what `ferry status` and the tests use).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Longest a request may take: pausing waits for vCPUs to leave KVM_RUN, which takes
/// microseconds, so anything near this means the VMM is stuck.
const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ApiClientError {
    #[error("no ferry VM is listening on {path}: {source}; is `ferry run --api-socket {path}` running?", path = path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("API request to {path} failed: {source}", path = path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed API response: {0}")]
    Malformed(String),
    /// The VMM's refusal, in its own words (the HTTP status is for scripts).
    #[error("{message}")]
    Status { status: u16, message: String },
}

/// Sends `method path` and returns the JSON body of a 2xx answer.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
) -> Result<serde_json::Value, ApiClientError> {
    request_with_body(socket, method, path, "")
}

/// Sends `method path` with a JSON `body` and returns the JSON body of a 2xx answer.
pub fn request_with_body(
    socket: &Path,
    method: &str,
    path: &str,
    body: &str,
) -> Result<serde_json::Value, ApiClientError> {
    let mut stream = UnixStream::connect(socket).map_err(|source| ApiClientError::Connect {
        path: socket.into(),
        source,
    })?;
    let io = |source| ApiClientError::Io {
        path: socket.into(),
        source,
    };
    stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(io)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(io)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| ApiClientError::Malformed("no header/body separator".into()))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ApiClientError::Malformed(format!("bad status line in {head:?}")))?;
    let value: serde_json::Value = serde_json::from_str(body)
        .map_err(|e| ApiClientError::Malformed(format!("{e} in {body:?}")))?;
    if (200..300).contains(&status) {
        Ok(value)
    } else {
        let message = value["error"].as_str().unwrap_or(body).to_string();
        Err(ApiClientError::Status { status, message })
    }
}
