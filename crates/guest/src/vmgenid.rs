//! What the guest makes of the VM generation ID (`ferry_guest_abi::vmgenid`): the ID it saw at
//! its last look and the changes it has seen since it booted. Any difference from the last look
//! is a change, a return to an older ID too (a clone of a clone of an earlier snapshot).

use ferry_guest_abi::report::{self, DETAIL_WORDS};
use ferry_guest_abi::vmgenid::GenerationId;

/// The guest's view of its VM generation ID.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watch {
    seen: GenerationId,
    changes: u64,
}

impl Watch {
    /// The view after the first look, at boot: `first`, no change.
    pub fn new(first: GenerationId) -> Watch {
        Watch {
            seen: first,
            changes: 0,
        }
    }

    /// Takes a look that read `now`; whether the ID changed since the last look (counted).
    pub fn look(&mut self, now: GenerationId) -> bool {
        if now == self.seen {
            return false;
        }
        self.seen = now;
        self.changes += 1;
        true
    }

    /// The detail words of the report that says so (`report::vm_generation`).
    pub fn detail(&self) -> [u64; DETAIL_WORDS] {
        let mut d = [0; DETAIL_WORDS];
        [
            d[report::vm_generation::ID_LOW],
            d[report::vm_generation::ID_HIGH],
        ] = self.seen.to_detail();
        d[report::vm_generation::CHANGES] = self.changes;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_difference_from_the_last_look_is_one_change() {
        let (a, b) = (GenerationId([1; 16]), GenerationId([2; 16]));
        let mut w = Watch::new(a);
        assert_eq!(w.detail()[report::vm_generation::CHANGES], 0);
        let looks = [(a, false, 0), (b, true, 1), (b, false, 1), (a, true, 2)];
        for (now, changed, changes) in looks {
            assert_eq!(w.look(now), changed, "{now}");
            let d = w.detail();
            assert_eq!(d[report::vm_generation::CHANGES], changes);
            let id = [
                d[report::vm_generation::ID_LOW],
                d[report::vm_generation::ID_HIGH],
            ];
            assert_eq!(GenerationId::from_detail(id), now);
        }
    }
}
