//! Zero-page detection behind one interface built for offload (as the Intel DSA series does
//! it): a sender submits a batch of pages and later collects its completion. Three detectors:
//!
//! - [`Inline`]: the sender's own CPU, vectorised ([`crate::zero`]); completes at once.
//! - [`Offload`]: a dedicated scanning thread with a work queue and a completion queue; a
//!   completion may report failure, and the sender then scans that batch itself. A hardware
//!   engine slots in here behind the same trait.
//! - [`NoDetection`]: every page is data (`--zero-detection none`, for measurements).

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};

use crate::wire::PAGE_SIZE;

/// Batches an offload engine accepts before `submit` blocks: two keep it busy while the sender
/// copies the next batch.
const OFFLOAD_QUEUE: usize = 2;

/// Which detector a migration uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ZeroDetection {
    #[default]
    Inline,
    Offload,
    None,
}

/// Pages copied out of guest memory, to be scanned and then sent.
#[derive(Debug)]
pub struct Batch {
    pub gpas: Vec<u64>,
    /// `gpas.len()` pages of data.
    pub data: Vec<u8>,
    /// Filled by the completion: which pages are all zero.
    pub zero: Vec<bool>,
}

impl Batch {
    pub fn page(&self, i: usize) -> &[u8] {
        &self.data[i * PAGE_SIZE as usize..(i + 1) * PAGE_SIZE as usize]
    }

    /// Scans every page on this CPU.
    pub fn scan_inline(&mut self) {
        self.zero = (0..self.gpas.len())
            .map(|i| crate::zero::is_zero(self.page(i)))
            .collect();
    }
}

/// What came back for a batch.
#[derive(Debug)]
pub struct Completion {
    pub batch: Batch,
    /// False if the engine could not scan the batch: the caller must scan it itself.
    pub ok: bool,
}

/// A zero-page detector: submit batches, collect completions in submission order.
pub trait Detector: Send {
    fn submit(&mut self, batch: Batch);
    /// The oldest outstanding batch's completion; `None` when nothing is outstanding.
    fn complete(&mut self) -> Option<Completion>;
    /// Batches submitted and not yet collected.
    fn outstanding(&self) -> usize;
}

/// Builds the detector `kind` for one sender. `fail_every`, for tests, makes an offload engine
/// report every n-th batch as failed.
pub fn detector(kind: ZeroDetection, fail_every: Option<u64>) -> Box<dyn Detector> {
    match kind {
        ZeroDetection::Inline => Box::new(Immediate::inline()),
        ZeroDetection::Offload => Box::new(Offload::start(fail_every)),
        ZeroDetection::None => Box::new(Immediate::none()),
    }
}

/// A detector that does its work in `submit` and keeps the batches in order: scanning with
/// the CPU ([`Inline`]) or marking every page as data ([`NoDetection`]).
#[derive(Debug)]
pub struct Immediate {
    done: VecDeque<Batch>,
    scan: fn(&mut Batch),
}

/// The sender's own CPU, vectorised.
pub type Inline = Immediate;
/// No detection: every page is data.
pub type NoDetection = Immediate;

impl Immediate {
    pub fn inline() -> Immediate {
        Immediate {
            done: VecDeque::new(),
            scan: Batch::scan_inline,
        }
    }

    pub fn none() -> Immediate {
        Immediate {
            done: VecDeque::new(),
            scan: |b| b.zero = vec![false; b.gpas.len()],
        }
    }
}

impl Detector for Immediate {
    fn submit(&mut self, mut batch: Batch) {
        (self.scan)(&mut batch);
        self.done.push_back(batch);
    }
    fn complete(&mut self) -> Option<Completion> {
        self.done
            .pop_front()
            .map(|batch| Completion { batch, ok: true })
    }
    fn outstanding(&self) -> usize {
        self.done.len()
    }
}

/// A scanning thread fed through a bounded work queue, answering through a completion queue.
/// One thread per engine keeps completions in submission order.
#[derive(Debug)]
pub struct Offload {
    work: Option<SyncSender<Batch>>,
    done: Receiver<Completion>,
    thread: Option<JoinHandle<()>>,
    outstanding: usize,
}

