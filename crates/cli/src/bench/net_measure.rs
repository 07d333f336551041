//! What `ferry bench net` makes of one row's echo stream: each move's marks on the host's clock
//! (its request, the guest's pause, the first announce seen at the bridge) turned into the
//! figures the table shows, as pure functions over the [`EchoRun`] the stream recorded.
//!
//! A row's time is cut into segments, one a move: from the move's request to the next move's
//! (the last to the stream's stop). A frame belongs to the segment it was sent in. Its **pause
//! window** runs from the pause's start to the later of the resume and the first announce frame
//! seen at the bridge after the pause began: a frame sent in it may be lost (the guest runs
//! nowhere, or the bridge still sends its frames to the old tap until the announce teaches it
//! the new one), a frame sent outside it may not. A frame's send is the span of its `send_to`
//! call (the bridge chose its port within it, see [`EchoRun::sent`]): it is outside the window
//! only when that whole span is.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_migrate_testkit::netns::EchoRun;

/// One move's marks on the host's clock.
#[derive(Clone, Debug)]
pub(super) struct Marks {
    /// The migration's request.
    pub begun: Instant,
    /// The guest's pause: from its start to its resume.
    pub paused: Instant,
    pub resumed: Instant,
    /// The first announce frame for the guest's MAC the bridge saw after the pause began.
    pub announce: Option<Instant>,
    /// The downtime the source computed.
    pub downtime_ms: f64,
    /// The destination NIC's first steps after its gate opened (`since_open` in `GET /vm`),
    /// and the thread that gave the guest its first frame; for `--trace`.
    pub steps: Vec<(String, Instant)>,
    pub rx_on: Option<String>,
    /// The destination's NIC and its guest's network counters a second after the resume
    /// (`GET /vm`'s `net` and `guest.net`); for `--trace`.
    pub counters: serde_json::Value,
}

impl Marks {
    /// The end of the pause window.
    pub fn window_end(&self) -> Instant {
        self.announce.map_or(self.resumed, |a| a.max(self.resumed))
    }
}

/// One move's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Figures {
    pub lost: f64,
    /// Lost frames sent outside the pause window.
    pub lost_outside: f64,
    /// Echoes beyond the first for a frame sent in the move's segment.
    pub duplicates: f64,
    pub downtime_ms: f64,
    pub pause_ms: f64,
    /// From the resume to the first echo that came after it.
    pub first_echo_ms: Option<f64>,
    /// From the resume to the first announce frame seen at the bridge (negative: before it).
    pub announce_ms: Option<f64>,
    /// Where the frames lost outside the window were sent: the earliest's lead on the pause's
    /// start, and the latest's lag behind the window's end (ms; `None` when none was).
    pub outside_before_ms: Option<f64>,
    pub outside_after_ms: Option<f64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `b - a` in ms, negative when `b` came first.
fn signed_ms(a: Instant, b: Instant) -> f64 {
    match b >= a {
        true => ms(b - a),
        false => -ms(a - b),
    }
}

/// Each move's figures, the moves in order, the run stopped at `end`.
pub(super) fn figures(run: &EchoRun, moves: &[Marks], end: Instant) -> Vec<Figures> {
    let lost = run.lost();
    let mut echoes: HashMap<u64, u64> = HashMap::new();
    for &(seq, _) in &run.echoes {
        *echoes.entry(seq).or_default() += 1;
    }
    let sent_at = |seq: u64| run.sent[seq as usize - 1];
    let sent_by = |seq: u64| run.sent_done.get(seq as usize - 1).copied();
    moves
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let until = moves.get(i + 1).map_or(end, |n| n.begun);
            let within = |t: Instant| t >= m.begun && t < until;
            // Each lost frame's send: from the call to its return.
            let lost_here: Vec<(Instant, Instant)> = lost
                .iter()
                .map(|&s| (sent_at(s), sent_by(s).unwrap_or(sent_at(s))))
                .filter(|&(t, _)| within(t))
                .collect();
            let inside = lost_here
                .iter()
                .filter(|&&(t, by)| by >= m.paused && t <= m.window_end())
                .count();
            let duplicates: u64 = echoes
                .iter()
                .filter(|&(&seq, _)| within(sent_at(seq)))
                .map(|(_, &n)| n - 1)
                .sum();
            let before = lost_here
                .iter()
                .map(|&(_, by)| by)
                .filter(|&by| by < m.paused)
                .min();
            let after = lost_here
                .iter()
                .map(|&(t, _)| t)
                .filter(|&t| t > m.window_end())
                .max();
            Figures {
                outside_before_ms: before.map(|by| ms(m.paused - by)),
                outside_after_ms: after.map(|t| ms(t - m.window_end())),
                lost: lost_here.len() as f64,
                lost_outside: (lost_here.len() - inside) as f64,
                duplicates: duplicates as f64,
                downtime_ms: m.downtime_ms,
                pause_ms: ms(m.resumed.saturating_duration_since(m.paused)),
                first_echo_ms: run.first_echo_after(m.resumed).map(|t| ms(t - m.resumed)),
                announce_ms: m.announce.map(|a| signed_ms(m.resumed, a)),
            }
        })
        .collect()
}

