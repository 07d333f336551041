//! The VM's control tested on real KVM: a pause that a vCPU cannot answer, and a start the
//! guest asked for just before a pause.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_guest_abi::smp::StartVcpu;

use super::build::Vm;
use super::config::{GuestKind, VmConfig};
use super::handle::ControlError;
use super::state::{RunState, StopReason};
use crate::devices::serial::SerialOutput;
use crate::kvm;
use crate::kvm::vcpu::KVM_MP_STATE_RUNNABLE;

/// A pause waited without bound for every vCPU to park: one that cannot (blocked on a
/// postcopy page) held the caller, the API's one thread, for good. Here an extra vCPU that
/// never parks is counted in: the pause gives up, and the VM runs on.
#[test]
fn regression_a_pause_that_a_vcpu_cannot_answer_gives_up_and_the_vm_runs_on() {
    kvm::require_for_tests();
    let vm = Vm::boot(VmConfig {
        memory_bytes: 64 << 20,
        vcpus: 1,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: "ws=4M log-ms=0".into(),
        guest: GuestKind::Foreign,
        serial: SerialOutput::Discard,
        balloon: false,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout: false,
    })
    .unwrap();
    let h = vm.handle();
    let beats = |n: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.telemetry().heartbeats < n {
            assert!(Instant::now() < deadline, "the guest stopped reporting");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    beats(2);
    h.lock().vcpus_alive += 1; // a vCPU that never parks
    let e = h.pause_within(Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(
            e,
            ControlError::PauseTimeout {
                parked: 1,
                alive: 2,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(h.state(), RunState::Running);
    beats(h.telemetry().heartbeats + 2);
    h.lock().vcpus_alive -= 1;
    h.pause().unwrap();
    assert_eq!(h.state(), RunState::Paused);
    h.stop(StopReason::Requested("test".into()));
    vm.wait();
}

/// A start the guest asked for while the target had already parked for a pause is carried
/// out by the pause: the paused VM holds that vCPU started (runnable, at its entry).
#[test]
fn a_start_asked_just_before_a_pause_is_made_by_the_pause() {
    kvm::require_for_tests();
    // The built-in guest, told it has one vCPU, never starts vCPU 1 itself.
    let vm = Vm::boot(VmConfig {
        memory_bytes: 128 << 20,
        vcpus: 2,
        kernel: Arc::from(ferry_guest_image::ELF),
        cmdline: "ws=8M vcpus=1 log-ms=0".into(),
        guest: GuestKind::Foreign,
        serial: SerialOutput::Discard,
        balloon: false,
        disk: None,
        net: None,
        dirty_ring: None,
        host_pages: Default::default(),
        next_layout: false,
    })
    .unwrap();
    let h = vm.handle();
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.telemetry().heartbeats < 2 {
        assert!(Instant::now() < deadline, "the guest never reported");
        std::thread::sleep(Duration::from_millis(5));
    }
    h.pause().unwrap();
    let vcpu1 = || h.0.vcpus()[1].lock().unwrap();
    assert_ne!(
        vcpu1().get_mp_state().unwrap().mp_state,
        KVM_MP_STATE_RUNNABLE,
        "vCPU 1 waits for a start"
    );
    // As if vCPU 0 had asked just before the pause, with vCPU 1 already parked.
    h.lock().starts[1] = Some(StartVcpu {
        vcpu: 1,
        entry: 0x12_3450,
        arg: 1,
    });
    h.pause().unwrap();
    assert!(h.lock().starts[1].is_none(), "the request was carried out");
    let vcpu = vcpu1();
    assert_eq!(vcpu.get_mp_state().unwrap().mp_state, KVM_MP_STATE_RUNNABLE);
    let regs = vcpu.get_regs().unwrap();
    assert_eq!((regs.rip, regs.rbx), (0x12_3450, 1));
}
