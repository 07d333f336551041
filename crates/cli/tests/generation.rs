//! The VM generation ID end to end (issue 48): a VM's guest reads the ID its VMM shows; two
//! restores of one snapshot are two clones, each with an ID of its own that its guest notices
//! within a few heartbeats; a live migration and a local handover keep the ID, and the guest
//! sees no change.

mod common;

use std::time::Duration;

use common::{RunningVm, destination, ferry, start_migrate, stderr, unix_destination};
use serde_json::Value;

/// A small, slow writer: what matters is its heartbeats (every 10 ms), at each of which it
/// looks at the ID.
const GUEST: &str = "ws=16M pattern=random rate=20 verify-ms=200 log-ms=0";
const MEMORY: &str = "256M";
const LIMIT: Duration = Duration::from_secs(30);

/// The ID the VMM shows, the one its guest last reported, and the changes the guest has seen.
fn ids(vm: &RunningVm) -> (String, Value, Value) {
    let s = vm.status();
    let vmm = s["generation_id"].as_str().unwrap().to_string();
    (
        vmm,
        s["guest"]["generation_id"].clone(),
        s["guest"]["generation_changes"].clone(),
    )
}

/// Waits until `vm`'s guest reports the ID its VMM shows; returns it and the guest's changes.
fn reported(vm: &RunningVm, what: &str) -> (String, u64) {
    vm.wait_until(what, LIMIT, |vm| {
        let (vmm, guest, _) = ids(vm);
        guest == vmm.as_str()
    });
    let (vmm, _, changes) = ids(vm);
    (vmm, changes.as_u64().unwrap())
}

/// Waits for `n` more heartbeats of `vm`'s guest (looks at the ID).
fn heartbeats(vm: &RunningVm, n: u64) {
    let before = vm.status()["guest"]["heartbeats"].as_u64().unwrap();
    vm.wait_until("more heartbeats", LIMIT, |vm| {
        vm.status()["guest"]["heartbeats"].as_u64() >= Some(before + n)
    });
}

/// After a migration or handover to `vm`: the VMM shows `id`, and its guest, having looked a
/// few times, still reports `id` with `changes` changes.
fn kept(vm: &RunningVm, id: &str, changes: u64) {
    vm.wait_until("the guest to run", LIMIT, |vm| {
        vm.status()["state"] == "running"
    });
    heartbeats(vm, 5);
    let (vmm, guest, seen) = ids(vm);
    assert_eq!(
        (vmm.as_str(), &guest, &seen),
        (id, &Value::from(id), &Value::from(changes))
    );
}

#[test]
fn clones_get_new_generation_ids_and_a_migration_keeps_the_id() {
    let src = RunningVm::start(MEMORY, GUEST);
    let (id, changes) = reported(&src, "the guest's first report of the ID");
    assert_eq!(changes, 0, "no change since boot");
    assert_eq!(id.len(), 32, "{id}");
    assert!(
        id.bytes().all(|b| b.is_ascii_hexdigit()) && id != "f".repeat(32),
        "{id}"
    );

    // Two clones of one snapshot: each draws its ID, different from the source's and from the
    // other's, and its guest notices at its next look (one change more than the source saw).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.snap");
    let out = ferry()
        .arg("snapshot")
        .arg("--api-socket")
        .arg(&src.socket)
        .arg("--to")
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let eager = RunningVm::restore(&file, &[]);
    let lazy = RunningVm::restore(&file, &["--lazy"]);
    let mut clones = Vec::new();
    for vm in [&eager, &lazy] {
        let (clone, seen) = reported(vm, "the clone's guest to notice its new ID");
        assert_ne!(clone, id, "a clone differs from its source");
        assert_eq!(seen, changes + 1, "one change: the restore");
        clones.push(clone);
    }
    assert_ne!(clones[0], clones[1], "two clones differ");
    drop((eager, lazy));
    assert_eq!(
        ids(&src).0,
        id,
        "a snapshot leaves the source's ID as it was"
    );

    // A live migration, then a local handover: the ID moves with the guest, which sees no
    // change.
    let (dst, port) = destination(MEMORY);
    let out = start_migrate(&src, port, &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    kept(&dst, &id, changes);
    drop(src);
    let (next, to) = unix_destination(MEMORY, &[]);
    let out = ferry()
        .args(["migrate", "--local", "--to", &to])
        .arg("--api-socket")
        .arg(&dst.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    kept(&next, &id, changes);
}
