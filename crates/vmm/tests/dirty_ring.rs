//! Issue 34's first step: KVM's dirty ring works on this host's KVM. A VM with the ring enabled
//! runs a few real-mode instructions that write known pages, and the vCPU's ring holds exactly
//! those pages; after `KVM_RESET_DIRTY_RINGS` the same writes are reported again. It drives
//! KVM's ABI directly, below the VMM's own ring (`src/kvm/ring.rs`, `ferry run --dirty-ring`),
//! so that a failure here says the host's KVM, not ferry, is at fault; the VMM's ring is tested
//! by `ring_migrate.rs` and the conformance suite's `dirty_ring` instantiation.

mod common;

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};

use kvm_bindings::{
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_DIRTY_LOG_PAGE_OFFSET,
    KVM_MEM_LOG_DIRTY_PAGES, kvm_dirty_gfn, kvm_enable_cap, kvm_userspace_memory_region,
};
use kvm_ioctls::{Kvm, VcpuExit};

const MEMORY: usize = 1 << 20;
const ENTRIES: usize = 4096;
/// `KVM_DIRTY_GFN_F_DIRTY` and `KVM_DIRTY_GFN_F_RESET` (linux/kvm.h).
const F_DIRTY: u32 = 1;
const F_RESET: u32 = 2;
/// `KVM_RESET_DIRTY_RINGS`: `_IO(KVMIO, 0xc7)`.
const KVM_RESET_DIRTY_RINGS: libc::c_ulong = 0xAEC7;
/// The pages the guest writes, in order (below 64 KiB, so that real mode reaches them).
const WRITTEN: [u64; 6] = [2, 5, 7, 0, 3, 15];

/// The gfns marked dirty in `ring` from entry `from` on, each marked for reset.
fn harvest(ring: *mut kvm_dirty_gfn, from: usize) -> Vec<u64> {
    let mut found = Vec::new();
    for i in from..ENTRIES {
        // SAFETY: `ring` maps ENTRIES entries of the vCPU's ring for the test's life, and `i`
        // is below ENTRIES.
        let entry = unsafe { &*ring.add(i) };
        // SAFETY: the flags word is a u32 of that mapping, which KVM reads and writes too: it is
        // only ever touched through an atomic (acquire to read, release to write, as the ring's
        // ABI asks), which has the u32's size and alignment.
        let flags = unsafe { &*(&raw const entry.flags).cast::<AtomicU32>() };
        if flags.load(Ordering::Acquire) & F_DIRTY == 0 {
            break;
        }
        assert_eq!(entry.slot, 0, "entry {i} names slot {}", entry.slot);
        found.push(entry.offset);
        flags.store(F_RESET, Ordering::Release);
    }
    found
}

#[test]
fn the_dirty_ring_reports_exactly_the_pages_a_vcpu_wrote() {
    common::require_kvm();
    let kvm = Kvm::new().expect("open /dev/kvm");
    let vm = kvm.create_vm().unwrap();
    let cap = [KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_DIRTY_LOG_RING]
        .into_iter()
        .find(|&c| vm.check_extension_raw(c.into()) > 0)
        .expect("this host's KVM offers no dirty ring");
    let mut enable = kvm_enable_cap {
        cap,
        ..Default::default()
    };
    enable.args[0] = (ENTRIES * std::mem::size_of::<kvm_dirty_gfn>()) as u64;
    vm.enable_cap(&enable).expect("enable the dirty ring");
    // SAFETY: a fresh anonymous mapping, owned by this test until it ends.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            MEMORY,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(mem, libc::MAP_FAILED);
    // Real-mode code at 0x1000: `mov byte [page * 0x1000], 0x5a` for each page, then `hlt`.
    let mut code = Vec::new();
    for page in WRITTEN {
        let at = (page * 0x1000) as u16;
        code.extend_from_slice(&[0xc6, 0x06, at as u8, (at >> 8) as u8, 0x5a]);
    }
    code.push(0xf4);
    // SAFETY: 0x1000 + the code lies inside the mapping, which nothing else uses yet.
    unsafe {
        std::ptr::copy_nonoverlapping(code.as_ptr(), (mem as *mut u8).add(0x1000), code.len())
    };
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: KVM_MEM_LOG_DIRTY_PAGES,
        guest_phys_addr: 0,
        memory_size: MEMORY as u64,
        userspace_addr: mem as u64,
    };
    // SAFETY: the mapping lives until the test ends, after the VM is dropped with it.
    unsafe { vm.set_user_memory_region(region) }.unwrap();
    let mut vcpu = vm.create_vcpu(0).unwrap();
    let ring_bytes = ENTRIES * std::mem::size_of::<kvm_dirty_gfn>();
    // SAFETY: maps the vCPU's ring, which KVM sized from `enable.args[0]`, at its documented
    // offset; the mapping is only read and flagged through `harvest`.
    let ring = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            ring_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            vcpu.as_raw_fd(),
            (KVM_DIRTY_LOG_PAGE_OFFSET as usize * 4096) as libc::off_t,
        )
    };
    assert_ne!(ring, libc::MAP_FAILED, "map the dirty ring");
    let ring = ring as *mut kvm_dirty_gfn;
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    sregs.ds.base = 0;
    sregs.ds.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    let mut next = 0;
    for round in 0..2 {
        let regs = kvm_bindings::kvm_regs {
            rip: 0x1000,
            rflags: 2,
            ..Default::default()
        };
        vcpu.set_regs(&regs).unwrap();
        match vcpu.run().unwrap() {
            VcpuExit::Hlt => {}
            other => panic!("round {round}: the guest exited with {other:?}"),
        }
        let found = harvest(ring, next);
        assert_eq!(found, WRITTEN, "round {round}: the ring's pages");
        next += found.len();
        // SAFETY: KVM_RESET_DIRTY_RINGS takes no argument and changes no memory of ours.
        let reset = unsafe { libc::ioctl(vm.as_raw_fd(), KVM_RESET_DIRTY_RINGS, 0) };
        assert_eq!(reset, WRITTEN.len() as i32, "round {round}: entries reset");
    }
    // SAFETY: both mappings were made above and nothing refers to them any more.
    unsafe {
        libc::munmap(ring.cast(), ring_bytes);
        libc::munmap(mem, MEMORY);
    }
}
