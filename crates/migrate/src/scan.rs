//! Zero-page detection behind one interface built for offload (as the Intel DSA series does
//! it): a sender submits a batch of page addresses and later collects its completion. The pages
//! are scanned in place in guest memory (no copy; see `Ram::is_zero_page` for why a page the
//! guest writes meanwhile is harmless), so a sender that then writes the data pages straight
//! from guest memory touches each page once. Three detectors:
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

use crate::ram::Ram;

/// Batches an offload engine accepts before `submit` blocks: two keep it busy while the sender
/// writes the batch before.
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

/// Pages of guest memory to be scanned and then sent.
#[derive(Debug)]
pub struct Batch {
    pub gpas: Vec<u64>,
    /// Filled by the completion: which pages are all zero.
    pub zero: Vec<bool>,
}

impl Batch {
    pub fn new(gpas: Vec<u64>) -> Batch {
        Batch {
            gpas,
            zero: Vec::new(),
        }
    }

    /// Scans every page in `ram` on this CPU. A page outside `ram` counts as data: the send
    /// that follows refuses it with the error that names it.
    pub fn scan_inline(&mut self, ram: &Ram) {
        self.zero = self
            .gpas
            .iter()
            .map(|&gpa| ram.is_zero_page(gpa).unwrap_or(false))
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

/// Builds the detector `kind` for one sender, over the guest memory `ram`. `fail_every`, for
/// tests, makes an offload engine report every n-th batch as failed.
pub fn detector(kind: ZeroDetection, ram: Ram, fail_every: Option<u64>) -> Box<dyn Detector> {
    match kind {
        ZeroDetection::Inline => Box::new(Immediate::inline(ram)),
        ZeroDetection::Offload => Box::new(Offload::start(ram, fail_every)),
        ZeroDetection::None => Box::new(Immediate::none(ram)),
    }
}

/// A detector that does its work in `submit` and keeps the batches in order: scanning with
/// the CPU ([`Inline`]) or marking every page as data ([`NoDetection`]).
#[derive(Debug)]
pub struct Immediate {
    done: VecDeque<Batch>,
    ram: Ram,
    scan: fn(&mut Batch, &Ram),
}

/// The sender's own CPU, vectorised.
pub type Inline = Immediate;
/// No detection: every page is data.
pub type NoDetection = Immediate;

impl Immediate {
    pub fn inline(ram: Ram) -> Immediate {
        Immediate {
            done: VecDeque::new(),
            ram,
            scan: Batch::scan_inline,
        }
    }

    pub fn none(ram: Ram) -> Immediate {
        Immediate {
            done: VecDeque::new(),
            ram,
            scan: |b, _| b.zero = vec![false; b.gpas.len()],
        }
    }
}

impl Detector for Immediate {
    fn submit(&mut self, mut batch: Batch) {
        (self.scan)(&mut batch, &self.ram);
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
    pub fn start(ram: Ram, fail_every: Option<u64>) -> Offload {
        let (work, queue) = sync_channel::<Batch>(OFFLOAD_QUEUE);
        let (finished, done) = sync_channel::<Completion>(OFFLOAD_QUEUE + 1);
        let thread = std::thread::Builder::new()
            .name("zero-offload".into())
            .spawn(move || {
                for (n, mut batch) in (1u64..).zip(queue) {
                    let ok = !fail_every.is_some_and(|k| n.is_multiple_of(k));
                    if ok {
                        batch.scan_inline(&ram);
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
    use crate::wire::PAGE_SIZE;

    /// Guest memory of 16 pages where page `i` is zero but for byte 100 of the pages listed.
    fn ram(marked: &[(u64, u8)]) -> Ram {
        let mut bytes = vec![0u8; 16 * PAGE_SIZE as usize];
        for &(page, b) in marked {
            bytes[(page * PAGE_SIZE) as usize + 100] = b;
        }
        Ram::leaked_for_test(bytes)
    }

    fn batch(pages: std::ops::Range<u64>) -> Batch {
        Batch::new(pages.map(|i| i * PAGE_SIZE).collect())
    }

    #[test]
    fn offload_completes_in_order_and_reports_injected_failures() {
        let mut d = detector(ZeroDetection::Offload, ram(&[]), Some(2));
        let mut completions = Vec::new();
        for i in 0..6 {
            d.submit(batch(2 * i..2 * i + 2));
            if d.outstanding() == 2 {
                completions.push(d.complete().unwrap());
            }
        }
        while let Some(c) = d.complete() {
            completions.push(c);
        }
        let order: Vec<u64> = completions
            .iter()
            .map(|c| c.batch.gpas[0] / PAGE_SIZE / 2)
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
        let memory = ram(&[(1, 7)]);
        for kind in [ZeroDetection::Inline, ZeroDetection::Offload] {
            let mut d = detector(kind, memory.clone(), None);
            d.submit(batch(0..3));
            let c = d.complete().unwrap();
            assert!(c.ok);
            assert_eq!(c.batch.zero, vec![true, false, true], "{kind:?}");
        }
        let mut d = detector(ZeroDetection::None, memory, None);
        d.submit(batch(0..2));
        assert_eq!(d.complete().unwrap().batch.zero, vec![false, false]);
    }

    #[test]
    fn a_page_outside_ram_is_data_for_the_send_to_refuse() {
        let mut d = detector(ZeroDetection::Inline, ram(&[]), None);
        d.submit(Batch::new(vec![0, 64 * PAGE_SIZE]));
        assert_eq!(d.complete().unwrap().batch.zero, vec![true, false]);
    }

    #[test]
    fn failed_offload_batches_are_marked_for_the_cpu() {
        let mut d = detector(ZeroDetection::Offload, ram(&[]), Some(1));
        d.submit(batch(0..1));
        let c = d.complete().unwrap();
        assert!(
            !c.ok && c.batch.zero.is_empty(),
            "the engine did not scan it"
        );
    }
}
