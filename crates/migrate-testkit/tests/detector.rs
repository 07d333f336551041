//! A VMM's own zero detector, injected through `SourceParams::zero` over the fake VMM: the
//! engine builds one per sending thread, sends as zeros exactly the pages it reports zero (even
//! when that is a lie: the contract in `scan.rs` is the VMM's to keep), and scans on its CPU a
//! completion that does not answer for every page.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_migrate::ram::Ram;
use ferry_migrate::scan::{Batch, Completion, ZeroDetector, ZeroDetectorFactory};
use ferry_migrate::source::SourceParams;
use ferry_migrate::wire::PAGE_SIZE;
use ferry_migrate::{Control, Policy, SourceVm};
use ferry_migrate_testkit::FakeVm;
use ferry_migrate_testkit::loopback::migrate;

const MIB: u64 = 1 << 20;
/// The detector below claims every page whose index is a multiple of this is zero.
const CLAIM: u64 = 7;

/// What the detectors of one migration did, counted across its sending threads.
#[derive(Debug, Default)]
struct Counts {
    built: AtomicU64,
    pages: AtomicU64,
    claimed: AtomicU64,
}

/// A factory of [`Claims`] detectors, or, `malformed`, of detectors that answer for no page.
#[derive(Debug, Default)]
struct ClaimsFactory {
    counts: Arc<Counts>,
    malformed: bool,
}

impl ZeroDetectorFactory for ClaimsFactory {
    fn detector(&self, ram: &Ram) -> Box<dyn ZeroDetector> {
        self.counts.built.fetch_add(1, Ordering::Relaxed);
        Box::new(Claims {
            ram: ram.clone(),
            done: VecDeque::new(),
            counts: self.counts.clone(),
            malformed: self.malformed,
        })
    }
}

/// Says a page is zero when its index is a multiple of [`CLAIM`], without reading it: what a
/// VMM that knows which pages it never populated does, here told a lie about pages with data.
struct Claims {
    ram: Ram,
    done: VecDeque<Batch>,
    counts: Arc<Counts>,
    malformed: bool,
}

impl ZeroDetector for Claims {
    fn submit(&mut self, mut batch: Batch) {
        batch.zero = batch
            .gpas
            .iter()
            .map(|&gpa| {
                self.ram
                    .page_index(gpa)
                    .is_ok_and(|i| i.is_multiple_of(CLAIM))
            })
            .collect();
        let claimed = batch.zero.iter().filter(|&&z| z).count() as u64;
        self.counts.claimed.fetch_add(claimed, Ordering::Relaxed);
        self.counts
            .pages
            .fetch_add(batch.gpas.len() as u64, Ordering::Relaxed);
        if self.malformed {
            batch.zero.clear();
        }
        self.done.push_back(batch);
    }

    fn complete(&mut self) -> Completion {
        let batch = self.done.pop_front().expect("complete follows a submit");
        Completion { batch, ok: true }
    }
}

fn params(factory: ClaimsFactory) -> SourceParams {
    SourceParams {
        channels: 3,
        packet_pages: 16,
        zero: Arc::new(factory),
        ..SourceParams::new(Policy::default(), [5; 16])
    }
}

#[test]
fn the_engine_sends_as_zero_exactly_the_pages_an_injected_detector_reports_zero() {
    let mut src = FakeVm::new(8 * MIB, 2);
    src.fill(1); // every page holds data
    let mut dst = FakeVm::new(8 * MIB, 2);
    let factory = ClaimsFactory::default();
    let counts = factory.counts.clone();
    let (sent, received) = migrate(&mut src, &mut dst, &params(factory), &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert_eq!(
        counts.built.load(Ordering::Relaxed),
        3,
        "one detector per data channel's thread"
    );
    assert_eq!(
        counts.pages.load(Ordering::Relaxed),
        stats.pages_normal + stats.pages_zero,
        "every page sent went through the detector"
    );
    assert_eq!(stats.pages_zero, counts.claimed.load(Ordering::Relaxed));
    assert_eq!(stats.zero_scan_fallbacks, 0);
    let page = PAGE_SIZE as usize;
    let (a, b) = (src.contents(), dst.contents());
    for (i, (from, to)) in a.chunks(page).zip(b.chunks(page)).enumerate() {
        if (i as u64).is_multiple_of(CLAIM) {
            assert!(to.iter().all(|&x| x == 0), "page {i} was claimed zero");
            assert!(from.iter().any(|&x| x != 0), "page {i} had data");
        } else {
            assert!(from == to, "page {i} differs");
        }
    }
}

#[test]
fn a_completion_without_an_answer_per_page_is_scanned_by_the_sender() {
    let mut src = FakeVm::new(8 * MIB, 2);
    src.fill(1);
    for r in SourceVm::ram(&src) {
        for gpa in (r.gpa..r.gpa + r.size).step_by(3 * PAGE_SIZE as usize) {
            src.write(gpa, &[0; PAGE_SIZE as usize]).unwrap(); // a zero page, populated
        }
    }
    let mut dst = FakeVm::new(8 * MIB, 2);
    let factory = ClaimsFactory {
        malformed: true,
        ..ClaimsFactory::default()
    };
    let counts = factory.counts.clone();
    let (sent, received) = migrate(&mut src, &mut dst, &params(factory), &Control::default());
    let stats = sent.unwrap();
    received.unwrap();
    assert!(counts.pages.load(Ordering::Relaxed) > 0);
    assert!(
        stats.zero_scan_fallbacks > 0 && stats.pages_zero > 0,
        "the sender found the zero pages itself: {stats:?}"
    );
    assert!(src.contents() == dst.contents());
}
