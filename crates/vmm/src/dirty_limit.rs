//! The per-vCPU dirty limit: each vCPU may dirty at most a rate, and one that dirties faster
//! sleeps until its pages are paid for; the others run freely. It needs to know which vCPU
//! dirtied a page, which only the dirty ring tells (`kvm/ring.rs`).
//!
//! Each vCPU has a clock of what its dirtying has paid for: a page costs `1 / limit` seconds,
//! charged when its ring entry is harvested (by the vCPU's own thread when its ring fills, by
//! the migration thread at a sync, which harvests every vCPU). The pages a harvest finds were
//! dirtied since the vCPU's previous harvest, so their cost is paid from then on: a vCPU whose
//! paid-for time runs ahead of now dirtied faster than the limit over that stretch, owes the
//! difference, and sleeps it, in slices of at most [`SLICE`], before it runs again. A vCPU
//! under the limit owes nothing however its pages come in lumps (a sync's harvest). So over
//! any two harvests, a vCPU dirties at most `limit`, whatever its neighbours do.
//!
//! Invariant: with no limit set, nothing is owed and nothing is charged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A debt shorter than this is not slept (a wakeup costs more than it would slow).
const MIN_SLEEP: Duration = Duration::from_micros(500);

/// The longest single sleep: a vCPU sleeps a larger debt in slices, looking again between
/// them, so that a limit lifted (or a pause) lets it run within a slice. One full ring at a low
/// limit is a debt of seconds (4096 pages at 1 MB/s: 16 s).
pub const SLICE: Duration = Duration::from_millis(50);

/// The most a vCPU owes at once: its paid-for clock runs at most this far ahead of now, however
/// many pages one harvest charges. A sync's harvest of a full 65,536-entry ring at the 1 MB/s
/// floor is 268 s of pages; charged whole, the vCPU would sleep minutes (issue 48). One second
/// still holds a vCPU that outruns the limit to about a harvest per second, and a vCPU never
/// sleeps longer than that for pages it dirtied before it was told.
pub const MAX_DEBT: Duration = Duration::from_secs(1);

/// The VM's dirty limit and each vCPU's account.
#[derive(Debug)]
pub struct DirtyLimit {
    /// Pages per second each vCPU may dirty; 0: no limit.
    pages_per_s: AtomicU64,
    /// When (ns after `epoch`) the limit was set: pages are paid for from then at the earliest.
    set_ns: AtomicU64,
    epoch: Instant,
    vcpus: Vec<Account>,
}

#[derive(Debug, Default)]
struct Account {
    /// Until when (ns after `epoch`) the pages charged so far are paid for.
    paid_until_ns: AtomicU64,
    /// Time the vCPU slept for the limit.
    slept_ns: AtomicU64,
}

impl DirtyLimit {
    pub fn new(vcpus: usize) -> DirtyLimit {
        DirtyLimit {
            pages_per_s: AtomicU64::new(0),
            set_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            vcpus: (0..vcpus).map(|_| Account::default()).collect(),
        }
    }

    /// Sets the limit in bytes per second (`None` lifts it, and forgives what is owed).
    pub fn set(&self, bytes_per_s: Option<u64>) {
        let pages = bytes_per_s.map_or(0, |b| (b / ferry_guest_abi::PAGE_SIZE).max(1));
        // A limit's payments start when it is set (pages dirtied before and harvested after
        // are paid for from then on).
        self.set_ns.store(self.now_ns(), Ordering::Relaxed);
        for a in &self.vcpus {
            a.paid_until_ns.store(0, Ordering::Relaxed);
        }
        self.pages_per_s.store(pages, Ordering::Relaxed);
    }

