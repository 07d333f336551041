//! Postcopy's requested pages served by the thread that reads the requests. With the preempt
//! connection, the main connection's reader queues a request's whole host pages straight on
//! the preempt connection's sender ([`Lane::forward`]), where it used to hand the request to
//! the migration thread, which may be waiting for a core: `ferry bench postcopy` measured that
//! hand-off as most of the source's part of a request's latency. Without it, once the guest
//! runs on the destination the requested pages go on the main connection itself
//! (`MAIN_PAGES`), and the reader writes them there ([`Way::Main`]), through the one writer the
//! migration thread writes that connection with meanwhile, each record whole and flushed
//! under its lock. The migration thread still takes every request: it takes the forwarded
//! pages out of what is still to send (so that the background walk does not send them again),
//! counts them, and sends the readahead window.
//!
//! A page may then go twice (the walk had queued it, or took it meanwhile); the destination
//! installs the first copy and drops the second, as it does for any resent page, and the
//! bytes cannot differ: the guest no longer runs here.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::sender::{self, ChannelMsg, Queue, try_queue};
use crate::conn::Conn;
use crate::ram::Ram;
use crate::wire::{Latencies, MAX_PAGES_PER_RECORD, PAGE_SIZE};

/// A requested run as the reader queues it for the migration thread: whether it forwarded
/// the run's pages already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Requested {
    pub(crate) gpa: u64,
    pub(crate) pages: u64,
    pub(crate) forwarded: bool,
}

/// Where the reader sends requested pages itself, guest RAM to check a run against, and the
/// destination's host page in wire pages.
#[derive(Debug)]
pub(crate) struct Lane {
    pub(crate) way: Way,
    pub(crate) ram: Ram,
    pub(crate) unit_pages: u64,
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
        match &self.way {
            Way::Preempt { queue, forwarded } => {
                match try_queue(queue, ChannelMsg::Urgent(gpas, asked)) {
                    Ok(None) => {
                        forwarded.fetch_add(count, Ordering::Relaxed);
                        true
                    }
                    Ok(Some(_)) | Err(_) => false,
                }
            }
            Way::Main(main) => main.write(&self.ram, &gpas, asked),
        }
    }
}

/// Where a lane sends.
#[derive(Debug)]
pub(crate) enum Way {
    /// Onto the preempt connection's sender queue (empty once the sender finishes), counting
    /// the pages in the pool's count of those queued this way.
    Preempt {
        queue: Queue,
        forwarded: Arc<AtomicU64>,
    },
    /// Onto the main connection, through the writer the migration thread shares.
    Main(Arc<MainOut>),
}

/// The main connection's writer in postcopy without the preempt connection, shared by the
/// migration thread and the reader: each writes a record whole and flushes it under the lock,
/// so records never interleave. Empty once the migration thread took it back (it then writes
/// Complete on its own connection, after everything written here).
#[derive(Debug)]
pub(crate) struct MainOut(Mutex<Option<MainWriter>>);

/// A writer on the main connection and what went through it.
#[derive(Debug)]
pub(crate) struct MainWriter {
    pub(crate) conn: Conn,
    pub(crate) checksum_pages: bool,
    /// Pages written by the reader (the migration thread counts its own).
    pub(crate) forwarded_pages: u64,
    /// Request to pages written, for the reader's (the pool's turnaround).
    pub(crate) turnaround: Arc<Mutex<Latencies>>,
}

impl MainOut {
    pub(crate) fn new(writer: MainWriter) -> MainOut {
        MainOut(Mutex::new(Some(writer)))
    }

    /// Writes the pages `gpas` and flushes, asked for at `asked`; whether it did. A failed write
    /// empties the writer (the connection is broken: its next user learns it on its own).
    fn write(&self, ram: &Ram, gpas: &[u64], asked: Instant) -> bool {
        let mut slot = self.0.lock().unwrap();
        let Some(w) = slot.as_mut() else {
            return false;
        };
        let written = sender::write_pages(&mut w.conn, ram, gpas, w.checksum_pages)
            .and_then(|()| w.conn.flush("sending requested pages"));
        if written.is_err() {
            *slot = None;
            return false;
        }
        w.forwarded_pages += gpas.len() as u64;
        let us = asked.elapsed().as_micros() as u64;
        w.turnaround.lock().unwrap().add(us);
        true
    }

    /// Runs `f` on the writer, if it is still there.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut MainWriter) -> T) -> Option<T> {
        self.0.lock().unwrap().as_mut().map(f)
    }

    /// Takes the writer back: nothing is written through it after this returns.
    pub(crate) fn take(&self) -> Option<MainWriter> {
        self.0.lock().unwrap().take()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;

    use super::*;

    const P: u64 = PAGE_SIZE;

    fn lane(unit_pages: u64, depth: usize) -> (Lane, std::sync::mpsc::Receiver<ChannelMsg>) {
        let (tx, rx) = sync_channel(depth);
        let lane = Lane {
            way: Way::Preempt {
                queue: Arc::new(Mutex::new(Some(tx))),
                forwarded: Arc::default(),
            },
            ram: Ram::leaked_for_test(vec![0; (1024 * P) as usize]),
            unit_pages,
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
        let Way::Preempt { forwarded, .. } = &small.way else {
            unreachable!()
        };
        assert_eq!(forwarded.load(Ordering::Relaxed), 2);
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
        let Way::Preempt { queue, forwarded } = &l.way else {
            unreachable!()
        };
        *queue.lock().unwrap() = None;
        assert!(!l.forward(3 * P, 1, now));
        assert_eq!(forwarded.load(Ordering::Relaxed), 1);
    }
}
