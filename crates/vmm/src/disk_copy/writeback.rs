//! A thread that syncs a file every [`EVERY`] while it lives, so that data written in bulk
//! reaches stable storage as it is written rather than all at once later: the source's image
//! before the pause's flush, and the destination's copy before the guest's first flush (a
//! 2.3 GB copy left for that flush held the guest's vCPU 4.7 s in one run of `ferry bench
//! disk`). Dropping it tells the thread to stop and does not wait: a sync under way may take
//! long, and the drop can be in a guest's pause; the thread ends when the sync returns.

#![forbid(unsafe_code)]

use std::fs::File;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How often the file is synced.
pub const EVERY: Duration = Duration::from_millis(50);

#[derive(Debug)]
pub struct Writeback {
    stop: Arc<(Mutex<bool>, Condvar)>,
}

impl Writeback {
    /// Syncs `file` (`fdatasync`, which a read-only descriptor may ask for too) every
    /// [`EVERY`] from a thread of its own; `None` if no thread could be made.
    pub fn start(file: File) -> Option<Writeback> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("disk-writeback".into())
            .spawn(move || {
                let (stopped, wake) = &*flag;
                let mut s = stopped.lock().unwrap();
                while !*s {
                    s = wake.wait_timeout(s, EVERY).unwrap().0;
                    if *s {
                        break;
                    }
                    // Not under the lock: a drop need not wait for a sync to be told.
                    drop(s);
                    if let Err(e) = file.sync_data() {
                        tracing::warn!("cannot sync a disk image in the background: {e}");
                        return;
                    }
                    s = stopped.lock().unwrap();
                }
            })
            .ok()?;
        Some(Writeback { stop })
    }
}

impl Drop for Writeback {
    fn drop(&mut self) {
        let (stopped, wake) = &*self.stop;
        *stopped.lock().unwrap() = true;
        wake.notify_all();
    }
}
