//! Where the receivers wait for postcopy to begin (see [`PostcopyGate`]).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::postcopy::Postcopy;

/// Where receivers wait for postcopy to begin: they read the postcopy marker on their channel
/// before the session has registered guest RAM, and install nothing until it has.
#[derive(Debug, Default)]
pub(crate) struct PostcopyGate {
    open: Mutex<Option<Arc<Postcopy>>>,
    cv: Condvar,
}

impl PostcopyGate {
    pub(crate) fn open(&self, pc: Arc<Postcopy>) {
        *self.open.lock().unwrap() = Some(pc);
        self.cv.notify_all();
    }

    /// The postcopy state once the session opened the gate; `None` after `timeout`.
    pub(crate) fn wait(&self, timeout: Duration) -> Option<Arc<Postcopy>> {
        let deadline = Instant::now() + timeout;
        let mut open = self.open.lock().unwrap();
        loop {
            if let Some(pc) = open.as_ref() {
                return Some(pc.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            open = self.cv.wait_timeout(open, deadline - now).unwrap().0;
        }
    }
}