/// Before the first move: the echoes' round trip (median, ms) and the frames lost.
pub(super) fn no_move(run: &EchoRun, first_move: Instant) -> (f64, u64) {
    let mut rtt: Vec<f64> = run
        .echoes
        .iter()
        .filter_map(|&(seq, at)| {
            let sent = *run.sent.get(seq as usize - 1)?;
            (sent < first_move).then(|| ms(at.saturating_duration_since(sent)))
        })
        .collect();
    let lost = run
        .lost()
        .iter()
        .filter(|&&s| run.sent[s as usize - 1] < first_move)
        .count();
    (super::process::quantile(&mut rtt, 0.5), lost as u64)
}

/// The median and the largest of `v` (`None` when `v` is empty).
pub(super) fn median_max(mut v: Vec<f64>) -> Option<[f64; 2]> {
    if v.is_empty() {
        return None;
    }
    let median = super::process::quantile(&mut v, 0.5);
    Some([median, v[v.len() - 1]])
}

/// A host `CLOCK_MONOTONIC` time in ns (the telemetry's stamps) as an [`Instant`] (which is
/// that clock on Linux, without a way to say so).
pub(super) fn from_monotonic_ns(ns: u64) -> Instant {
    let now_ns = ferry_vmm::devices::telemetry::host_monotonic_ns();
    let now = Instant::now();
    match ns <= now_ns {
        true => now - Duration::from_nanos(now_ns - ns),
        false => now + Duration::from_nanos(ns - now_ns),
    }
}

