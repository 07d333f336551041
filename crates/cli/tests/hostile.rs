//! `ferry bench hostile`, short: strangers at a waiting destination are all dropped and
//! counted and leave its descriptors where they were, and a migration with strangers on the
//! port completes and verifies clean (the bench fails otherwise).

mod common;

use common::{ferry, require_kvm, stderr};

#[test]
fn strangers_at_a_destination_are_dropped_and_counted_and_a_migration_among_them_verifies() {
    require_kvm();
    let out = ferry()
        .args(["bench", "hostile", "--waiting", "2s", "--threads", "8"])
        .args([
            "--memory",
            "256M",
            "--cmdline",
            "ws=32M pattern=random rate=20 verify-ms=50 log-ms=0",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    let row: serde_json::Value = text
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("the JSON line");
    let waiting = &row["waiting"];
    assert!(waiting["opened"].as_u64() > Some(10), "{text}");
    assert_eq!(waiting["dropped"], waiting["opened"], "{text}");
    assert_eq!(waiting["fds_after"], waiting["fds_before"], "{text}");
    let during = &row["during_migration"];
    assert!(during["opened"].as_u64() > Some(0), "{text}");
    assert!(
        during["fds_after"].as_u64() <= during["fds_before"].as_u64(),
        "{text}"
    );
}
