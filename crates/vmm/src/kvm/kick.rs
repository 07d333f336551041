//! Kicking a vCPU thread out of `KVM_RUN`.
//!
//! A real-time signal is sent to the vCPU thread; its handler sets `kvm_run.immediate_exit`
//! through a thread-local pointer. If the signal lands while the thread is inside `KVM_RUN`,
//! the ioctl returns `EINTR`; if it lands just before, `immediate_exit` makes the next
//! `KVM_RUN` return at once. Either way the thread sees its control state before running
//! guest code again, with no window for a lost kick.

use std::cell::Cell;
use std::sync::Once;

use vmm_sys_util::signal::{SIGRTMIN, register_signal_handler};

thread_local! {
    /// This thread's `kvm_run.immediate_exit`, or null. Const-initialised without a
    /// destructor, so reading it from a signal handler touches no lazy state.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

/// CPU time thread `t` has used, in ns (0 if it cannot be read).
///
/// # Safety
///
/// `t` must name a thread that has not been joined (the same condition as [`kick`]'s).
pub unsafe fn thread_cpu_ns(t: libc::pthread_t) -> u64 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `t` names a live or exited-but-unjoined thread (the caller's contract); the
    // clock id is written to a local.
    if unsafe { libc::pthread_getcpuclockid(t, &mut clock) } != 0 {
        return 0;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a local timespec to fill.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The signal used for kicks.
pub fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let p = IMMEDIATE_EXIT.with(Cell::get);
    if !p.is_null() {
        // SAFETY: a non-null pointer was registered by this very thread and points into its
        // vCPU's kvm_run mapping, which outlives the registration (see `Registration`).
        unsafe { p.write_volatile(1) };
    }
}

/// Installs the kick handler once per process.
pub fn install_handler() -> Result<(), vmm_sys_util::errno::Error> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| result = register_signal_handler(kick_signal(), on_kick));
    result
}

/// While alive, kicks of the current thread set `*immediate_exit`.
#[derive(Debug)]
pub struct Registration(());

impl Registration {
    /// Registers `immediate_exit` for the current thread.
    ///
    /// # Safety
    ///
    /// `immediate_exit` must stay valid until the returned value is dropped, on this thread.
    pub unsafe fn new(immediate_exit: *mut u8) -> Registration {
        IMMEDIATE_EXIT.with(|c| c.set(immediate_exit));
        Registration(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        IMMEDIATE_EXIT.with(|c| c.set(std::ptr::null_mut()));
    }
}

/// Sends a kick to `thread`.
///
/// # Safety
///
/// `thread` must be a thread of this process that has not been joined yet.
pub unsafe fn kick(thread: libc::pthread_t) {
    // SAFETY: the caller guarantees the handle is valid; the signal has a handler installed.
    unsafe { libc::pthread_kill(thread, kick_signal()) };
}
