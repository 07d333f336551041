//! Synthetic statistics for `ferry report`'s tests (`report.rs`, `report_render.rs`), written
//! as `--stats-out` writes them: precopy runs of any number of passes, and a postcopy run whose
//! page requests fill the latency histogram.

#![allow(dead_code)]

use std::path::Path;

use ferry_migrate::stats::{Downtime, PassStats, PostcopyStats, Sample};
use ferry_migrate::{MigrationStats, Phase, StatePart};

/// A migration of `passes` precopy passes of 100 ms each, then a 40 ms switchover.
pub fn stats(passes: u32, mb_per_pass: u64) -> MigrationStats {
    let mut timeline = Vec::new();
    let mut sent = 0;
    for pass in 1..=passes {
        for step in 0..4 {
            sent += mb_per_pass * 250_000;
            timeline.push(Sample {
                t_ms: f64::from((pass - 1) * 100 + step * 25),
                bytes_sent: sent,
                remaining_bytes: u64::from(4 - step) * 1_000_000,
                send_rate_mb_s: 900.0,
                dirty_rate_pages_per_s: 20_000.0,
                pass,
                phase: Phase::Precopy,
            });
        }
    }
    for (t, phase) in [(0.0, Phase::Switchover), (40.0, Phase::Completed)] {
        timeline.push(Sample {
            t_ms: f64::from(passes * 100) + t,
            bytes_sent: sent,
            pass: passes + 1,
            phase,
            ..Sample::default()
        });
    }
    let mut pass_rows: Vec<PassStats> = (1..=passes)
        .map(|pass| PassStats {
            pass,
            paused: false,
            pages: mb_per_pass * 244,
            bytes: mb_per_pass * 1_000_000,
            duration_ms: 100.0,
            dirty_rate_pages_per_s: 20_000.0,
            throttle_percent: 0,
            predicted: None,
        })
        .collect();
    pass_rows.push(PassStats {
        pass: passes + 1,
        paused: true,
        pages: 200,
        bytes: 800_000,
        duration_ms: 12.0,
        dirty_rate_pages_per_s: 0.0,
        throttle_percent: 0,
        predicted: None,
    });
    MigrationStats {
        total_ms: f64::from(passes * 100 + 40),
        downtime: Downtime {
            total_ms: 40.0,
            pause_ms: 2.0,
            final_sync_ms: 1.0,
            final_pages_ms: 12.0,
            state_save_ms: 0.5,
            transfer_ms: 20.0,
            load_ms: 4.0,
            resume_ms: 0.5,
            state_bytes: 40_960,
            save_parts: vec![
                part("vcpu 0", 0.3),
                part("vcpu 1", 0.1),
                part("vm clock", 0.05),
            ],
            load_parts: vec![part("vcpu 0", 2.0), part("serial port 0", 1.5)],
        },
        bytes_sent: sent,
        passes: pass_rows,
        timeline,
        converged: true,
        ..MigrationStats::default()
    }
}

fn part(name: &str, ms: f64) -> StatePart {
    StatePart {
        name: name.into(),
        ms,
        bytes: 4096,
    }
}

pub fn write(dir: &Path, name: &str, s: &MigrationStats) -> String {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string(s).unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

/// [`stats`] of `passes` passes that switched to postcopy after them instead of converging:
/// the guest ran on the destination 400 ms more while 8 requests fetched their pages in 8 µs
/// to 2 ms (buckets 3 to 10, at most 3 in one: a count axis of few requests).
pub fn postcopy(passes: u32, mb_per_pass: u64) -> MigrationStats {
    let mut s = stats(passes, mb_per_pass);
    s.passes.pop();
    s.converged = false;
    let end = s.timeline.pop().expect("a completed mark");
    let resumed = end.t_ms;
    for (t, phase) in [(0.0, Phase::Postcopy), (400.0, Phase::Completed)] {
        s.timeline.push(Sample {
            t_ms: resumed + t,
            phase,
            ..end.clone()
        });
    }
    s.total_ms = resumed + 400.0;
    let mut buckets = vec![0; 32];
    for (k, count) in [(3, 1), (5, 2), (6, 3), (8, 1), (10, 1)] {
        buckets[k] = count;
    }
    s.postcopy = Some(PostcopyStats {
        after_passes: passes,
        duration_ms: 400.0,
        discarded_pages: 10_000,
        pages_requested: 8,
        pages_background: 20_000,
        requests: buckets.iter().sum(),
        bytes: 84_000_000,
        latency_mean_us: 190.0,
        latency_p50_us: 64,
        latency_p99_us: 1024,
        latency_max_us: 1900,
        latency_buckets: buckets,
        ..PostcopyStats::default()
    });
    s
}