    /// Charges vCPU `vcpu` for the `pages` a harvest of its ring read, dirtied since the ring's
    /// harvest before (`since`; `None`: none since the log started), and not before the limit
    /// was set; true when it owes a sleep now.
    pub fn charge(&self, vcpu: usize, pages: u64, since: Option<Instant>) -> bool {
        let rate = self.pages_per_s.load(Ordering::Relaxed);
        let Some(a) = self.vcpus.get(vcpu).filter(|_| rate > 0 && pages > 0) else {
            return false;
        };
        let set = self.set_ns.load(Ordering::Relaxed);
        let since = since.map_or(set, |t| self.ns(t).max(set));
        let cost = (u128::from(pages) * 1_000_000_000 / u128::from(rate)) as u64;
        let now = self.now_ns();
        let most = now + MAX_DEBT.as_nanos() as u64;
        let before = a
            .paid_until_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |paid| {
                Some((paid.max(since) + cost).min(most))
            })
            .unwrap_or_default();
        (before.max(since) + cost).min(most) > now
    }

    /// How long vCPU `vcpu` sleeps now for what it dirtied beyond the limit: its debt, in
    /// slices of at most [`SLICE`].
    pub fn owed(&self, vcpu: usize) -> Duration {
        self.debt(vcpu).min(SLICE)
    }

    /// What vCPU `vcpu` owes in all: how far its paid-for clock runs ahead of now.
    pub fn debt(&self, vcpu: usize) -> Duration {
        if self.pages_per_s.load(Ordering::Relaxed) == 0 {
            return Duration::ZERO;
        }
        let Some(a) = self.vcpus.get(vcpu) else {
            return Duration::ZERO;
        };
        let owed = Duration::from_nanos(
            a.paid_until_ns
                .load(Ordering::Relaxed)
                .saturating_sub(self.now_ns()),
        );
        if owed < MIN_SLEEP {
            Duration::ZERO
        } else {
            owed
        }
    }

    pub fn add_slept(&self, vcpu: usize, slept: Duration) {
        if let Some(a) = self.vcpus.get(vcpu) {
            a.slept_ns
                .fetch_add(slept.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Time each vCPU slept for the limit since [`DirtyLimit::reset_slept`], by vCPU id.
    pub fn slept(&self) -> Vec<Duration> {
        self.vcpus
            .iter()
            .map(|a| Duration::from_nanos(a.slept_ns.load(Ordering::Relaxed)))
            .collect()
    }

    pub fn reset_slept(&self) {
        for a in &self.vcpus {
            a.slept_ns.store(0, Ordering::Relaxed);
        }
    }

    fn now_ns(&self) -> u64 {
        self.ns(Instant::now())
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vcpu_over_the_limit_owes_its_excess_and_one_under_it_owes_nothing() {
        let l = DirtyLimit::new(2);
        assert!(!l.charge(0, 1_000_000, None), "no limit, no charge");
        assert_eq!(l.owed(0), Duration::ZERO);
        // 4096 pages a second.
        l.set(Some(4096 * ferry_guest_abi::PAGE_SIZE));
        // 2048 pages at once cost half a second from the last harvest (the limit's start),
        // slept in slices.
        assert!(l.charge(0, 2048, None));
        let debt = l.debt(0);
        assert!(
            debt > Duration::from_millis(450) && debt <= Duration::from_millis(500),
            "{debt:?}"
        );
        assert_eq!(l.owed(0), SLICE);
        // A second lump adds its cost after the first, up to the most a vCPU owes.
        l.charge(0, 4096, Some(Instant::now()));
        let debt = l.debt(0);
        assert!(
            debt > Duration::from_millis(900) && debt <= MAX_DEBT,
            "{debt:?}"
        );
        // vCPU 1 is not charged for vCPU 0; its 40 pages dirtied since a harvest 20 ms ago
        // cost 10 ms of those 20: under the limit, however late the harvest.
        std::thread::sleep(Duration::from_millis(20));
        let ago = Instant::now() - Duration::from_millis(20);
        assert!(!l.charge(1, 40, Some(ago)));
        assert_eq!(l.owed(1), Duration::ZERO);
        // The same pages since a harvest just now are over it.
        assert!(l.charge(1, 40, Some(Instant::now())));
        // Lifting the limit forgives the debt.
        l.set(None);
        assert_eq!(l.debt(0), Duration::ZERO);
        assert_eq!(l.owed(0), Duration::ZERO);
    }

    /// Issue 48: one harvest of a full ring at the floor charged 268 s of sleep.
    #[test]
    fn regression_one_harvest_charges_at_most_the_largest_debt() {
        let l = DirtyLimit::new(1);
        l.set(Some(1_000_000));
        assert!(l.charge(0, 65_536, Some(Instant::now())));
        let debt = l.debt(0);
        assert!(
            debt > MAX_DEBT - Duration::from_millis(50) && debt <= MAX_DEBT,
            "{debt:?}"
        );
        // Another full ring right after does not push it further.
        l.charge(0, 65_536, Some(Instant::now()));
        assert!(l.debt(0) <= MAX_DEBT, "{:?}", l.debt(0));
    }

    #[test]
    fn sleeps_are_counted_per_vcpu_until_reset() {
        let l = DirtyLimit::new(2);
        l.add_slept(1, Duration::from_millis(30));
        l.add_slept(1, Duration::from_millis(20));
        l.add_slept(7, Duration::from_millis(20));
        assert_eq!(l.slept(), [Duration::ZERO, Duration::from_millis(50)]);
        l.reset_slept();
        assert_eq!(l.slept(), [Duration::ZERO; 2]);
    }
}
