//! Helpers for the VMM's end-to-end tests: boot the built-in guest on real KVM and wait for
//! what its telemetry says.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::net::TcpListener;

use ferry_migrate::destination::ReceiveStats;
use ferry_migrate::{MigrateError, Phase, Progress};
use ferry_vmm::devices::telemetry::GuestTelemetry;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::{GuestKind, IncomingVm, SerialOutput, Vm, VmConfig, VmHandle};

/// A booted test VM with its serial output in a temporary file.
pub struct TestVm {
    pub vm: Vm,
    pub serial: PathBuf,
    _dir: tempfile::TempDir,
}

/// Fails loudly when /dev/kvm cannot be used (every machine of this project has it).
pub fn require_kvm() {
    ferry_vmm::kvm::require_for_tests();
}

pub fn config(memory: u64, cmdline: &str, serial: &std::path::Path) -> VmConfig {
    VmConfig {
        memory_bytes: memory,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: cmdline.into(),
        guest: GuestKind::FerryGuest,
        serial: SerialOutput::File(serial.into()),
        balloon: true,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout: false,
    }
}

pub fn boot(memory: u64, cmdline: &str) -> TestVm {
    let dir = tempfile::tempdir().unwrap();
    let serial = dir.path().join("serial.log");
    let mut vm = boot_config(config(memory, cmdline, &serial));
    vm._dir = dir;
    vm
}

/// Boots `config`; its serial output goes where the config says (a file, for `serial_log`).
pub fn boot_config(config: VmConfig) -> TestVm {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    let serial = match &config.serial {
        SerialOutput::File(path) => path.clone(),
        _ => dir.path().join("no-serial"),
    };
    let vm = Vm::boot(config).unwrap_or_else(|e| panic!("boot failed: {e}"));
    TestVm {
        vm,
        serial,
        _dir: dir,
    }
}

impl TestVm {
    /// Polls telemetry until `done` holds, or panics after `timeout` with the serial log.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&GuestTelemetry) -> bool,
    ) -> GuestTelemetry {
        poll(&self.vm.handle(), what, timeout, done, || {
            format!("serial:\n{}", self.serial_log())
        })
    }

    /// Waits until the serial log contains `text` (the UART is slower than telemetry: a
    /// report can arrive while the matching line is still being printed).
    pub fn wait_for_serial(&self, text: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.serial_log();
            if log.contains(text) {
                return log;
            }
            if Instant::now() > deadline {
                panic!("timed out after {timeout:?} waiting for {text:?} on serial:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn handle(&self) -> ferry_vmm::VmHandle {
        self.vm.handle()
    }

    pub fn serial_log(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }
}

/// Waits for `passes` more verify passes on a migrated guest and checks that none failed and
/// that heartbeats continue.
pub fn verifies_clean(dst: &Vm, passes: u64) -> GuestTelemetry {
    let dh = dst.handle();
    let resumed = dh.telemetry();
    let vcpus = resumed.config.as_ref().map_or(1, |c| c.vcpus) as usize;
    let after = wait_for_telemetry(
        &dh,
        &format!("{passes} verify passes on each of {vcpus} vCPUs on the destination"),
        Duration::from_secs(60),
        |g| {
            g.vcpus.len() == vcpus
                && g.vcpus.iter().all(|v| {
                    let before = resumed.vcpus.iter().find(|r| r.vcpu == v.vcpu);
                    v.verify_passes >= before.map_or(0, |r| r.verify_passes) + passes
                })
        },
    );
    assert_eq!(
        after.verify_failures, 0,
        "a bad page after migration: {:?}",
        after.first_failed_verify
    );
    for v in &after.vcpus {
        let before = resumed.vcpus.iter().find(|r| r.vcpu == v.vcpu);
        assert!(
            v.heartbeats > before.map_or(0, |r| r.heartbeats),
            "vCPU {}'s heartbeats continue",
            v.vcpu
        );
    }
    assert_eq!(
        after.bad_reads, 0,
        "the guest read a page that did not hold its last write"
    );
    after
}

pub fn wait_migration(h: &VmHandle, timeout: Duration) -> Progress {
    let deadline = Instant::now() + timeout;
    loop {
        let p = h.migration().expect("a migration was started");
        if matches!(p.phase, Phase::Completed | Phase::Failed | Phase::Cancelled) {
            return p;
        }
        assert!(Instant::now() < deadline, "migration did not end: {p:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A request to migrate to `listener` with a 100 ms downtime limit, the switchover forced after
/// a minute: tests that check what arrives, not how precopy converges.
pub fn forced_request(listener: &TcpListener) -> MigrationRequest {
    MigrationRequest {
        downtime_limit_ms: 100,
        timeout_ms: Some(60_000),
        timeout_action: ferry_migrate::TimeoutAction::Switchover,
        ..MigrationRequest::to(listener.local_addr().unwrap().to_string())
    }
}

/// Runs `req` from `src` into `incoming`, which listens on `listener`: the destination's
/// result and the source's last progress, once both ended.
pub fn receive_from(
    src: &VmHandle,
    incoming: &mut IncomingVm,
    listener: &TcpListener,
    req: MigrationRequest,
) -> (Result<ReceiveStats, MigrateError>, Progress) {
    let received = std::thread::scope(|s| {
        let deadline = Instant::now() + Duration::from_secs(60);
        let r =
            s.spawn(move || migration::receive(incoming, listener, &|| Instant::now() < deadline));
        src.start_migration(req).unwrap();
        r.join().unwrap()
    });
    (received, wait_migration(src, Duration::from_secs(60)))
}

/// Migrates `src` into `incoming` over loopback TCP with a [`forced_request`] that `adjust`
/// may change: the destination running, and the source's last progress, once the migration
/// completed (anything else panics, naming both sides' words).
pub fn migrate_into(
    src: &VmHandle,
    mut incoming: IncomingVm,
    adjust: impl FnOnce(&mut MigrationRequest),
) -> (Vm, Progress) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut req = forced_request(&listener);
    adjust(&mut req);
    let (received, progress) = receive_from(src, &mut incoming, &listener, req);
    received.unwrap_or_else(|e| panic!("destination: {e}; source: {progress:?}"));
    assert_eq!(progress.phase, Phase::Completed, "{progress:?}");
    (incoming.into_running().expect("resumed"), progress)
}

/// Polls a VM's telemetry until `done` holds, or panics after `timeout`.
pub fn wait_for_telemetry(
    h: &ferry_vmm::VmHandle,
    what: &str,
    timeout: Duration,
    done: impl Fn(&GuestTelemetry) -> bool,
) -> GuestTelemetry {
    poll(h, what, timeout, done, String::new)
}

fn poll(
    h: &ferry_vmm::VmHandle,
    what: &str,
    timeout: Duration,
    done: impl Fn(&GuestTelemetry) -> bool,
    context: impl Fn() -> String,
) -> GuestTelemetry {
    let deadline = Instant::now() + timeout;
    loop {
        let t = h.telemetry();
        if done(&t) {
            return t;
        }
        if Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for {what}\ntelemetry: {t:#?}\nstate: {:?}\n{}",
                h.status().stop_reason,
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
