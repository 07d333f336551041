//! Who needs guest RAM to stay as it is, counted: while RAM is still arriving (an incoming
//! migration that may end in postcopy, a lazy restore still loading) no outgoing copy of it may
//! start, and while anything holds it (those, and every outgoing migration or snapshot) the
//! balloon gives no page back to the host.
//!
//! Why a count: an outgoing snapshot taken while a lazy restore loads used to set the balloon's
//! discard back to allowed when it ended, under the restore that relied on the ban (the last
//! writer won). Each holder now takes and gives back its own hold, and the balloon is told only
//! when the first hold is taken and the last is given back, under the holds' lock (lock order:
//! holds, then the balloon).
//!
//! Why the refusal: pages an incoming migration or a lazy restore places later (`UFFDIO_COPY`)
//! reach no dirty log, and an outgoing pass 1 that walked the still-empty memory skipped them
//! as holes, so a copy taken meanwhile held zeros there with checksums that passed.

use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::devices::virtio::balloon::{Balloon, Discard};
use crate::devices::virtio::mmio::MmioTransport;

/// What guest RAM is still arriving from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// An incoming migration (its pages may still come in postcopy, after the guest runs).
    IncomingMigration,
    /// A lazy restore whose loaders have not placed all of RAM yet.
    LazyRestore,
}

impl std::fmt::Display for Arrival {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Arrival::IncomingMigration => "an incoming migration is still placing it",
            Arrival::LazyRestore => "a lazy restore is still loading it",
        })
    }
}

/// The holds on one VM's RAM.
#[derive(Debug)]
pub(crate) struct RamHolds {
    balloon: Option<Arc<Mutex<MmioTransport<Balloon>>>>,
    inner: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    /// Holders that need no page given back to the host (each arrival is one too).
    discard_bans: u32,
    /// RAM still arriving, one entry per arrival under way.
    arriving: Vec<Arrival>,
}

impl RamHolds {
    pub(crate) fn new(balloon: Option<Arc<Mutex<MmioTransport<Balloon>>>>) -> RamHolds {
        RamHolds {
            balloon,
            inner: Mutex::default(),
        }
    }

    /// Takes a hold under which the balloon gives no page back.
    pub(crate) fn ban_discard(&self) {
        let mut c = self.inner.lock().unwrap();
        c.discard_bans += 1;
        if c.discard_bans == 1 {
            self.tell_balloon(Discard::Forbidden);
        }
    }

    /// Gives back a hold [`RamHolds::ban_discard`] took.
    pub(crate) fn lift_discard(&self) {
        let mut c = self.inner.lock().unwrap();
        debug_assert!(c.discard_bans > 0, "a discard ban lifted twice");
        c.discard_bans = c.discard_bans.saturating_sub(1);
        if c.discard_bans == 0 {
            self.tell_balloon(Discard::Allowed);
        }
    }

    /// RAM starts arriving from `from`: no outgoing copy and no discard until [`RamHolds::arrived`].
    pub(crate) fn arriving(&self, from: Arrival) {
        self.inner.lock().unwrap().arriving.push(from);
        self.ban_discard();
    }

    /// What [`RamHolds::arriving`] announced has placed all of RAM (or ended).
    pub(crate) fn arrived(&self, from: Arrival) {
        let mut c = self.inner.lock().unwrap();
        let Some(i) = c.arriving.iter().position(|&a| a == from) else {
            debug_assert!(false, "{from:?} arrived without arriving");
            return;
        };
        c.arriving.swap_remove(i);
        drop(c);
        self.lift_discard();
    }

    /// [`RamHolds::arriving`] until the returned guard drops (whatever way the arrival ends).
    pub(crate) fn arrival(&self, from: Arrival) -> ArrivalHold<'_> {
        self.arriving(from);
        ArrivalHold { holds: self, from }
    }

    /// What RAM is still arriving from, if anything (an outgoing copy must wait), not counting what `done` says has all arrived though
    /// its hold is not let go yet (an incoming migration that published its completion).
    pub(crate) fn still_arriving_but(&self, done: impl Fn(Arrival) -> bool) -> Option<Arrival> {
        let c = self.inner.lock().unwrap();
        c.arriving.iter().copied().find(|&a| !done(a))
    }

    fn tell_balloon(&self, d: Discard) {
        if let Some(b) = &self.balloon {
            b.lock().unwrap().set_discard(d);
        }
    }
}

/// RAM arriving until dropped ([`RamHolds::arrival`]).
pub(crate) struct ArrivalHold<'a> {
    holds: &'a RamHolds,
    from: Arrival,
}

impl Drop for ArrivalHold<'_> {
    fn drop(&mut self) {
        self.holds.arrived(self.from);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 48: an outgoing session that ended under an arrival set discards back to allowed.
    #[test]
    fn regression_the_last_hold_given_back_lifts_the_ban_not_the_first() {
        let h = RamHolds::new(None);
        h.arriving(Arrival::LazyRestore);
        assert_eq!(h.still_arriving_but(|_| false), Some(Arrival::LazyRestore));
        h.ban_discard(); // a snapshot starts
        h.lift_discard(); // and ends
        assert_eq!(
            h.inner.lock().unwrap().discard_bans,
            1,
            "the restore's ban holds"
        );
        h.arrived(Arrival::LazyRestore);
        assert_eq!(h.still_arriving_but(|_| false), None);
        assert_eq!(h.inner.lock().unwrap().discard_bans, 0);
    }

    /// Issue 55 (the API soak): an incoming migration that said it completed no longer counts
    /// as arriving, though its hold is let go a moment later; its discard ban holds till then.
    #[test]
    fn regression_a_completed_arrival_does_not_hold_an_outgoing_copy_back() {
        let h = RamHolds::new(None);
        let hold = h.arrival(Arrival::IncomingMigration);
        let completed = |a| a == Arrival::IncomingMigration;
        assert_eq!(
            h.still_arriving_but(|_| false),
            Some(Arrival::IncomingMigration)
        );
        assert_eq!(h.still_arriving_but(completed), None);
        assert_eq!(h.inner.lock().unwrap().discard_bans, 1);
        drop(hold);
        assert_eq!(h.still_arriving_but(|_| false), None);
    }
}
