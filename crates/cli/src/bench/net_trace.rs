//! `ferry bench net --trace FILE`: where each move's time and frames went, one JSON line a
//! move. For each move, the NIC's first steps after the resume (`since_open` in `GET /vm`:
//! the gate opened, the first receive turn, the first frame given to the guest and the thread
//! that gave it, the first frame the guest sent), then the first echo the stream saw, all in
//! ms from the guest's resume; the destination's NIC and guest counters a second after it;
//! and each lost frame: its send against the pause window, and
//! where the bridge delivered it, watched on both taps ([`TapWatch`]: the kernel's stamp of
//! each echo request it passes to a tap, and of each announce it floods to one).
//!
//! Beside them, the host's run queue (`/proc/loadavg`'s runnable tasks, sampled every
//! millisecond, [`RunQueue`]) from the pause to the first echo: on a 2-core host shared with
//! builds, a move whose steps are slow is one where more tasks wanted the cores than there are.
//!
//! The watch costs a thread a tap reading every frame, so it runs only when asked.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_guest_abi::net::{ETHERTYPE_IPV4, ETHERTYPE_RARP, parse_request};
use ferry_migrate_testkit::netns::{EchoRun, PacketSocket, WallToInstant};
use serde_json::{Value, json};

use super::net_measure::Marks;
use super::net_segment::{PORT, Segment, TAPS};

/// What one tap was given: each echo request (its number, the kernel's stamp) and each
/// announce (its stamp).
#[derive(Default)]
struct Given {
    requests: HashMap<u64, Instant>,
    announces: Vec<Instant>,
}

/// The echo requests and announces the bridge passes to each of [`TAPS`], watched until
/// dropped.
pub(super) struct TapWatch {
    stop: Arc<AtomicBool>,
    given: Vec<Arc<Mutex<Given>>>,
    threads: Vec<JoinHandle<()>>,
}

impl TapWatch {
    pub fn start(segment: &Segment) -> anyhow::Result<TapWatch> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut given = Vec::new();
        let mut threads = Vec::new();
        for tap in TAPS {
            let socket = segment
                .ns
                .enter(|| PacketSocket::bind(tap))
                .with_context(|| format!("a packet socket on {tap}"))?;
            // Asking for a stamp once turns the kernel's stamping on for every later frame.
            let _ = socket.last_stamp();
            let seen: Arc<Mutex<Given>> = Arc::default();
            let (stop, into) = (stop.clone(), seen.clone());
            threads.push(std::thread::spawn(move || watch(&socket, &stop, &into)));
            given.push(seen);
        }
        Ok(TapWatch {
            stop,
            given,
            threads,
        })
    }

    /// The tap request `seq` was given to, and when.
    fn delivered(&self, seq: u64) -> Option<(usize, Instant)> {
        self.given.iter().enumerate().find_map(|(i, g)| {
            let at = *g.lock().unwrap().requests.get(&seq)?;
            Some((i, at))
        })
    }

    /// The first announce flooded to tap `i` at or after `t`.
    fn announce_after(&self, i: usize, t: Instant) -> Option<Instant> {
        let g = self.given[i].lock().unwrap();
        g.announces.iter().copied().filter(|&a| a >= t).min()
    }
}

impl Drop for TapWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Reads the frames passing one tap: an echo request going to the guest, or an announce.
fn watch(socket: &PacketSocket, stop: &AtomicBool, into: &Mutex<Given>) {
    let clocks = WallToInstant::now();
    while !stop.load(Ordering::Relaxed) {
        let Ok(Some(f)) = socket.recv(Duration::from_millis(100)) else {
            continue;
        };
        let Some(kind) = f.get(12..14).map(|b| u16::from_be_bytes([b[0], b[1]])) else {
            continue;
        };
        let stamp = socket
            .last_stamp()
            .map_or_else(|_| Instant::now(), |s| clocks.instant(s));
        match kind {
            ETHERTYPE_RARP => into.lock().unwrap().announces.push(stamp),
            ETHERTYPE_IPV4 => {
                if let Some(seq) = request_seq(&f) {
                    into.lock().unwrap().requests.insert(seq, stamp);
                }
            }
            _ => {}
        }
    }
}

/// The number of the echo request in an Ethernet frame (IPv4, UDP to the guest's port).
fn request_seq(f: &[u8]) -> Option<u64> {
    let ip = f.get(14..)?;
    let ihl = usize::from(ip.first()? & 0xf) * 4;
    if *ip.get(9)? != 17 {
        return None;
    }
    let udp = ip.get(ihl..)?;
    let dst = u16::from_be_bytes([*udp.get(2)?, *udp.get(3)?]);
    (dst == PORT).then_some(())?;
    parse_request(udp.get(8..)?).map(|r| r.seq)
}

