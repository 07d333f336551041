//! Guest RAM on 2 MiB huge pages (`ferry run --hugepages`), on real KVM: the guest runs and
//! verifies clean, precopy migrates it into a huge-page destination, a short pool is an error
//! that names the fix, and postcopy is refused (it places 4 KiB pages) with the reason.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::{config, require_kvm, wait_for_telemetry};
use ferry_migrate::{Phase, Policy, TimeoutAction};
use ferry_vmm::memory::HostPages;
use ferry_vmm::migration::{self, MigrationRequest};
use ferry_vmm::{RunState, Vm, VmConfig};

const MIB: u64 = 1 << 20;
const MEMORY: u64 = 256 * MIB;
const POOL: &str = "/proc/sys/vm/nr_hugepages";

/// Raises the host's huge page pool by `pages` for the test's life.
struct Reserved(u64);

impl Reserved {
    fn more(pages: u64) -> Reserved {
        let now: u64 = std::fs::read_to_string(POOL)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        std::fs::write(POOL, (now + pages).to_string())
            .unwrap_or_else(|e| panic!("cannot reserve huge pages in {POOL} (run as root): {e}"));
        let got: u64 = std::fs::read_to_string(POOL)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            got >= now + pages,
            "the host gave {} of {pages} huge pages asked for (memory too fragmented?)",
            got - now
        );
        Reserved(now)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let _ = std::fs::write(POOL, self.0.to_string());
    }
}

fn huge(cmdline: &str, serial: &std::path::Path) -> VmConfig {
    VmConfig {
        host_pages: HostPages::Huge2M,
        ..config(MEMORY, cmdline, serial)
    }
}

fn request(listener: &TcpListener, postcopy: bool) -> MigrationRequest {
    let mut r = MigrationRequest::new(
        listener.local_addr().unwrap().to_string(),
        Policy {
            downtime_limit: Duration::from_millis(300),
            timeout: Some(Duration::from_secs(60)),
            timeout_action: TimeoutAction::Cancel,
        },
    );
    r.postcopy = postcopy;
    r.postcopy_after_passes = postcopy.then_some(1);
    r
}

#[test]
fn a_huge_page_guest_migrates_by_precopy_and_refuses_postcopy() {
    require_kvm();
    let _pool = Reserved::more(3 * MEMORY / (2 * MIB) + 8);
    let dir = tempfile::tempdir().unwrap();
    let src = Vm::boot(huge(
        "ws=64M pattern=random rate=100 verify-ms=200 log-ms=0",
        &dir.path().join("src.log"),
    ))
    .expect("boot on huge pages");
    let sh = src.handle();
    assert_eq!(sh.ram().host_pages(), HostPages::Huge2M);
    let before = wait_for_telemetry(&sh, "a clean verify pass", Duration::from_secs(60), |g| {
        g.verify_passes >= 1
    });
    assert_eq!(before.verify_failures, 0);

    // Postcopy: the huge-page destination does not offer it, and says so; the source runs on.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut refusing = Vm::incoming(huge("", &dir.path().join("refusing.log"))).unwrap();
    let failed = std::thread::scope(|s| {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (incoming, l) = (&mut refusing, &listener);
        let r = s.spawn(move || migration::receive(incoming, l, &|| Instant::now() < deadline));
        sh.start_migration(request(&listener, true)).unwrap();
        let p = loop {
            let p = sh.migration().unwrap();
            if matches!(p.phase, Phase::Completed | Phase::Failed | Phase::Cancelled) {
                break p;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = r.join().unwrap();
        p
    });
    assert_eq!(failed.phase, Phase::Failed, "{failed:?}");
    let why = failed.error.unwrap_or_default();
    assert!(why.contains("does not offer postcopy"), "{why}");
    assert_eq!(sh.state(), RunState::Running, "the source keeps running");
    drop(refusing);

    // Precopy into a huge-page destination.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut incoming = Vm::incoming(huge("", &dir.path().join("dst.log"))).unwrap();
    let received = std::thread::scope(|s| {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (incoming, l) = (&mut incoming, &listener);
        let r = s.spawn(move || migration::receive(incoming, l, &|| Instant::now() < deadline));
        sh.start_migration(request(&listener, false)).unwrap();
        r.join().unwrap()
    });
    received.expect("the destination received the migration");
    let dst = incoming.into_running().expect("resumed");
    let dh = dst.handle();
    let resumed = dh.telemetry();
    let after = wait_for_telemetry(
        &dh,
        "verify passes on the destination",
        Duration::from_secs(60),
        |g| g.verify_passes >= resumed.verify_passes + 2,
    );
    assert_eq!(
        after.verify_failures, 0,
        "a bad page after migrating huge pages: {:?}",
        after.first_failed_verify
    );
    assert_eq!(dh.ram().host_pages(), HostPages::Huge2M);
}

#[test]
fn a_short_huge_page_pool_is_an_error_that_names_the_fix() {
    require_kvm();
    let dir = tempfile::tempdir().unwrap();
    // 64 GiB of huge pages is more than this host's pool and memory.
    let e = match Vm::boot(VmConfig {
        memory_bytes: 64 << 30,
        ..huge("", &dir.path().join("serial.log"))
    }) {
        Ok(_) => panic!("a pool too short for the guest is refused"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("reserve 32768 more") && e.contains("nr_hugepages"),
        "{e}"
    );
}
