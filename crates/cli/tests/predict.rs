//! `ferry bench predict`, short: an idle guest migrated with the default policy and with
//! `--postcopy-auto`. Each migration has a prediction from its first pass on, every allowed
//! way is predicted, and the way the last prediction chose is the way taken. Nothing about
//! the figures' accuracy is asserted here: that is the bench's to measure.

mod common;

use common::{ferry, require_kvm, stderr};

#[test]
fn a_prediction_comes_after_pass_1_and_the_way_it_chose_is_the_way_taken() {
    require_kvm();
    let out = ferry()
        .args(["bench", "predict", "--runs", "1", "--only", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &serde_json::Value| r["scenario"].is_string())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for row in &rows {
        let first = &row["first"];
        assert_eq!(first["pass"], 1, "predicted at pass 1's end: {row}");
        assert!(first["precopy"]["total_ms"].as_f64() > Some(0.0), "{row}");
        assert!(
            first["precopy"]["downtime_ms"].as_f64() > Some(0.0),
            "{row}"
        );
        assert!(first["auto_converge"].is_object(), "on by default: {row}");
        let auto = row["policy"] == "auto";
        assert_eq!(
            first["postcopy"].is_object(),
            auto,
            "only when allowed: {row}"
        );
        assert_eq!(row["last"]["chosen"], row["actual"]["way"], "{row}");
    }
}
