//! Postcopy's requested pages served by the thread that reads the requests. With the preempt
//! connection, the main connection's reader queues a request's whole host pages straight on
//! the preempt connection's sender ([`Lane::forward`]), where it used to hand the request to
//! the migration thread, which may be waiting for a core: `ferry bench postcopy` measured that
//! hand-off as most of the source's part of a request's latency. The migration thread still
//! takes every request: it takes the forwarded pages out of what is still to send (so that the
//! background walk does not send them again), counts them, and sends the readahead window.
//!
//! A page may then go twice (the walk had queued it, or took it meanwhile); the destination
//! installs the first copy and drops the second, as it does for any resent page, and the
//! bytes cannot differ: the guest no longer runs here.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::sender::{ChannelMsg, Queue, try_queue};
use crate::ram::Ram;
use crate::wire::{MAX_PAGES_PER_RECORD, PAGE_SIZE};

/// A requested run as the reader queues it for the migration thread: whether it forwarded
/// the run's pages already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Requested {
    pub(crate) gpa: u64,
    pub(crate) pages: u64,
    pub(crate) forwarded: bool,
}

/// Where the reader queues requested pages itself: the preempt connection's sender queue
/// (empty once the sender finishes), guest RAM to check a run against, the destination's host
/// page in wire pages, and the pool's count of pages queued this way.
#[derive(Debug)]
pub(crate) struct Lane {
    pub(crate) queue: Queue,
    pub(crate) ram: Ram,
    pub(crate) unit_pages: u64,
    pub(crate) forwarded: Arc<AtomicU64>,
}

impl Lane {
    /// Queues the whole host pages of the requested run `(gpa, pages)`, asked for at `asked`,
    /// if the run is RAM, fits one record, and the queue has room; whether it did. A run it
    /// does not take is the migration thread's, as without a lane.
    pub(crate) fn forward(&self, gpa: u64, pages: u64, asked: Instant) -> bool {
        let unit = self.unit_pages * PAGE_SIZE;
        let Some(end) = pages
            .checked_mul(PAGE_SIZE)
            .and_then(|b| gpa.checked_add(b))
            .map(|e| e.next_multiple_of(unit))
        else {
            return false;
        };
        let start = gpa - gpa % unit;
        let count = (end - start) / PAGE_SIZE;
        if pages == 0
            || count > u64::from(MAX_PAGES_PER_RECORD)
            || self.ram.check_run(start, count).is_err()
        {
            return false;
        }
        let gpas: Vec<u64> = (start..end).step_by(PAGE_SIZE as usize).collect();
        match try_queue(&self.queue, ChannelMsg::Urgent(gpas, asked)) {
            Ok(None) => {
                self.forwarded.fetch_add(count, Ordering::Relaxed);
                true
            }
            Ok(Some(_)) | Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::mpsc::sync_channel;

    use super::*;

    const P: u64 = PAGE_SIZE;

    fn lane(unit_pages: u64, depth: usize) -> (Lane, std::sync::mpsc::Receiver<ChannelMsg>) {
        let (tx, rx) = sync_channel(depth);
        let lane = Lane {
            queue: Arc::new(Mutex::new(Some(tx))),
            ram: Ram::leaked_for_test(vec![0; (1024 * P) as usize]),
            unit_pages,
            forwarded: Arc::default(),
        };
        (lane, rx)
    }

    fn pages(msg: ChannelMsg) -> Vec<u64> {
        match msg {
            ChannelMsg::Urgent(gpas, _) => gpas,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_requested_run_is_queued_in_whole_host_pages_when_it_fits() {
        let now = Instant::now();
        let (small, rx) = lane(1, 4);
        assert!(small.forward(3 * P, 2, now));
        assert_eq!(pages(rx.try_recv().unwrap()), vec![3 * P, 4 * P]);
        assert_eq!(small.forwarded.load(Ordering::Relaxed), 2);
        // On 2 MiB host pages, the whole unit around the faulted page.
        let (huge, rx) = lane(512, 4);
        assert!(huge.forward(600 * P, 1, now));
        let got = pages(rx.try_recv().unwrap());
        assert_eq!((got.len(), got[0]), (512, 512 * P));
    }

    #[test]
    fn a_run_it_cannot_take_is_left_to_the_migration_thread() {
        let now = Instant::now();
        let (l, rx) = lane(1, 1);
        // Outside RAM, empty, or more than a record.
        assert!(!l.forward(4096 * P, 1, now));
        assert!(!l.forward(0, 0, now));
        assert!(!l.forward(0, 513, now));
        assert!(!l.forward(u64::MAX - P, 2, now));
        // A full queue, then a finished sender.
        assert!(l.forward(0, 1, now));
        assert!(!l.forward(P, 1, now));
        drop(rx);
        assert!(!l.forward(2 * P, 1, now));
        *l.queue.lock().unwrap() = None;
        assert!(!l.forward(3 * P, 1, now));
        assert_eq!(l.forwarded.load(Ordering::Relaxed), 1);
    }
}
