//! Zero-page detection behind one interface built for offload (as the Intel DSA series does
//! it): a sender submits a batch of page addresses and later collects its completion. The pages
//! are scanned in place in guest memory (no copy; see [`Ram::is_zero_page`] for why a page the
//! guest writes meanwhile is harmless), so a sender that then writes the data pages straight
//! from guest memory touches each page once.
//!
//! A detector is a [`ZeroDetector`], one per sending thread (each data channel, and postcopy's
//! preempt connection, runs on a thread of its own), built there by the migration's
//! [`ZeroDetectorFactory`], which [`SourceParams::zero`](crate::SourceParams::zero) carries.
//! The engine's own detectors are what a [`ZeroDetection`] choice (`--zero-detection`) builds:
//!
//! - [`Inline`]: the sender's own CPU, vectorised ([`crate::zero`]); completes at once.
//! - [`Offload`]: a dedicated scanning thread with a work queue and a completion queue.
//! - [`NoDetection`]: every page is data (`--zero-detection none`, for measurements).
//!
//! A VMM that embeds the engine brings its own by implementing both traits: one that knows
//! which pages it never populated, or a hardware engine. Its contract:
//!
//! - **A page reported zero is sent as zero and never read.** Say zero only for a page whose
//!   every byte was zero at some moment after the batch was submitted; a page with one
//!   non-zero byte reported zero arrives as zeros on the destination, and the guest runs on
//!   corrupted memory. "Was zero" may rest on the detector's own knowledge instead of a read
//!   (a page that is still a hole in the VMM's memfd when the batch is scanned, say). A page
//!   the guest writes after that moment needs no care: dirty tracking was armed before the page
//!   was queued, so it is sent again.
//! - Saying "data" for a zero page is always correct; it only costs the page's bytes.
//! - Completions come back in submission order, each with the batch it was given, its
//!   addresses unchanged, and one answer per address (`zero.len() == gpas.len()`). A detector
//!   that cannot scan a batch returns it with `ok: false` and the sender scans it on its CPU
//!   (counted in `MigrationStats::zero_scan_fallbacks`); so is a completion with the wrong
//!   number of answers.
//! - `submit` may block (a full queue) but not for ever; `complete` blocks until the oldest
//!   batch is done. The sender calls `complete` only while it has a batch outstanding (it
//!   counts them itself), and keeps one or two in the detector (`sender.rs`'s `PIPELINE`).
//! - Report a page outside guest RAM as data: the send that follows refuses it with the error
//!   that names it.
//!
//! The sender pays one dynamic call per batch (a batch is up to 512 pages), none per page.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};

use crate::ram::Ram;

/// Batches an offload engine accepts before `submit` blocks: two keep it busy while the sender
/// writes the batch before.
const OFFLOAD_QUEUE: usize = 2;

/// Which of the engine's detectors a migration uses: the user-facing choice
/// (`--zero-detection`, the request's `zero_detection`), a [`ZeroDetectorFactory`] of its own
/// and, through `.into()`, what [`SourceParams::zero`](crate::SourceParams::zero) holds.
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
    /// Filled by the completion: which pages are all zero, one answer per address.
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
    /// False if the engine could not scan the batch: the sender scans it itself.
    pub ok: bool,
}

/// A zero-page detector, one per sending thread: it is given batches and gives back their
/// completions in submission order. The module's doc has the contract; the one rule that
/// matters most: **only a page whose every byte is zero may be reported zero**, or the
/// destination's guest gets zeros where it had data.
pub trait ZeroDetector: Send {
    /// Takes `batch` to scan. May block while the detector's queue is full; a batch it cannot
    /// scan comes back from [`ZeroDetector::complete`] with `ok: false`.
    fn submit(&mut self, batch: Batch);
    /// The oldest batch submitted and not yet given back, once scanned (blocking until then).
    /// Called only while there is one.
    fn complete(&mut self) -> Completion;
}

/// Builds a [`ZeroDetector`] for each sending thread of a migration, on that thread as it
/// starts: once per data channel and preempt connection, and again for the connections a
/// postcopy recovery opens. Shared by those threads, hence `Sync`; `Debug` so that the
/// parameters that carry it print.
pub trait ZeroDetectorFactory: Send + Sync + std::fmt::Debug {
    /// A detector over `ram`, the guest memory the thread sends from.
    fn detector(&self, ram: &Ram) -> Box<dyn ZeroDetector>;
}

impl ZeroDetectorFactory for ZeroDetection {
    fn detector(&self, ram: &Ram) -> Box<dyn ZeroDetector> {
        match self {
            ZeroDetection::Inline => Box::new(Immediate::inline(ram.clone())),
            ZeroDetection::Offload => Box::new(Offload::start(ram.clone())),
            ZeroDetection::None => Box::new(Immediate::none(ram.clone())),
        }
    }
}

