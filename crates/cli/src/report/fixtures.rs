//! The statistics of every kind of run, as the source session writes them, for the report's
//! tests: precopy that converged, postcopy, postcopy that recovered from a broken connection,
//! a cancelled migration and one that auto-converge throttled; and a copied disk's figures.
//! Times and counts are round so that a test can say where a band or bar must be.

use ferry_migrate::stats::{
    Downtime, PassStats, PostcopyStats, PostcopyTrigger, Sample, StatePart,
};
use ferry_migrate::{MigrationStats, Phase};

/// The phases of a timeline: from each (ms, phase, pass) to the next, a sample every 25 ms,
/// and the last one alone (the end mark). Bytes grow at 200 MB/s.
fn timeline(marks: &[(f64, Phase, u32)]) -> Vec<Sample> {
    let mut out = Vec::new();
    for (i, &(from, phase, pass)) in marks.iter().enumerate() {
        let to = marks.get(i + 1).map_or(from + 1.0, |m| m.0);
        let mut t = from;
        while t < to {
            out.push(Sample {
                t_ms: t,
                bytes_sent: (t * 200e3) as u64,
                remaining_bytes: if pass > 1 { 100_000_000 } else { 0 },
                send_rate_mb_s: 200.0,
                dirty_rate_pages_per_s: 20_000.0,
                pass,
                phase,
            });
            t += 25.0;
        }
    }
    out
}

fn pass(pass: u32, mb: u64, ms: f64, throttle_percent: u8) -> PassStats {
    PassStats {
        pass,
        paused: false,
        pages: mb * 256,
        bytes: mb << 20,
        duration_ms: ms,
        dirty_rate_pages_per_s: 20_000.0,
        throttle_percent,
        predicted: None,
    }
}

/// `p` with a prediction at its end: precopy, `total_ms` and `downtime_ms`.
fn predicted(mut p: PassStats, total_ms: f64, downtime_ms: f64) -> PassStats {
    use ferry_migrate::predict::{Forecast, Prediction, Way};
    let precopy = Forecast {
        total_ms: Some(total_ms),
        downtime_ms: Some(downtime_ms),
        converges: true,
    };
    p.predicted = Some(Prediction {
        pass: p.pass,
        precopy,
        auto_converge: Some(precopy),
        postcopy: None,
        chosen: Way::Precopy,
    });
    p
}

/// A state part as the reference VMM names them.
fn part(name: &str, ms: f64) -> StatePart {
    StatePart {
        name: name.into(),
        ms,
        bytes: 4096,
    }
}

/// A downtime of `total_ms` with every part, and a save and load of 8 vCPUs and the devices
/// (long enough that their lines must wrap).
fn downtime(total_ms: f64) -> Downtime {
    let vcpus = |ms| (0..8).map(move |i| part(&format!("vcpu {i}"), ms));
    let devices = [
        "clock",
        "pic master",
        "pic slave",
        "ioapic",
        "pit",
        "serial com1",
        "serial com2",
        "virtio-balloon",
        "telemetry",
    ];
    let mut save_parts: Vec<StatePart> = vcpus(0.021).collect();
    save_parts.extend(devices.iter().map(|d| part(d, 0.004)));
    let mut load_parts: Vec<StatePart> = vcpus(0.052).collect();
    load_parts.extend(devices.iter().map(|d| part(d, 0.006)));
    load_parts.push(part("wake vcpu threads", 0.110));
    Downtime {
        total_ms,
        pause_ms: total_ms * 0.03,
        final_sync_ms: total_ms * 0.02,
        final_pages_ms: total_ms * 0.8,
        state_save_ms: total_ms * 0.02,
        transfer_ms: total_ms * 0.1,
        load_ms: total_ms * 0.02,
        resume_ms: total_ms * 0.01,
        state_bytes: 48_000,
        save_parts,
        load_parts,
    }
}

/// Precopy that converged: three passes, the switchover at 2.9 s, 120 ms of downtime.
pub(super) fn precopy() -> MigrationStats {
    let mut final_pass = pass(4, 24, 96.0, 0);
    final_pass.paused = true;
    MigrationStats {
        total_ms: 3030.0,
        setup_ms: 12.0,
        downtime: downtime(120.0),
        bytes_sent: 606_000_000,
        pages_normal: 147_000,
        bandwidth_mb_s: 200.0,
        passes: vec![
            predicted(pass(1, 400, 2000.0, 0), 2600.0, 160.0),
            predicted(pass(2, 150, 700.0, 0), 2950.0, 130.0),
            predicted(pass(3, 40, 200.0, 0), 3020.0, 118.0),
            final_pass,
        ],
        converged: true,
        timeline: timeline(&[
            (0.0, Phase::Setup, 0),
            (12.0, Phase::Precopy, 1),
            (2000.0, Phase::Precopy, 2),
            (2700.0, Phase::Precopy, 3),
            (2900.0, Phase::Switchover, 3),
            (3030.0, Phase::Completed, 3),
        ]),
        ..MigrationStats::default()
    }
}

