//! A hop driven as a control plane drives one (libvirt, KubeVirt): through the API sockets
//! alone, `PUT /migration` on the source, then waiting on `GET /events` on both VMMs for the
//! source's end and the destination's completion, instead of polling `GET /migration`. The
//! soak's `--follow-events` runs its round trips so; each hop checks the completion's job
//! statistics and times how late each awaited event's answer came.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_vmm::api::client;
use ferry_vmm::request::MigrationRequest;
use serde_json::Value;

use super::process::{STEP_LIMIT, Vmm, verified_again};

/// Longest one `GET /events` waits: the step's deadline and the process's exit are looked at
/// between waits, and an answer comes as soon as an event is logged anyway.
const EVENT_WAIT: Duration = Duration::from_secs(1);

/// What a hop followed on the events showed.
#[derive(Debug)]
pub struct Followed {
    /// From the source's completion event.
    pub total_ms: f64,
    pub downtime_ms: f64,
    /// The guest's counters on the destination after a verify pass there.
    pub guest: Value,
    /// How late the answers carrying the source's end and the destination's completion came
    /// after those events were logged (host `CLOCK_MONOTONIC`), ms; only for an event logged
    /// while its watcher waited (the destination usually completes before the source's end
    /// is answered, and its event is then read at once, not awaited).
    pub event_lags_ms: Vec<f64>,
}

/// Where a watcher left off in a VMM process's event log. One per process for the whole
/// soak, as a control plane keeps one: the numbers run on across the process's VMs (a
/// `--then-incoming` VMM carries them on), so a watcher never reads the whole log again.
pub struct Watch {
    after: u64,
}

impl Watch {
    /// Watches `vmm`'s log from now on.
    pub fn start(vmm: &Vmm) -> anyhow::Result<Watch> {
        let now = vmm
            .get("/events?after=0&wait_ms=0")
            .with_context(|| format!("{} does not answer GET /events", vmm.name))?;
        Ok(Watch {
            after: now["last"].as_u64().unwrap_or(0),
        })
    }

    /// Waits on `vmm`'s events for one `done` holds for, within [`STEP_LIMIT`]; returns it and,
    /// if it was logged while this waited, how late its answer came, ms.
    fn until(
        &mut self,
        vmm: &mut Vmm,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<(Value, Option<f64>)> {
        let deadline = Instant::now() + STEP_LIMIT;
        loop {
            let path = format!(
                "/events?after={}&wait_ms={}",
                self.after,
                EVENT_WAIT.as_millis()
            );
            let asked = monotonic_ns();
            if let Some(got) = vmm.get(&path) {
                let at = monotonic_ns();
                if got["missed"] != 0 {
                    bail!("{} dropped events before {what} was seen: {got}", vmm.name);
                }
                self.after = got["last"].as_u64().unwrap_or(self.after);
                let events = got["events"].as_array().cloned().unwrap_or_default();
                if let Some(e) = events.into_iter().find(&done) {
                    let logged = e["host_ns"].as_u64().unwrap_or(0);
                    let lag = (logged >= asked).then(|| (at - logged.min(at)) as f64 / 1e6);
                    return Ok((e, lag));
                }
            }
            vmm.alive(what)?;
            if Instant::now() > deadline {
                bail!(
                    "{} logged no event for {what} within {STEP_LIMIT:?}:\n{}",
                    vmm.name,
                    vmm.log_text()
                );
            }
        }
    }
}

/// Migrates from `src` to `dst` with `request`, following both on their events; fails unless
/// the migration completed, its job statistics agree with its figures, and the guest verifies
/// clean on `dst`.
/// `ours` and `theirs` are the watchers of `src` and `dst`.
pub fn hop(
    (src, ours): (&mut Vmm, &mut Watch),
    (dst, theirs): (&mut Vmm, &mut Watch),
    request: &MigrationRequest,
) -> anyhow::Result<Followed> {
    let body = serde_json::to_string(request).context("encoding the migration request")?;
    client::request_with_body(&src.socket, "PUT", "/migration", &body)
        .context("could not start the migration")?;
    let (end, src_lag) = ours.until(src, "the migration's end", |e| {
        e["event"] == "source"
            && matches!(
                e["phase"].as_str(),
                Some("completed" | "failed" | "cancelled")
            )
    })?;
    if end["phase"] != "completed" {
        bail!("the migration ended {}: {}", end["phase"], end["error"]);
    }
    let (total_ms, downtime_ms) = (
        end["total_ms"].as_f64().unwrap_or(0.0),
        end["downtime_ms"].as_f64().unwrap_or(0.0),
    );
    let job = &end["job"];
    if job["downtime_ms"].as_u64() != Some(downtime_ms.round() as u64)
        || job["data_remaining_bytes"] != 0
        || job["data_processed_bytes"] != end["bytes_sent"]
    {
        bail!("the completion's job statistics disagree with its figures: {end}");
    }
    let (_, dst_lag) = theirs.until(dst, "the guest's arrival", |e| {
        e["event"] == "destination" && e["phase"] == "completed"
    })?;
    // Once the destination logged its completion its RAM is complete: `GET /vm` shows no
    // `ram_arriving`, and a migration away from it may start at once (before the VMM let go
    // of the hold, `VmHandle::ram_arriving`, it was refused for a moment). Checked here.
    let arrived = dst.wait_for("the guest running, its RAM complete", "/vm", |s| {
        s["state"] == "running" && s["ram_arriving"].is_null()
    })?;
    let guest = verified_again(dst, &arrived)?;
    Ok(Followed {
        total_ms,
        downtime_ms,
        guest,
        event_lags_ms: [src_lag, dst_lag].into_iter().flatten().collect(),
    })
}

/// Host `CLOCK_MONOTONIC` in ns, the clock events are stamped with.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}
