//! The prediction as text: the live line's "will finish by" and the final table's predicted
//! against actual, pass by pass (`ferry_migrate::predict`). Below `text.rs`, which shows it.

use ferry_migrate::MigrationStats;
use ferry_migrate::predict::{Forecast, Prediction};

/// A forecast's total time and downtime, `-` for what does not end.
fn figures(f: &Forecast) -> String {
    match (f.total_ms, f.downtime_ms) {
        (Some(t), Some(d)) => format!("total {t:.0} ms, downtime {d:.1} ms"),
        _ => "does not converge".into(),
    }
}

/// The live line's part: the way the migration will take and its predicted figures.
pub fn prediction_figures(p: &Prediction) -> String {
    format!(
        "will finish by {}: {}",
        p.chosen.name(),
        figures(&p.forecast())
    )
}

/// The final table's rows: each pass's predicted total and downtime for the way it chose,
/// beside the way taken and what it actually took.
pub fn print_predicted(s: &MigrationStats) {
    let rows: Vec<_> = s
        .passes
        .iter()
        .filter_map(|p| Some((p.pass, p.predicted?)))
        .collect();
    if rows.is_empty() {
        return;
    }
    println!(
        "predicted        by pass end; actual: {} in {:.0} ms, downtime {:.1} ms",
        s.way_taken().name(),
        s.total_ms,
        s.downtime.total_ms
    );
    println!(
        "{:>6} {:>14} {:>12} {:>14} {:>10} {:>14}",
        "pass", "way", "total ms", "downtime ms", "total err", "downtime err"
    );
    for (pass, p) in rows {
        let f = p.forecast();
        let cell = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        let err = |v: Option<f64>, actual: f64, unit: &str| match v {
            Some(v) if unit == "%" => format!("{:+.0}%", (v / actual.max(1e-3) - 1.0) * 100.0),
            Some(v) => format!("{:+.1} ms", v - actual),
            None => "-".into(),
        };
        println!(
            "{:>6} {:>14} {:>12} {:>14} {:>10} {:>14}",
            pass,
            p.chosen.name(),
            cell(f.total_ms),
            cell(f.downtime_ms),
            err(f.total_ms, s.total_ms, "%"),
            err(f.downtime_ms, s.downtime.total_ms, "ms"),
        );
    }
}
