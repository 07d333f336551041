//! The failure matrix, walked through real processes: a `ferry run` source migrating to a
//! `ferry run --incoming` destination, with a failure injected at a phase of the migration.
//! Each row ends as docs/protocol.md promises and ARCHITECTURE.md's failure matrix lists:
//! before the handover the source runs on with nothing lost, and a second migration (to a
//! fresh destination) succeeds and verifies; after it the guest runs in one place only; no
//! process hangs.

mod common;

use std::time::{Duration, Instant};

use common::{RunningVm, destination, recover, start_migrate, stderr};
use ferry_migrate_testkit::proxy::Proxy;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Where in the migration the failure strikes, as the source's progress shows it.
#[derive(Clone, Copy, Debug)]
enum At {
    /// Pass 1: every populated page going out.
    FirstPass,
    /// A later pass, sending what the guest dirtied.
    DirtyPass,
    /// After the switch to postcopy: the guest runs on the destination.
    Postcopy,
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    KillDestination,
    KillSource,
    /// SIGSTOP past the source's peer timeout (2 s here).
    StopDestination,
    /// SIGSTOP; the destination is then cancelled by its operator.
    StopSource,
    /// Every connection cut, as a failed link would (through a proxy).
    CutConnections,
}

/// How the row must end.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// The source's migration fails, its guest runs on, and a second migration succeeds.
    SourceRunsOn,
    /// The source is gone; the destination ends with no guest, exit status 1 (or 3 when
    /// cancelled), within seconds.
    DestinationGivesUp,
    /// Postcopy: the destination's guest runs on and its migration waits, paused, for a
    /// recovery; the source's copy never runs again.
    DestinationPaused,
    /// Postcopy: both sides pause, and a recovery completes the migration.
    Recovered,
}

const GUEST: &str = "ws=256M pattern=random rate=40 verify-ms=200 log-ms=0";
const LIMIT: Duration = Duration::from_secs(60);

fn migration(vm: &RunningVm) -> serde_json::Value {
    ferry_vmm::api::client::request(&vm.socket, "GET", "/migration").unwrap_or_default()
}

fn signal(vm: &RunningVm, s: Signal) {
    kill(Pid::from_raw(vm.child.id() as i32), s).expect("signal the VMM");
}

/// Waits until the source's migration is at `at`.
fn reach(src: &RunningVm, at: At) {
    src.wait_until(&format!("{at:?}"), LIMIT, |vm| {
        let m = migration(vm);
        match at {
            At::FirstPass => m["phase"] == "precopy" && m["bytes_sent"].as_u64() > Some(8 << 20),
            At::DirtyPass => m["phase"] == "precopy" && m["pass"].as_u64() >= Some(1),
            At::Postcopy => m["phase"] == "postcopy",
        }
    });
}

/// Waits for `vm`'s process to exit, within `LIMIT`; returns its status code.
fn exits(vm: RunningVm) -> Option<i32> {
    vm.finish(LIMIT).status.code()
}

