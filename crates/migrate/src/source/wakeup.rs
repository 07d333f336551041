//! The postcopy push's wake-up: the migration thread, whose every data channel's queue is
//! full, waits on it for whichever comes first, a page request (the main connection's reader
//! rings it) or room in a queue (a sender rings it as it takes a batch). A wait for room alone,
//! polled every millisecond, left a sender idle for most of a millisecond each time its queue
//! ran dry: at ~2.5 GB/s a channel drains its queue of four 512 KiB batches in ~0.8 ms.
//! Measured (`ferry bench postcopy --blocktime`, in order, its push stages): with the poll the
//! migration thread's waits averaged 1.35-1.72 ms and the senders were idle 40-47% of the
//! push; with this wake, 20-32%.
//!
//! A counter under the lock makes the wait lose no ring: the waiter reads the count before it
//! looks at the queues, and waits only while the count is still what it read.

#![forbid(unsafe_code)]

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Rung by the reader and the senders, waited on by the migration thread; clones share it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Wakeup(Arc<(Mutex<u64>, Condvar)>);

impl Wakeup {
    /// Something the migration thread may act on happened.
    pub(crate) fn ring(&self) {
        let (count, rung) = &*self.0;
        *count.lock().unwrap() += 1;
        rung.notify_all();
    }

    /// The rings so far: what a later [`Wakeup::wait`] compares with.
    pub(crate) fn seen(&self) -> u64 {
        *self.0.0.lock().unwrap()
    }

    /// Waits until a ring after `seen`, or `timeout`.
    pub(crate) fn wait(&self, seen: u64, timeout: Duration) {
        let (count, rung) = &*self.0;
        let deadline = Instant::now() + timeout;
        let mut c = count.lock().unwrap();
        while *c == seen {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            c = rung.wait_timeout(c, deadline - now).unwrap().0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_between_the_look_and_the_wait_is_not_lost() {
        let w = Wakeup::default();
        let seen = w.seen();
        w.ring();
        let t = Instant::now();
        w.wait(seen, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn a_ring_from_another_thread_ends_the_wait_and_silence_times_out() {
        let w = Wakeup::default();
        let t = Instant::now();
        w.wait(w.seen(), Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(20));
        let other = w.clone();
        let seen = w.seen();
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            other.ring();
        });
        let t = Instant::now();
        w.wait(seen, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        ringer.join().unwrap();
    }
}
