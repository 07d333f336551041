//! Postcopy recovery between two VMs of this process on real KVM, driven through both VMs' API
//! sockets as an operator would, over a TCP proxy the test breaks on purpose: pauses asked on
//! either side, a network break of every connection, a recovery that fails half way, and a
//! preempt connection that breaks alone. After each, both sides wait in postcopy-paused with
//! the guest running on the destination, a recovery resumes the migration, and the guest's own
//! verify passes stay clean on the destination once it completed.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{boot, config, require_kvm, verifies_clean, wait_migration};
use ferry_migrate::destination::{IncomingPhase, ReceiveStats};
use ferry_migrate::source::Preempt;
use ferry_migrate::wire::Role;
use ferry_migrate::{Phase, Progress, TimeoutAction};
use ferry_migrate_testkit::proxy::Proxy;
use ferry_vmm::api::client;
use ferry_vmm::api::server::ApiServer;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::request::{MigrationMode, PostcopyRequest};
use ferry_vmm::{Vm, VmHandle};

const MIB: u64 = 1 << 20;
/// What the proxy forwards from the source per connection, bytes per second: slow enough that
/// postcopy lasts seconds, long enough to break it more than once.
const PROXY_RATE: u64 = 6_000_000;

/// The two VMs of a migration under way, their API sockets, and the proxy between them.
struct Sides<'a> {
    src: VmHandle,
    dst: VmHandle,
    src_api: PathBuf,
    dst_api: PathBuf,
    proxy: &'a Proxy,
}

impl Sides<'_> {
    fn state(&self) -> String {
        let src = self.src.migration().map(|mut p| {
            p.stats = None;
            p
        });
        format!(
            "source {src:?}\ndestination {:?}\ndestination VM: {:?}",
            self.dst.incoming(),
            self.dst.status().stop_reason
        )
    }

    fn wait(&self, what: &str, done: impl Fn(&Progress, IncomingPhase) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (s, d) = (self.src.migration(), self.dst.incoming());
            if let (Some(s), Some(d)) = (&s, &d)
                && done(s, d.phase)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}:\n{}",
                self.state()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Both sides in postcopy, and the proxy holding every byte so that it cannot end before
    /// the test breaks it.
    fn postcopy_held(&self) {
        self.wait("postcopy on both sides", |s, d| {
            s.phase == Phase::Postcopy && d == IncomingPhase::Postcopy
        });
        self.proxy.hold();
        let (s, d) = (self.src.migration().unwrap(), self.dst.incoming().unwrap());
        assert!(
            s.phase == Phase::Postcopy && d.phase == IncomingPhase::Postcopy,
            "postcopy ended before the proxy held it; lower PROXY_RATE:\n{}",
            self.state()
        );
    }

    fn paused(&self) {
        self.wait("postcopy-paused on both sides", |s, d| {
            s.phase == Phase::PostcopyPaused && d == IncomingPhase::PostcopyPaused
        });
        let g = self.dst.telemetry();
        assert!(g.heartbeats > 0, "the guest runs on the destination");
    }

    fn put(&self, api: &Path, path: &str, body: serde_json::Value) -> serde_json::Value {
        client::request_with_body(api, "PUT", path, &body.to_string())
            .unwrap_or_else(|e| panic!("PUT {path}: {e}\n{}", self.state()))
    }

    /// `ferry migrate-recover` on the destination (a new port), the proxy pointed there, and
    /// `ferry migrate --resume` on the source to the proxy.
    fn recover(&self) {
        let answer = self.put(
            &self.dst_api,
            "/migration/recover",
            serde_json::json!({ "listen": "tcp:127.0.0.1:0" }),
        );
        let at = answer["listening_on"].as_str().expect("where it listens");
        self.proxy.retarget(at.strip_prefix("tcp:").unwrap());
        self.put(
            &self.src_api,
            "/migration/resume",
            serde_json::json!({ "to": self.proxy.address() }),
        );
    }

    fn recovered(&self, n: u32) {
        self.wait(&format!("recovery {n}"), |s, d| {
            s.recoveries >= n
                && matches!(s.phase, Phase::Postcopy | Phase::Completed)
                && matches!(d, IncomingPhase::Postcopy | IncomingPhase::Completed)
        });
    }
}

