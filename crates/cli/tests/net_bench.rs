//! `ferry bench net` at a small count: one move of each ferry row at 1,000 frames/s, in the
//! bench's own namespace, prints a row each with every frame answered once and the namespace
//! gone after.

mod common;

use std::process::{Command, Stdio};

use common::{ferry, require_kvm, stderr};

#[test]
fn one_move_of_each_ferry_row_prints_its_figures_and_leaves_no_namespace() {
    require_kvm();
    let child = ferry()
        .args(["bench", "net", "--moves", "1", "--rate", "1000"])
        .args(["--rows", "migrate,local"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let namespace = format!("ferry-t{}-", child.id());
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &serde_json::Value| r["bench"] == "net")
        .collect();
    let names: Vec<&str> = rows.iter().filter_map(|r| r["row"].as_str()).collect();
    assert_eq!(names, ["migrate", "local"], "{text}");
    for r in &rows {
        assert_eq!(r["moves"], 1, "{text}");
        assert_eq!(r["duplicates_total"], 0.0, "{text}");
        assert_eq!(r["lost_no_move"], 0, "{text}");
        assert!(r["echoes"].as_u64() > Some(1000), "{text}");
        assert!(r["pause_ms"]["max"].as_f64() > Some(0.0), "{text}");
    }
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(
        !list.contains(&namespace),
        "{namespace}* is deleted: {list}"
    );
}