impl Offload {
    pub fn start(fail_every: Option<u64>) -> Offload {
        let (work, queue) = sync_channel::<Batch>(OFFLOAD_QUEUE);
        let (finished, done) = sync_channel::<Completion>(OFFLOAD_QUEUE + 1);
        let thread = std::thread::Builder::new()
            .name("zero-offload".into())
            .spawn(move || {
                for (n, mut batch) in (1u64..).zip(queue) {
                    let ok = !fail_every.is_some_and(|k| n.is_multiple_of(k));
                    if ok {
                        batch.scan_inline();
                    }
                    if finished.send(Completion { batch, ok }).is_err() {
                        break;
                    }
                }
            })
            .expect("cannot start the zero-scan offload thread");
        Offload {
            work: Some(work),
            done,
            thread: Some(thread),
            outstanding: 0,
        }
    }
}

impl Detector for Offload {
    fn submit(&mut self, batch: Batch) {
        let sent = self.work.as_ref().map(|w| w.send(batch));
        assert!(matches!(sent, Some(Ok(()))), "the offload thread is gone");
        self.outstanding += 1;
    }
    fn complete(&mut self) -> Option<Completion> {
        if self.outstanding == 0 {
            return None;
        }
        self.outstanding -= 1;
        self.done.recv().ok()
    }
    fn outstanding(&self) -> usize {
        self.outstanding
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        drop(self.work.take());
        while self.done.try_recv().is_ok() {}
        if let Some(t) = self.thread.take() {
            // Unblock a thread waiting to deliver a completion, then join it.
            while !t.is_finished() {
                while self.done.try_recv().is_ok() {}
                std::thread::yield_now();
            }
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(pages: &[u8]) -> Batch {
        let mut data = vec![0u8; pages.len() * PAGE_SIZE as usize];
        for (i, &b) in pages.iter().enumerate() {
            data[i * PAGE_SIZE as usize + 100] = b;
        }
        Batch {
            gpas: (0..pages.len() as u64).map(|i| i * PAGE_SIZE).collect(),
            data,
            zero: Vec::new(),
        }
    }

    #[test]
    fn offload_completes_in_order_and_reports_injected_failures() {
        let mut d = detector(ZeroDetection::Offload, Some(2));
        let mut completions = Vec::new();
        for i in 0..6u8 {
            d.submit(batch(&[0, i]));
            if d.outstanding() == 2 {
                completions.push(d.complete().unwrap());
            }
        }
        while let Some(c) = d.complete() {
            completions.push(c);
        }
        let order: Vec<u8> = completions
            .iter()
            .map(|c| c.batch.data[PAGE_SIZE as usize + 100])
            .collect();
        assert_eq!(
            order,
            vec![0, 1, 2, 3, 4, 5],
            "completions come back in submission order"
        );
        let failed: Vec<bool> = completions.iter().map(|c| !c.ok).collect();
        assert_eq!(failed, vec![false, true, false, true, false, true]);
    }

    #[test]
    fn every_detector_finds_the_zero_pages() {
        for kind in [ZeroDetection::Inline, ZeroDetection::Offload] {
            let mut d = detector(kind, None);
            d.submit(batch(&[0, 7, 0]));
            let c = d.complete().unwrap();
            assert!(c.ok);
            assert_eq!(c.batch.zero, vec![true, false, true], "{kind:?}");
        }
        let mut d = detector(ZeroDetection::None, None);
        d.submit(batch(&[0, 7]));
        assert_eq!(d.complete().unwrap().batch.zero, vec![false, false]);
    }

    #[test]
    fn failed_offload_batches_are_marked_for_the_cpu() {
        let mut d = detector(ZeroDetection::Offload, Some(1));
        d.submit(batch(&[0]));
        let c = d.complete().unwrap();
        assert!(
            !c.ok && c.batch.zero.is_empty(),
            "the engine did not scan it"
        );
    }
}