impl From<ZeroDetection> for Arc<dyn ZeroDetectorFactory> {
    fn from(choice: ZeroDetection) -> Arc<dyn ZeroDetectorFactory> {
        Arc::new(choice)
    }
}

/// Reports every `every`-th completion of `inner` as failed, unscanned, as an offload engine
/// that fails does: for the tests of the sender's CPU fallback (`TestHooks::zero_fail_every`).
pub(crate) struct FailEvery {
    inner: Box<dyn ZeroDetector>,
    every: u64,
    completed: u64,
}

impl FailEvery {
    pub(crate) fn new(inner: Box<dyn ZeroDetector>, every: u64) -> FailEvery {
        FailEvery {
            inner,
            every,
            completed: 0,
        }
    }
}

impl ZeroDetector for FailEvery {
    fn submit(&mut self, batch: Batch) {
        self.inner.submit(batch);
    }
    fn complete(&mut self) -> Completion {
        let mut c = self.inner.complete();
        self.completed += 1;
        if self.completed.is_multiple_of(self.every) {
            c.ok = false;
            c.batch.zero.clear();
        }
        c
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

impl ZeroDetector for Immediate {
    fn submit(&mut self, mut batch: Batch) {
        (self.scan)(&mut batch, &self.ram);
        self.done.push_back(batch);
    }
    fn complete(&mut self) -> Completion {
        let batch = self.done.pop_front().expect("complete follows a submit");
        Completion { batch, ok: true }
    }
}

/// A scanning thread fed through a bounded work queue, answering through a completion queue.
/// One thread per engine keeps completions in submission order. A hardware engine slots in
/// the same way, behind [`ZeroDetector`], and reports a batch it failed with `ok: false`.
#[derive(Debug)]
pub struct Offload {
    work: Option<SyncSender<Batch>>,
    done: Receiver<Completion>,
    thread: Option<JoinHandle<()>>,
}

impl Offload {
    pub fn start(ram: Ram) -> Offload {
        let (work, queue) = sync_channel::<Batch>(OFFLOAD_QUEUE);
        let (finished, done) = sync_channel::<Completion>(OFFLOAD_QUEUE + 1);
        let thread = std::thread::Builder::new()
            .name("zero-offload".into())
            .spawn(move || {
                for mut batch in queue {
                    batch.scan_inline(&ram);
                    if finished.send(Completion { batch, ok: true }).is_err() {
                        break;
                    }
                }
            })
            .expect("cannot start the zero-scan offload thread");
        Offload {
            work: Some(work),
            done,
            thread: Some(thread),
        }
    }
}

impl ZeroDetector for Offload {
    fn submit(&mut self, batch: Batch) {
        let sent = self.work.as_ref().map(|w| w.send(batch));
        assert!(matches!(sent, Some(Ok(()))), "the offload thread is gone");
    }
    fn complete(&mut self) -> Completion {
        self.done.recv().expect("the offload thread is gone")
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
    fn offload_completes_in_order_and_injected_failures_come_back_unscanned() {
        let offload = ZeroDetection::Offload.detector(&ram(&[]));
        let mut d = FailEvery::new(offload, 2);
        let mut completions = Vec::new();
        let mut outstanding = 0;
        for i in 0..6 {
            d.submit(batch(2 * i..2 * i + 2));
            outstanding += 1;
            if outstanding == 2 {
                completions.push(d.complete());
                outstanding -= 1;
            }
        }
        completions.extend((0..outstanding).map(|_| d.complete()));
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
        assert!(
            completions.iter().all(|c| c.ok || c.batch.zero.is_empty()),
            "a failed batch comes back for the CPU to scan"
        );
    }

    #[test]
    fn every_detector_finds_the_zero_pages() {
        let memory = ram(&[(1, 7)]);
        for kind in [ZeroDetection::Inline, ZeroDetection::Offload] {
            let mut d = kind.detector(&memory);
            d.submit(batch(0..3));
            let c = d.complete();
            assert!(c.ok);
            assert_eq!(c.batch.zero, vec![true, false, true], "{kind:?}");
        }
        let mut d = ZeroDetection::None.detector(&memory);
        d.submit(batch(0..2));
        assert_eq!(d.complete().batch.zero, vec![false, false]);
    }

    #[test]
    fn a_choice_is_the_factory_parameters_carry() {
        let factory: Arc<dyn ZeroDetectorFactory> = ZeroDetection::Offload.into();
        assert_eq!(format!("{factory:?}"), "Offload");
        let mut d = factory.detector(&ram(&[(0, 1)]));
        d.submit(batch(0..2));
        assert_eq!(d.complete().batch.zero, vec![false, true]);
    }

    #[test]
    fn a_page_outside_ram_is_data_for_the_send_to_refuse() {
        let mut d = ZeroDetection::Inline.detector(&ram(&[]));
        d.submit(Batch::new(vec![0, 64 * PAGE_SIZE]));
        assert_eq!(d.complete().batch.zero, vec![true, false]);
    }
}