/// Postcopy by the policy after two passes: the switchover marked at 2.0 s (early discards,
/// the guest still runs here), 120 ms paused up to the resume at 2.3 s, pages fetched until
/// 4.0 s. Requests took 64 µs to 4 ms, none 512-1024 µs.
pub(super) fn postcopy() -> MigrationStats {
    let mut buckets = vec![0; 32];
    for (k, count) in [(6, 40), (7, 900), (8, 1500), (10, 300), (11, 60), (12, 4)] {
        buckets[k] = count;
    }
    MigrationStats {
        total_ms: 4000.0,
        setup_ms: 12.0,
        downtime: downtime(120.0),
        bytes_sent: 800_000_000,
        bandwidth_mb_s: 200.0,
        passes: vec![pass(1, 400, 1500.0, 0), pass(2, 300, 488.0, 0)],
        postcopy: Some(PostcopyStats {
            after_passes: 2,
            trigger: PostcopyTrigger::Policy,
            duration_ms: 1820.0,
            discarded_pages: 30_000,
            pages_requested: 2804,
            pages_background: 27_000,
            requests: buckets.iter().sum(),
            bytes: 120_000_000,
            latency_mean_us: 310.0,
            latency_p50_us: 256,
            latency_p99_us: 2048,
            latency_max_us: 5000,
            latency_buckets: buckets,
            vcpu_blocktime_ms: 870.0,
            ..PostcopyStats::default()
        }),
        timeline: timeline(&[
            (0.0, Phase::Setup, 0),
            (12.0, Phase::Precopy, 1),
            (1500.0, Phase::Precopy, 2),
            (2000.0, Phase::Switchover, 2),
            (2300.0, Phase::Postcopy, 2),
            (4000.0, Phase::Completed, 2),
        ]),
        ..MigrationStats::default()
    }
}

/// [`postcopy`] whose connection broke at 2.8 s and recovered at 3.3 s.
pub(super) fn recovered() -> MigrationStats {
    let mut s = postcopy();
    let pc = s.postcopy.as_mut().expect("postcopy");
    pc.recoveries = 1;
    pc.paused_ms = 500.0;
    s.timeline = timeline(&[
        (0.0, Phase::Setup, 0),
        (12.0, Phase::Precopy, 1),
        (1500.0, Phase::Precopy, 2),
        (2000.0, Phase::Switchover, 2),
        (2300.0, Phase::Postcopy, 2),
        (2800.0, Phase::PostcopyPaused, 2),
        (3300.0, Phase::Postcopy, 2),
        (4000.0, Phase::Completed, 2),
    ]);
    s
}

/// Cancelled in its second pass at 1.5 s: the statistics as far as it got, no downtime.
pub(super) fn cancelled() -> MigrationStats {
    MigrationStats {
        total_ms: 1500.0,
        setup_ms: 12.0,
        bytes_sent: 300_000_000,
        bandwidth_mb_s: 200.0,
        passes: vec![pass(1, 250, 1250.0, 0)],
        timeline: timeline(&[
            (0.0, Phase::Setup, 0),
            (12.0, Phase::Precopy, 1),
            (1250.0, Phase::Precopy, 2),
            (1500.0, Phase::Cancelled, 2),
        ]),
        ..MigrationStats::default()
    }
}

/// Precopy that stalled until auto-converge throttled the guest to 40%, then converged.
pub(super) fn throttled() -> MigrationStats {
    let mut s = precopy();
    s.passes = vec![
        pass(1, 400, 1000.0, 0),
        pass(2, 380, 800.0, 20),
        pass(3, 200, 600.0, 30),
        pass(4, 60, 300.0, 40),
    ];
    s.throttle_max_percent = 40;
    s
}

/// A disk copy whose guest outran the link: 24 MB of data and 8 MB of zeros in 12 chunks,
/// three dirty passes that sent 700 blocks again, the mirror on and holding the guest's
/// writes 40.2 ms, 100 kB left at the end.
pub(super) fn disk_copy() -> ferry_vmm::disk_copy::DiskCopyStatus {
    use ferry_vmm::disk_copy::{CopyStats, DiskCopyStatus};
    DiskCopyStatus {
        stats: CopyStats {
            chunks: 12,
            data_bytes: 24_000_000,
            zero_bytes: 8_000_000,
            granules_again: 700,
            dirty_passes: 3,
            mirror: true,
        },
        pending_bytes: 100_000,
        writers_held_ms: 40.2,
    }
}
