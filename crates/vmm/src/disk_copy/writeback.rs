//! A thread that moves a file's written data to storage every [`EVERY`] while it lives, so
//! that data written in bulk goes to storage as it is written rather than all at once later.
//!
//! - The source's image during a migration ([`Writeback::start`]): its writeback is started
//!   (`sync_file_range` with `SYNC_FILE_RANGE_WRITE`), not waited for, so the guest's writes do
//!   not queue behind a sync, and the pause's flush finds less to write.
//! - The destination's copy as it arrives ([`Writeback::tracking`]): synced (`fdatasync`), and
//!   how much of it is on storage counted, so that the destination says it is ready for the
//!   switchover only once nearly all of it is (`IncomingCopy::ready`). Without that, the
//!   guest's first flush after the resume wrote what was left, on its vCPU: a 2.3 GB copy left
//!   whole held the guest 4.7 s in one run of `ferry bench disk`, and with writeback merely
//!   started, 0.87 s in another.
//!
//! Dropping it tells the thread to stop and does not wait: a sync under way may take long, and
//! the drop can be in a guest's pause; the thread ends when the sync returns.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How often the file's data is moved to storage.
pub const EVERY: Duration = Duration::from_millis(50);

#[derive(Debug)]
pub struct Writeback {
    stop: Arc<(Mutex<bool>, Condvar)>,
}

/// What a tracking writeback counts: bytes written to the file (its writer adds them) and, of
/// those, the bytes a completed sync covered.
#[derive(Debug, Default)]
pub struct Progress {
    pub written: AtomicU64,
    pub synced: AtomicU64,
}

impl Writeback {
    /// Starts `file`'s writeback every [`EVERY`] (a read-only descriptor may ask for it too);
    /// `None` if no thread could be made.
    pub fn start(file: File) -> Option<Writeback> {
        Writeback::spawn(move || start_writeback(&file))
    }

    /// Syncs `file` every [`EVERY`] and counts in `progress` what each sync covered.
    pub fn tracking(file: File, progress: Arc<Progress>) -> Option<Writeback> {
        Writeback::spawn(move || {
            let written = progress.written.load(Ordering::Acquire);
            file.sync_data()?;
            progress.synced.fetch_max(written, Ordering::AcqRel);
            Ok(())
        })
    }

    fn spawn(mut step: impl FnMut() -> std::io::Result<()> + Send + 'static) -> Option<Writeback> {
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
                    if let Err(e) = step() {
                        tracing::warn!("cannot write a disk image back in the background: {e}");
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

/// Starts the writeback of every dirty page of `file`, without waiting for it.
fn start_writeback(file: &File) -> std::io::Result<()> {
    // SAFETY: sync_file_range takes a descriptor (valid: `file` is borrowed for the call) and
    // plain integers, and reads or writes no memory of this process.
    let ret = unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    match ret {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tracking_writeback_counts_what_its_syncs_covered() {
        let dir = tempfile::tempdir().unwrap();
        let file = File::create(dir.path().join("f")).unwrap();
        let progress = Arc::new(Progress::default());
        let w = Writeback::tracking(file.try_clone().unwrap(), progress.clone()).unwrap();
        std::io::Write::write_all(&mut &file, &[1; 4096]).unwrap();
        progress.written.fetch_add(4096, Ordering::AcqRel);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while progress.synced.load(Ordering::Acquire) < 4096 {
            assert!(
                std::time::Instant::now() < deadline,
                "no sync covered the write"
            );
            std::thread::sleep(EVERY);
        }
        drop(w);
    }
}