fn row(at: At, fault: Fault, outcome: Outcome) {
    eprintln!("failure matrix: {fault:?} at {at:?}, expecting {outcome:?}");
    let src = RunningVm::start("512M", GUEST);
    src.wait_until("a verify pass", LIMIT, |vm| {
        vm.status()["guest"]["verify_passes"].as_u64() >= Some(1)
    });
    let (dst, port) = destination("512M");
    // A proxy in the path only for the rows that cut it.
    let proxy = matches!(fault, Fault::CutConnections)
        .then(|| Proxy::start(&format!("127.0.0.1:{port}"), 10 << 30));
    let to_port = proxy.as_ref().map_or(port, |p| {
        p.address().rsplit(':').next().unwrap().parse().unwrap()
    });
    let mut args = vec!["--max-bandwidth", "100M", "--peer-timeout", "2s"];
    if matches!(at, At::Postcopy) {
        args.extend(["--postcopy", "--postcopy-after-passes", "1"]);
    }
    let migrate = start_migrate(&src, to_port, &args);
    reach(&src, at);
    let struck = Instant::now();
    match fault {
        Fault::KillDestination => signal(&dst, Signal::SIGKILL),
        Fault::KillSource => signal(&src, Signal::SIGKILL),
        Fault::StopDestination => signal(&dst, Signal::SIGSTOP),
        Fault::StopSource => signal(&src, Signal::SIGSTOP),
        Fault::CutConnections => {
            assert!(proxy.as_ref().unwrap().cut_all() > 0, "connections to cut");
        }
    }
    match outcome {
        Outcome::SourceRunsOn => {
            if matches!(fault, Fault::StopSource) {
                // The destination waits for a silent source far longer than a test does
                // (docs/protocol.md); its operator's cancel ends it at once.
                let out = dst.control("cancel");
                assert!(out.status.success(), "{}", stderr(&out));
                signal(&src, Signal::SIGCONT);
            }
            let out = migrate.wait_with_output().unwrap();
            assert!(!out.status.success(), "the migration failed");
            eprintln!(
                "  source's migration ended after {:?}: {}",
                struck.elapsed(),
                stderr(&out).lines().last().unwrap_or_default()
            );
            assert_eq!(src.status()["state"], "running", "{}", stderr(&out));
            if matches!(fault, Fault::StopDestination) {
                signal(&dst, Signal::SIGCONT);
            }
            drop(dst);
            // Nothing lost: a second migration to a fresh destination verifies clean.
            let (again, port) = destination("512M");
            let out = start_migrate(&src, port, &[]).wait_with_output().unwrap();
            assert!(out.status.success(), "{}", stderr(&out));
            again.assert_verifies_clean();
        }
        Outcome::DestinationGivesUp => {
            drop(migrate);
            let code = exits(dst);
            assert!(matches!(code, Some(1 | 3)), "destination exit {code:?}");
            eprintln!("  destination gave up after {:?}", struck.elapsed());
        }
        Outcome::DestinationPaused => {
            drop(migrate);
            dst.wait_until("postcopy_paused", LIMIT, |vm| {
                migration(vm)["phase"] == "postcopy_paused"
            });
            assert_eq!(dst.status()["state"], "running", "the guest runs on there");
        }
        Outcome::Recovered => {
            src.wait_until("the source paused", LIMIT, |vm| {
                migration(vm)["phase"] == "postcopy_paused"
            });
            eprintln!("  source paused after {:?}", struck.elapsed());
            assert_eq!(
                src.status()["state"],
                "paused",
                "the source never runs it again"
            );
            signal(&dst, Signal::SIGCONT);
            dst.wait_until("the destination paused", LIMIT, |vm| {
                migration(vm)["phase"] == "postcopy_paused"
            });
            recover(&src, &dst);
            let first = migrate.wait_with_output().unwrap();
            assert!(first.status.success(), "{}", stderr(&first));
            dst.assert_verifies_clean();
        }
    }
}

#[test]
fn every_failure_ends_as_the_protocol_promises() {
    use At::*;
    use Fault::*;
    use Outcome::*;
    let matrix = [
        (FirstPass, KillDestination, SourceRunsOn),
        (FirstPass, StopDestination, SourceRunsOn),
        (FirstPass, CutConnections, SourceRunsOn),
        (FirstPass, StopSource, SourceRunsOn),
        (FirstPass, KillSource, DestinationGivesUp),
        (DirtyPass, KillDestination, SourceRunsOn),
        (DirtyPass, CutConnections, SourceRunsOn),
        (DirtyPass, KillSource, DestinationGivesUp),
        (Postcopy, KillSource, DestinationPaused),
        (Postcopy, StopDestination, Recovered),
    ];
    for (at, fault, outcome) in matrix {
        row(at, fault, outcome);
    }
}
