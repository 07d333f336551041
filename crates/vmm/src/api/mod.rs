//! The control API: JSON over HTTP/1.1 on a Unix socket, as Firecracker and Cloud Hypervisor
//! serve theirs, so `curl --unix-socket PATH http://localhost/vm` works as well as the CLI.
//!
//! | method and path | answer |
//! | --- | --- |
//! | `GET /vm` | 200, a [`crate::VmStatus`]: state, memory, vCPUs, the guest's counters |
//! | `PUT /vm/pause` | 200 `{"state":"paused"}` once no vCPU runs; 409 if the VM stopped |
//! | `PUT /vm/resume` | 200 `{"state":"running"}`; 409 if the VM stopped |
//! | `PUT /vm/shutdown` | 200 `{"state":"stopped"}`; the VM stops and `ferry run` exits |
//! | `PUT /migration` | 202; body `{"to": "HOST:PORT", "downtime_limit_ms": 300, "max_bandwidth": BYTES_PER_S, "timeout_ms": MS, "timeout_action": "cancel"\|"switchover"\|"postcopy", "mode": "precopy"\|{"postcopy": {"after_passes": N, ...}}\|"local", "tls": {"ca": PATH, "cert": PATH, "key": PATH, "name": NAME}, ...}` (all but `to` optional; with `tls`, every connection runs mutual TLS with those PEM files of this host, 400 if they cannot be read; every field is [`crate::request::MigrationRequest`]'s); 503 if nothing listens at `to` yet (a destination starting up: try again), 502 if the destination cannot be reached otherwise, 409 if one runs |
//! | `PATCH /migration` | on a source whose migration runs, new settings at its next step, body any of `{"downtime_limit_ms": MS, "max_bandwidth": BYTES_PER_S\|null, "timeout_ms": MS\|null, "auto_converge": BOOL, "max_throttle": PERCENT}` (`null`: no limit, no timeout; [`server::TuneBody`]); `GET /migration`'s `settings` shows them once in force: 200; 400 for a bad value, 409 if no migration runs here |
//! | `GET /migration` | 200, the migration's [`ferry_migrate::Progress`] (phase, pass, remaining bytes, MB/s, dirty rate, expected downtime, `job`: the figures as libvirt's job statistics name them, [`ferry_migrate::job::JobStats`], and the statistics once it ended), with a copied disk's figures under `disk` (and in `job`'s `disk_*`; [`crate::disk_copy::DiskCopyStatus`]: chunks, data and zero bytes, dirty passes, pending bytes, mirror and how long it held the guest); 404 if none was started |
//! | `GET /events?after=N&wait_ms=MS` | 200, the VM's migration events numbered after `N` ([`ferry_migrate::events::Events`]: both sides' phases, each pass's end, the end's figures or cause; a pass's and the completion's with `job`), waiting up to `MS` (at most 60 s) for one on a thread of its own; 400 for another query |
//! | `PUT /migration/cancel` | 200 while in precopy (the VM keeps running); 409 otherwise |
//! | `PUT /migration/postcopy` | 200: a migration started with `"mode": {"postcopy": {}}` switches at the end of its pass; 409 otherwise |
//! | `PUT /migration/pause` | 200 on a source or destination in postcopy with recovery: its connections are broken, both sides go to `postcopy_paused`; 409 otherwise |
//! | `PUT /migration/recover` | on a destination in `postcopy_paused`, body `{"listen": "tcp:HOST:PORT"}`: 200 `{"listening_on": ...}`, it waits there for the source; 409 otherwise |
//! | `PUT /migration/resume` | on a source in `postcopy_paused`, body `{"to": "tcp:HOST:PORT"}`: 200, it reconnects there; 409 otherwise |
//! | `PUT /snapshot` | 202; body `{"to": "/path/to/file", "stop": false, "writers": 2, "downtime_limit_ms": 20, "auto_converge": true, "timeout_ms": MS, "direct_io": false}` (all but `to` optional; [`crate::snapshot::SnapshotRequest`]): a live snapshot into that file of this host, followed (and cancelled) like a migration with `GET /migration` and `PUT /migration/cancel`; the guest runs on after it, or stays paused with `stop`; 409 if a migration or snapshot runs |
//!
//! Errors are `{"error": "..."}` with 400 (a bad body), 404 (no such path), 405 (wrong method)
//! or 409.

pub mod client;
pub mod server;
