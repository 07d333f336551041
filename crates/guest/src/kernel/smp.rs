//! The secondary vCPUs: the boot vCPU publishes what they share (the command line's
//! parameters, the working set's plan, the clock), then asks the VMM to start each one at
//! `ap_start32` (`ferry_guest_abi::smp`); each comes up through `entry.rs` into `ap_main` with
//! its index, reads what was published and runs the workload on its share.

use core::cell::UnsafeCell;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use ferry_guest::plan::Plan;
use ferry_guest_abi::params::Params;
use ferry_guest_abi::smp::{START_PORT, START_SIZE, StartVcpu};

use super::arch;
use super::clock::Clock;

/// What every vCPU's workload starts from.
#[derive(Clone, Copy)]
pub struct Setup {
    pub params: Params,
    pub plan: Plan,
    /// The boot vCPU's clock; each vCPU reads it on its own kvmclock page.
    pub clock: Clock,
}

struct Published {
    ready: AtomicBool,
    setup: UnsafeCell<MaybeUninit<Setup>>,
}

// SAFETY: `setup` is written once, by the boot vCPU, before `ready` is set (Release) and before
// any other vCPU exists; it is read only after `ready` is seen set (Acquire).
unsafe impl Sync for Published {}

static PUBLISHED: Published = Published {
    ready: AtomicBool::new(false),
    setup: UnsafeCell::new(MaybeUninit::uninit()),
};

/// Secondary vCPUs that stopped their workload for good (`run-ms`).
static PARKED: AtomicU32 = AtomicU32::new(0);

#[repr(C, align(16))]
struct Request(UnsafeCell<[u8; START_SIZE]>);
// SAFETY: only the boot vCPU writes the request, one at a time (see `start_all`).
unsafe impl Sync for Request {}
/// The start request, in the image so it lies below 4 GiB (the port takes 32 bits).
static REQUEST: Request = Request(UnsafeCell::new([0; START_SIZE]));

unsafe extern "C" {
    /// The secondary vCPUs' 32-bit entry (`entry.rs`).
    fn ap_start32();
}

/// On the boot vCPU: publishes `setup` and starts vCPUs 1.. up to `params.vcpus`.
pub fn start_all(setup: Setup) {
    // SAFETY: see `Published`: no other vCPU runs yet, and none reads before `ready`.
    unsafe { (*PUBLISHED.setup.get()).write(setup) };
    PUBLISHED.ready.store(true, Ordering::Release);
    for vcpu in 1..u32::from(setup.params.vcpus) {
        let request = StartVcpu {
            vcpu,
            entry: ap_start32 as *const () as usize as u32,
            arg: vcpu,
        };
        // SAFETY: only this vCPU writes the request; the VMM reads it during the `out` below,
        // which completes before the next write.
        unsafe { *REQUEST.0.get() = request.to_bytes() };
        arch::outl(START_PORT, REQUEST.0.get() as u64 as u32);
    }
}

/// On a secondary vCPU: what the boot vCPU published (it did before starting this one).
pub fn setup() -> Setup {
    while !PUBLISHED.ready.load(Ordering::Acquire) {
        core::hint::spin_loop();
    }
    // SAFETY: `ready` is set, so `setup` was written and is never written again.
    unsafe { (*PUBLISHED.setup.get()).assume_init() }
}

/// A secondary vCPU says it stopped for good.
pub fn park() {
    PARKED.fetch_add(1, Ordering::Release);
}

/// How many secondary vCPUs stopped for good.
pub fn parked() -> u32 {
    PARKED.load(Ordering::Acquire)
}
