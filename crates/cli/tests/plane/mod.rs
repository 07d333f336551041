//! A control plane's view of ferry, for `control_plane.rs`: it speaks only to the VMMs' API
//! sockets (JSON over HTTP on a Unix socket), never runs the `ferry` CLI, and follows a
//! migration by waiting on `GET /events`, as libvirt's and KubeVirt's drivers follow a job.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry_vmm::api::client::{self, ApiClientError};
use serde_json::{Value, json};

/// Host `CLOCK_MONOTONIC` in ns, the clock events are stamped with.
pub fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// One VMM as a control plane holds it: its socket and where it left off in its event log.
pub struct Plane {
    socket: PathBuf,
    after: u64,
    /// Every event read so far, with the host time its answer arrived (ns).
    pub seen: Vec<(Value, u64)>,
    /// How late each answer came after its event was logged, ms, for the events logged while
    /// the plane waited for them (an event logged between two requests is read, not awaited).
    pub lags_ms: Vec<f64>,
}

impl Plane {
    /// Watches the VMM on `socket` from now on: the events it logged before are skipped.
    pub fn watch(socket: &Path) -> Plane {
        let now = client::request(socket, "GET", "/events?after=0&wait_ms=0").expect("API");
        Plane {
            socket: socket.into(),
            after: now["last"].as_u64().unwrap(),
            seen: Vec::new(),
            lags_ms: Vec::new(),
        }
    }

    pub fn get(&self, path: &str) -> Value {
        client::request(&self.socket, "GET", path).expect("the API answers")
    }

    pub fn put(&self, path: &str, body: Value) -> Result<Value, ApiClientError> {
        client::request_with_body(&self.socket, "PUT", path, &body.to_string())
    }

    /// `PATCH /migration` with `body`: new settings for the running migration.
    pub fn tune(&self, body: Value) -> Result<Value, ApiClientError> {
        client::request_with_body(&self.socket, "PATCH", "/migration", &body.to_string())
    }

    /// `PUT /migration` with `body`, again while the destination is not listening yet (503).
    pub fn migrate(&self, body: Value) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.put("/migration", body.clone()) {
                Ok(_) => return,
                Err(ApiClientError::Status { status: 503, .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("PUT /migration {body}: {e}"),
            }
        }
    }

    /// The events logged since the last call, waiting up to `wait` for one.
    pub fn next(&mut self, wait: Duration) -> Vec<Value> {
        let asked = now_ns();
        let got = self.get(&format!(
            "/events?after={}&wait_ms={}",
            self.after,
            wait.as_millis()
        ));
        let at = now_ns();
        assert_eq!(got["missed"], 0, "the watcher fell behind: {got}");
        self.after = got["last"].as_u64().unwrap();
        let events = got["events"].as_array().unwrap().clone();
        self.seen.extend(events.iter().map(|e| (e.clone(), at)));
        self.lags_ms.extend(
            events
                .iter()
                .filter_map(|e| e["host_ns"].as_u64())
                .filter(|&logged| logged >= asked)
                .map(|logged| at.saturating_sub(logged) as f64 / 1e6),
        );
        events
    }

    /// Follows the events until `until` holds for one, within `timeout`; returns it.
    pub fn until(
        &mut self,
        what: &str,
        timeout: Duration,
        until: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(e) = self
                .next(Duration::from_millis(500))
                .into_iter()
                .find(&until)
            {
                return e;
            }
        }
        panic!(
            "no event for {what} within {timeout:?}; seen: {:?}",
            self.events()
        );
    }

    /// The source's end: `completed`, `failed` or `cancelled`.
    pub fn until_the_end(&mut self, timeout: Duration) -> Value {
        self.until("the source's end", timeout, is_source_end)
    }

    /// The events read so far.
    pub fn events(&self) -> Vec<&Value> {
        self.seen.iter().map(|(e, _)| e).collect()
    }

    /// The source phases entered, in order.
    pub fn phases(&self) -> Vec<String> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == "source")
            .map(|e| e["phase"].as_str().unwrap().to_string())
            .collect()
    }
}

pub fn is_source_end(e: &Value) -> bool {
    e["event"] == "source"
        && matches!(
            e["phase"].as_str(),
            Some("completed" | "failed" | "cancelled")
        )
}

pub fn is_phase(e: &Value, phase: &str) -> bool {
    e["event"] == "source" && e["phase"] == phase
}

/// A migration request to the destination at `tcp:127.0.0.1:PORT` with `more` fields over
/// it: auto-converge off, so that precopy's figures are the guest's own and the plane decides.
pub fn request(port: u16, more: Value) -> Value {
    let mut body = json!({"to": format!("tcp:127.0.0.1:{port}"), "auto_converge": false});
    for (k, v) in more.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// KubeVirt's rule for a migration that makes no progress (its progress timeout): progress is
/// the data remaining reaching a new low; a migration whose remaining data has not reached a
/// new low for `window` is stalled.
#[derive(Debug)]
pub struct Stall {
    window: Duration,
    low: Option<u64>,
    low_at: Instant,
}

impl Stall {
    pub fn new(window: Duration) -> Stall {
        Stall {
            window,
            low: None,
            low_at: Instant::now(),
        }
    }

    /// Notes `remaining` seen at `now`; whether the migration is stalled.
    pub fn observe(&mut self, remaining: u64, now: Instant) -> bool {
        if self.low.is_none_or(|low| remaining < low) {
            self.low = Some(remaining);
            self.low_at = now;
        }
        now.duration_since(self.low_at) >= self.window
    }
}

#[test]
fn a_stall_is_no_new_low_for_a_window() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut stall = Stall::new(s(3));
    assert!(!stall.observe(100, t0));
    assert!(!stall.observe(90, t0 + s(2)), "a new low is progress");
    assert!(
        !stall.observe(95, t0 + s(4)),
        "within the window of the low"
    );
    assert!(!stall.observe(90, t0 + s(4)), "the same low is no progress");
    assert!(stall.observe(120, t0 + s(5)), "no new low for 3 s");
    assert!(!stall.observe(10, t0 + s(6)), "progress again");
}