/// `b - a` in ms, negative when `b` came first.
fn ms(a: Instant, b: Instant) -> f64 {
    match b >= a {
        true => (b - a).as_secs_f64() * 1e3,
        false => -(a - b).as_secs_f64() * 1e3,
    }
}

/// How often [`RunQueue`] looks: a millisecond, the scale of the steps it explains.
const RUN_QUEUE_EVERY: Duration = Duration::from_millis(1);

/// The host's runnable tasks (the 4th field of `/proc/loadavg`, before its `/`), sampled
/// every [`RUN_QUEUE_EVERY`] until dropped.
struct RunQueue {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(Instant, u32)>>>,
    thread: Option<JoinHandle<()>>,
}

impl RunQueue {
    fn start() -> RunQueue {
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<(Instant, u32)>>> = Arc::default();
        let thread = {
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(n) = runnable() {
                        seen.lock().unwrap().push((Instant::now(), n));
                    }
                    std::thread::sleep(RUN_QUEUE_EVERY);
                }
            })
        };
        RunQueue {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    /// The median and the largest run queue seen from `a` to `b`.
    fn between(&self, a: Instant, b: Instant) -> Option<[u32; 2]> {
        let mut v: Vec<u32> = (self.seen.lock().unwrap().iter())
            .filter(|(t, _)| *t >= a && *t <= b)
            .map(|&(_, n)| n)
            .collect();
        v.sort_unstable();
        Some([*v.get(v.len() / 2)?, *v.last()?])
    }
}

impl Drop for RunQueue {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runnable tasks now (the sampler itself is one of them).
fn runnable() -> Option<u32> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    s.split_whitespace().nth(3)?.split('/').next()?.parse().ok()
}

/// The trace file, the taps' watch and the run queue's.
pub(super) struct Trace {
    file: Mutex<std::fs::File>,
    taps: TapWatch,
    run_queue: RunQueue,
}

impl Trace {
    pub fn start(segment: &Segment, path: &std::path::Path) -> anyhow::Result<Trace> {
        let file = std::fs::File::create(path)
            .with_context(|| format!("--trace {}: cannot create it", path.display()))?;
        Ok(Trace {
            file: Mutex::new(file),
            taps: TapWatch::start(segment)?,
            run_queue: RunQueue::start(),
        })
    }

    /// One line a move of `row`: its steps from the resume, and its lost frames.
    pub fn moves(&self, row: &str, run: &EchoRun, marks: &[Marks], end: Instant) {
        let lost = run.lost();
        let mut out = self.file.lock().unwrap();
        for (i, m) in marks.iter().enumerate() {
            let until = marks.get(i + 1).map_or(end, |n| n.begun);
            let end_w = m.window_end();
            let lost_here: Vec<Value> = lost
                .iter()
                .filter(|&&s| {
                    let t = run.sent[s as usize - 1];
                    t >= m.begun && t < until
                })
                .map(|&s| self.lost_frame(run, s, m))
                .collect();
            let first_echo = run.first_echo_after(m.resumed);
            let steps: serde_json::Map<String, Value> = m
                .steps
                .iter()
                .map(|(name, t)| (name.clone(), json!(ms(m.resumed, *t))))
                .collect();
            let line = json!({
                "row": row, "move": i + 1,
                "pause_ms": ms(m.paused, m.resumed),
                "window_end_ms": ms(m.resumed, end_w),
                "announce_ms": m.announce.map(|a| ms(m.resumed, a)),
                "steps_ms": steps, "steps_on": m.rx_on,
                "first_echo_ms": first_echo.map(|t| ms(m.resumed, t)),
                "run_queue": self.run_queue.between(m.paused, first_echo.unwrap_or(m.resumed)),
                "lost": lost_here,
                "counters": m.counters,
            });
            let _ = writeln!(out, "{line}");
        }
    }

    /// One lost frame: its send (the call's start and return) from the window's end, and the
    /// tap it was given to, when, and that tap's first announce after the pause.
    fn lost_frame(&self, run: &EchoRun, seq: u64, m: &Marks) -> Value {
        let end_w = m.window_end();
        let sent = run.sent[seq as usize - 1];
        let done = run.sent_done.get(seq as usize - 1).copied().unwrap_or(sent);
        let (tap, given, announce) = match self.taps.delivered(seq) {
            Some((i, at)) => (
                Some(TAPS[i]),
                Some(ms(end_w, at)),
                self.taps.announce_after(i, m.paused).map(|a| ms(end_w, a)),
            ),
            None => (None, None, None),
        };
        json!({"seq": seq, "sent_ms": ms(end_w, sent), "sent_done_ms": ms(end_w, done),
            "paused_ms": ms(end_w, m.paused),
            "tap": tap, "given_ms": given, "tap_announce_ms": announce})
    }
}
