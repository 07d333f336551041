//! The barrier that orders passes across a destination's data channels (docs/protocol.md,
//! "Passes and channels"): a receiver that reaches EndOfPass(n) waits here until every data
//! channel and the main channel have, so the last copy of a page always lands last.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Connection, Internal, MigrateError};
use crate::pagebits::PageBits;

/// Makes every party wait at the end of pass n until all parties reached it, or until a party
/// fails or leaves too early (then everyone stops). Every wait is bounded: a party that never
/// arrives and never leaves is given up on after [`PassBarrier::new`]'s `timeout`.
#[derive(Debug)]
pub struct PassBarrier {
    parties: usize,
    timeout: Duration,
    state: Mutex<BarrierState>,
    cv: Condvar,
    /// Pages claimed in the current pass; cleared by the last party to arrive.
    claimed: Arc<PageBits>,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: BTreeMap<u32, usize>,
    /// Data channels whose stream ended, with the last pass each finished.
    departed: Vec<(u16, u32)>,
    /// The first failure.
    failure: Option<Failure>,
}

/// Why the parties of a pass stop: a connection's error, as its siblings are told it (the
/// failing connection's thread returns the error itself), or a receiver that panicked.
#[derive(Debug)]
enum Failure {
    Channel(String),
    Panicked(Connection),
}

fn failure_error(failure: &Failure) -> MigrateError {
    match failure {
        Failure::Channel(why) => MigrateError::Channel(why.clone()),
        Failure::Panicked(connection) => Internal::ReceiverUnwound {
            connection: *connection,
        }
        .into(),
    }
}

impl PassBarrier {
    pub fn new(parties: usize, claimed: Arc<PageBits>, timeout: Duration) -> PassBarrier {
        PassBarrier {
            parties,
            timeout,
            state: Mutex::new(BarrierState::default()),
            cv: Condvar::new(),
            claimed,
        }
    }

    /// Waits until every party has ended pass `pass`.
    pub fn wait(&self, pass: u32) -> Result<(), MigrateError> {
        let deadline = Instant::now() + self.timeout;
        let mut s = self.state.lock().unwrap();
        let n = {
            let n = s.arrived.entry(pass).or_insert(0);
            *n += 1;
            *n
        };
        if n == self.parties {
            self.claimed.clear_all();
            s.arrived.retain(|&p, _| p >= pass);
            self.cv.notify_all();
        }
        loop {
            if let Some(f) = &s.failure {
                return Err(failure_error(f));
            }
            if s.arrived.get(&pass).copied().unwrap_or(self.parties) >= self.parties {
                return Ok(());
            }
            if let Some(&(channel, after_pass)) = s.departed.iter().find(|d| d.1 < pass) {
                return Err(MigrateError::ChannelEnded {
                    channel,
                    after_pass,
                    pass,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(MigrateError::PassTimeout {
                    pass,
                    timeout: self.timeout,
                });
            }
            s = self.cv.wait_timeout(s, deadline - now).unwrap().0;
        }
    }

    /// A data channel's stream ended cleanly after it finished `after_pass`: a party waiting
    /// for a later pass will never see it arrive, so it is released with an error naming it.
    pub fn leave(&self, channel: u16, after_pass: u32) {
        let mut s = self.state.lock().unwrap();
        s.departed.push((channel, after_pass));
        self.cv.notify_all();
    }

    /// The channels that ended before finishing `pass` (what a waiter's error names).
    #[cfg(test)]
    fn departed_before(&self, pass: u32) -> Option<(u16, u32)> {
        let s = self.state.lock().unwrap();
        s.departed.iter().copied().find(|d| d.1 < pass)
    }

    /// Records the first failure and releases every waiter.
    pub fn fail(&self, why: &str) {
        self.record(Failure::Channel(why.to_string()));
    }

    /// Records a bug (a party that panicked) as the failure, unless one came first.
    pub(super) fn fail_with_bug(&self, connection: Connection) {
        self.record(Failure::Panicked(connection));
    }

    fn record(&self, failure: Failure) {
        let mut s = self.state.lock().unwrap();
        s.failure.get_or_insert(failure);
        self.cv.notify_all();
    }

    /// The first failure a party reported, as the error it ends the migration with.
    pub fn failure(&self) -> Option<MigrateError> {
        self.state
            .lock()
            .unwrap()
            .failure
            .as_ref()
            .map(failure_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn barrier_releases_when_all_parties_arrive_and_fails_everyone() {
        let b = Arc::new(PassBarrier::new(
            3,
            Arc::new(PageBits::new(64)),
            Duration::from_secs(60),
        ));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || b.wait(1))
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "nobody passes early"
        );
        b.wait(1).unwrap();
        for w in waiters {
            w.join().unwrap().unwrap();
        }
        let late = {
            let b = b.clone();
            std::thread::spawn(move || b.wait(2))
        };
        b.fail("channel 3 broke");
        assert!(
            late.join()
                .unwrap()
                .unwrap_err()
                .to_string()
                .contains("channel 3 broke")
        );
    }

    #[test]
    fn regression_a_channel_that_leaves_early_releases_the_barrier() {
        let b = PassBarrier::new(2, Arc::new(PageBits::new(64)), Duration::from_secs(60));
        b.leave(1, 0);
        let e = b.wait(1).unwrap_err().to_string();
        assert!(e.contains("data channel 1 ended after pass 0"), "{e}");
        assert_eq!(b.departed_before(1), Some((1, 0)));
        assert_eq!(b.departed_before(0), None);
    }

    #[test]
    fn a_barrier_wait_is_bounded() {
        let b = PassBarrier::new(2, Arc::new(PageBits::new(64)), Duration::from_millis(50));
        let e = b.wait(1).unwrap_err().to_string();
        assert!(e.contains("pass 1 did not end on every connection"), "{e}");
    }
}
