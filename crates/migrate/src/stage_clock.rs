//! Where postcopy's background stream spends its time, stage by stage, on each side: the
//! threads that do a stage add the wall time (and for the stages that may block on a socket,
//! the thread's CPU time) they spent in it, and the statistics show the sums
//! ([`PushStages`], [`IntakeStages`]; `ferry bench postcopy --blocktime` prints them).
//!
//! Read as a pipeline: a stage whose threads spend the push's whole time busy is the one that
//! bounds it, and the stages after it wait (a receiver that waits for a record is starved; a
//! sender whose writes take more wall time than CPU waits for room in its socket).
//!
//! The clocks are a few relaxed atomic adds per batch of pages (hundreds of KiB), and the
//! thread-CPU reads two `clock_gettime` calls per write: nothing a page pays for.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One stage's sums, as the statistics carry them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    /// Wall time the stage's threads spent in it, summed over them (ms).
    pub ms: f64,
    /// Their CPU time in it (ms), where measured (0 where not).
    #[serde(default)]
    pub cpu_ms: f64,
    /// Times the stage ran (batches, records, waits).
    pub count: u64,
}

/// The source's side of the background push, from its first batch on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PushStages {
    /// From the first background batch taken to the destination's Done (ms): the push's time.
    pub ms: f64,
    /// Bytes written on every connection in that time.
    pub bytes: u64,
    /// From the first background batch to the last page written into a socket (ms).
    pub written_ms: f64,
    /// The migration thread taking pages out of the bitmap in the walk's order.
    pub walk: StageTime,
    /// The migration thread waiting for room in a data channel's queue (all full).
    pub room_wait: StageTime,
    /// The migration thread serving requests (their pick and queueing).
    pub serve: StageTime,
    /// The data channels' senders waiting for a batch (their queues empty).
    pub sender_idle: StageTime,
    /// The senders' zero scan of the batches.
    pub scan: StageTime,
    /// The senders' writes (the kernel copies the pages out of guest memory into the socket;
    /// wall above CPU is time waiting for room in the socket).
    pub write: StageTime,
}

/// The destination's side of the background stream, from the switch on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IntakeStages {
    /// The data channels' receivers waiting for a record (nothing in their sockets).
    pub idle: StageTime,
    /// Reading the records' page data out of the sockets.
    pub read: StageTime,
    /// Placing the pages (the copies into memory and the userfaultfd calls that map them).
    pub install: StageTime,
    /// Waking the threads that wait for them.
    pub wake: StageTime,
}

/// A stage's running sums, shared by the threads that do it.
#[derive(Debug, Default)]
pub(crate) struct StageSum {
    wall_ns: AtomicU64,
    cpu_ns: AtomicU64,
    count: AtomicU64,
}

impl StageSum {
    /// Adds one run of the stage that began at `since`.
    pub(crate) fn since(&self, since: Instant) {
        self.add(since.elapsed(), 0);
    }

    /// Adds one run of the stage: its wall time and (0 if not measured) its CPU time.
    pub(crate) fn add(&self, wall: Duration, cpu_ns: u64) {
        self.wall_ns
            .fetch_add(wall.as_nanos() as u64, Ordering::Relaxed);
        self.cpu_ns.fetch_add(cpu_ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn time(&self) -> StageTime {
        StageTime {
            ms: self.wall_ns.load(Ordering::Relaxed) as f64 / 1e6,
            cpu_ms: self.cpu_ns.load(Ordering::Relaxed) as f64 / 1e6,
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// The source's push clocks (the migration thread's and the senders').
#[derive(Debug, Default)]
pub(crate) struct PushClock {
    pub(crate) walk: StageSum,
    pub(crate) room_wait: StageSum,
    pub(crate) serve: StageSum,
    pub(crate) sender_idle: StageSum,
    pub(crate) scan: StageSum,
    pub(crate) write: StageSum,
}

impl PushClock {
    /// The sums so far, with the push's time and bytes filled by the caller.
    pub(crate) fn stages(&self) -> PushStages {
        PushStages {
            walk: self.walk.time(),
            room_wait: self.room_wait.time(),
            serve: self.serve.time(),
            sender_idle: self.sender_idle.time(),
            scan: self.scan.time(),
            write: self.write.time(),
            ..PushStages::default()
        }
    }
}

/// The destination's intake clocks (the receivers').
#[derive(Debug, Default)]
pub(crate) struct IntakeClock {
    pub(crate) idle: StageSum,
    pub(crate) read: StageSum,
    pub(crate) install: StageSum,
    pub(crate) wake: StageSum,
}

impl IntakeClock {
    pub(crate) fn stages(&self) -> IntakeStages {
        IntakeStages {
            idle: self.idle.time(),
            read: self.read.time(),
            install: self.install.time(),
            wake: self.wake.time(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_sums_its_runs_wall_and_cpu() {
        let s = StageSum::default();
        s.add(Duration::from_micros(1500), 1_000_000);
        s.add(Duration::from_micros(500), 0);
        let t = s.time();
        assert_eq!(t.count, 2);
        assert!((t.ms - 2.0).abs() < 1e-9, "{t:?}");
        assert!((t.cpu_ms - 1.0).abs() < 1e-9, "{t:?}");
    }
}
