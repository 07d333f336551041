//! The process's file size limit (`ulimit -f`, systemd's `LimitFSIZE=`): a write past it raises
//! SIGXFSZ, whose default action kills the VMM with its guest. A snapshot is the VMM's one large
//! write, so every VM build catches the signal once for the process; the write then fails with
//! `EFBIG`, which the snapshot reports, naming the limit, and the guest runs on.

use crate::VmmError;

/// Makes a write past the file size limit fail with `EFBIG` instead of killing the process.
/// Once per process; every VM build calls it.
pub fn catch_file_size_limit() -> Result<(), VmmError> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = vmm_sys_util::signal::register_signal_handler(libc::SIGXFSZ, on_file_size_limit)
    });
    result.map_err(VmmError::FileSizeSignal)
}

/// Nothing to do: the write that raised it returns `EFBIG`.
extern "C" fn on_file_size_limit(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