/// Boots a guest that dirties its working set flat out, migrates it through a proxy with
/// postcopy after pass 1 (recovery on, the default), runs `script` while it is under way, and
/// checks that it completed with the guest verifying clean on the destination.
fn migrate_through_breaks(
    preempt: bool,
    script: impl FnOnce(&Sides<'_>),
) -> (ReceiveStats, Progress) {
    let src = boot(
        256 * MIB,
        "ws=64M pattern=random read=30 rate=max verify-ms=200 log-ms=0",
    );
    src.wait_for("a clean verify pass", Duration::from_secs(60), |g| {
        g.verify_passes >= 1
    });
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = Proxy::start(&listener.local_addr().unwrap().to_string(), PROXY_RATE);
    let mut incoming = Vm::incoming(config(256 * MIB, "", &dir.path().join("serial.log"))).unwrap();
    let (src_api, dst_api) = (dir.path().join("src.sock"), dir.path().join("dst.sock"));
    let _src_server = ApiServer::start(&src_api, src.handle()).unwrap();
    let _dst_server = ApiServer::start(&dst_api, incoming.handle()).unwrap();
    let req = MigrationRequest {
        // No flat-out guest fits 1 ms: precopy never switches over by itself.
        downtime_limit_ms: 1,
        timeout_ms: Some(120_000),
        timeout_action: TimeoutAction::Cancel,
        mode: MigrationMode::Postcopy(PostcopyRequest {
            after_passes: Some(1),
            preempt: Preempt::urgent_when(preempt),
            ..PostcopyRequest::default()
        }),
        ..MigrationRequest::to(proxy.address().to_string())
    };
    let sides = Sides {
        src: src.handle(),
        dst: incoming.handle(),
        src_api,
        dst_api,
        proxy: &proxy,
    };
    let received = std::thread::scope(|s| {
        let deadline = Instant::now() + Duration::from_secs(60);
        let incoming = &mut incoming;
        let listener = &listener;
        let r =
            s.spawn(move || migration::receive(incoming, listener, &|| Instant::now() < deadline));
        sides.src.start_migration(req).unwrap();
        script(&sides);
        r.join().unwrap()
    });
    let progress = wait_migration(&sides.src, Duration::from_secs(60));
    let received = received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    let dst = incoming.into_running().expect("resumed");
    let resumed = dst.handle().telemetry();
    let after = verifies_clean(&dst, 2);
    assert!(
        after.pages_written > resumed.pages_written,
        "the guest keeps writing"
    );
    (received, progress)
}

fn recoveries(received: &ReceiveStats, progress: &Progress) -> (u32, f64) {
    let pc = progress
        .stats
        .as_ref()
        .and_then(|s| s.postcopy.clone())
        .expect("postcopy statistics");
    let here = received
        .postcopy
        .as_ref()
        .expect("postcopy on the destination");
    assert_eq!(
        pc.recoveries, here.recoveries,
        "both sides count the same recoveries"
    );
    assert!(here.paused > Duration::ZERO);
    (pc.recoveries, pc.paused_ms)
}

#[test]
fn pauses_asked_on_either_side_through_the_api_recover_and_the_guest_verifies_clean() {
    let (received, progress) = migrate_through_breaks(true, |sides| {
        // `ferry migrate-pause` on the source...
        sides.postcopy_held();
        sides.put(&sides.src_api, "/migration/pause", serde_json::json!({}));
        sides.paused();
        sides.proxy.release();
        sides.recover();
        sides.recovered(1);
        // ...and on the destination.
        sides.postcopy_held();
        sides.put(&sides.dst_api, "/migration/pause", serde_json::json!({}));
        sides.paused();
        sides.proxy.release();
        sides.recover();
        sides.recovered(2);
    });
    let (n, paused_ms) = recoveries(&received, &progress);
    assert_eq!(n, 2);
    eprintln!("2 pauses through the API: recovered twice, {paused_ms:.0} ms paused in all");
}

#[test]
fn a_network_break_a_recovery_that_breaks_half_way_and_a_lone_preempt_break_all_recover() {
    let (received, progress) = migrate_through_breaks(true, |sides| {
        // Every connection cut, as when the link between the hosts fails.
        sides.postcopy_held();
        assert!(
            sides.proxy.cut_all() >= 3,
            "main, a data channel and preempt"
        );
        sides.proxy.release();
        sides.paused();
        // A recovery whose connections are cut right after their hello: both stay paused.
        sides.proxy.cut_after_hello(true);
        let before = sides.src.migration().unwrap().error;
        sides.recover();
        sides.wait("the failed recovery", |s, _| s.error != before);
        sides.paused();
        sides.proxy.cut_after_hello(false);
        // A later recovery works.
        sides.recover();
        sides.recovered(1);
        // The preempt connection alone breaks: both pause, and recover.
        sides.postcopy_held();
        assert_eq!(sides.proxy.cut_role(Role::Preempt), 1);
        sides.proxy.release();
        sides.paused();
        sides.recover();
        sides.recovered(2);
    });
    let (n, paused_ms) = recoveries(&received, &progress);
    assert_eq!(n, 2, "the attempt that broke half way is not a recovery");
    eprintln!(
        "a network break, a failed recovery and a lone preempt break: recovered twice, {paused_ms:.0} ms paused in all"
    );
}