/// A wall-clock time in seconds since the epoch (QMP's event stamps) as an [`Instant`].
pub(super) fn from_epoch_seconds(s: f64) -> Instant {
    let now_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let now = Instant::now();
    match s <= now_s {
        true => now - Duration::from_secs_f64(now_s - s),
        false => now + Duration::from_secs_f64(s - now_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of `n` frames sent 1 ms apart from `t0`, echoed 0.1 ms later, but for `lost`,
    /// and `twice` echoed twice.
    fn run(t0: Instant, n: u64, lost: &[u64], twice: &[u64]) -> EchoRun {
        let sent: Vec<Instant> = (0..n).map(|i| t0 + Duration::from_millis(i)).collect();
        let mut echoes = Vec::new();
        for seq in 1..=n {
            let at = sent[seq as usize - 1] + Duration::from_micros(100);
            if !lost.contains(&seq) {
                echoes.push((seq, at));
            }
            if twice.contains(&seq) {
                echoes.push((seq, at + Duration::from_micros(10)));
            }
        }
        let sent_done = sent.iter().map(|&t| t + Duration::from_micros(5)).collect();
        EchoRun {
            start: t0,
            sent,
            sent_done,
            echoes,
        }
    }

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// A move requested at 10 ms, the guest paused 20..30 ms, the announce seen at 34 ms.
    fn paused_20_to_30_announced_at_34(t0: Instant) -> Marks {
        Marks {
            begun: at(t0, 10),
            paused: at(t0, 20),
            resumed: at(t0, 30),
            announce: Some(at(t0, 34)),
            downtime_ms: 9.0,
            steps: vec![],
            rx_on: None,
            counters: serde_json::Value::Null,
        }
    }

    #[test]
    fn a_frame_lost_within_the_pause_or_before_the_announce_is_inside_the_window() {
        let t0 = Instant::now();
        // Frames 1..=100 sent at 0..=99 ms. The move: request at 10 ms, pause 20..30 ms,
        // announce seen at 34 ms. Lost: 22 and 34 (sent at 21 and 33 ms: inside), 41 (at 40
        // ms: outside). Frame 50 is echoed twice.
        let r = run(t0, 100, &[22, 34, 41], &[50]);
        let m = paused_20_to_30_announced_at_34(t0);
        let f = figures(&r, &[m], at(t0, 200));
        assert_eq!(f.len(), 1);
        assert_eq!(
            (f[0].lost, f[0].lost_outside, f[0].duplicates),
            (3.0, 1.0, 1.0)
        );
        assert_eq!(f[0].pause_ms, 10.0);
        assert_eq!(f[0].announce_ms, Some(4.0));
        assert_eq!(
            (f[0].outside_before_ms, f[0].outside_after_ms),
            (None, Some(6.0))
        );
        let first = f[0].first_echo_ms.unwrap();
        assert!((0.0..=1.0).contains(&first), "{first}");
    }

    #[test]
    fn a_lost_frame_is_outside_the_window_only_if_its_whole_send_is() {
        let t0 = Instant::now();
        // Pause 20..30 ms, announce at 34 ms. Frame 36's call began at 33.5 ms and returned
        // at 35 ms (its thread put aside on the way back): the bridge may have chosen its port
        // before the announce, so it is inside. Frame 19's returned at 18.5 ms, frame 42's
        // began at 41 ms: both wholly outside, one each side.
        let mut r = run(t0, 100, &[19, 36, 42], &[]);
        r.sent[35] = at(t0, 33) + Duration::from_micros(500);
        r.sent_done[35] = at(t0, 35);
        r.sent_done[18] = at(t0, 18) + Duration::from_micros(500);
        let m = paused_20_to_30_announced_at_34(t0);
        let f = figures(&r, &[m], at(t0, 200));
        assert_eq!((f[0].lost, f[0].lost_outside), (3.0, 2.0));
        assert_eq!(f[0].outside_before_ms, Some(1.5));
        assert_eq!(f[0].outside_after_ms, Some(7.0));
    }

    #[test]
    fn each_lost_frame_counts_in_the_segment_it_was_sent_in() {
        let t0 = Instant::now();
        let r = run(t0, 100, &[5, 15, 60], &[]);
        let m = |begun, paused| Marks {
            begun: at(t0, begun),
            paused: at(t0, paused),
            resumed: at(t0, paused + 5),
            announce: None,
            downtime_ms: 5.0,
            steps: vec![],
            rx_on: None,
            counters: serde_json::Value::Null,
        };
        // Frame 5 (4 ms) comes before any move; 15 (14 ms) within the first's pause; 60
        // (59 ms) in the second's segment, outside its pause (70..75 ms).
        let f = figures(&r, &[m(10, 12), m(50, 70)], at(t0, 100));
        assert_eq!((f[0].lost, f[0].lost_outside), (1.0, 0.0));
        assert_eq!((f[1].lost, f[1].lost_outside), (1.0, 1.0));
        assert_eq!(f[1].announce_ms, None);
        let (rtt, lost) = no_move(&r, at(t0, 10));
        assert_eq!(lost, 1);
        assert!((rtt - 0.1).abs() < 1e-6, "{rtt}");
    }

    #[test]
    fn an_announce_before_the_resume_ends_the_window_at_the_resume() {
        let t0 = Instant::now();
        let m = Marks {
            begun: t0,
            paused: at(t0, 1),
            resumed: at(t0, 5),
            announce: Some(at(t0, 3)),
            downtime_ms: 0.0,
            steps: vec![],
            rx_on: None,
            counters: serde_json::Value::Null,
        };
        assert_eq!(m.window_end(), at(t0, 5));
        assert_eq!(signed_ms(at(t0, 5), at(t0, 3)), -2.0);
        assert_eq!(median_max(vec![3.0, 1.0, 2.0]), Some([2.0, 3.0]));
        assert_eq!(median_max(vec![]), None);
    }
}
