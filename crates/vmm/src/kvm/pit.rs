//! KVM's in-kernel PIT (`KVM_CREATE_PIT2`): an 8254 whose ports 0x40-0x43 KVM handles in the
//! kernel, channel 0 raising IRQ 0 through the in-kernel interrupt controller. Port 0x61 (the
//! PC's system control port B: channel 2's gate and output, the speaker) is not KVM's without
//! `KVM_PIT_SPEAKER_DUMMY`, which this VMM does not ask for: `devices::pit` emulates it, with
//! the calls here to reach channel 2 and to save and load the PIT's state.
//!
//! The state is KVM's `kvm_pit_state2` with one field changed: each channel's
//! `count_load_time` (the host's `CLOCK_MONOTONIC` when its count was loaded) is saved as 0.
//! `KVM_SET_PIT2` ignores it (it reloads every channel's count at the call, the load time
//! becoming the host's now: `kvm_vm_ioctl_set_pit2` → `kvm_pit_load_count`), and a reading of
//! one host's clock means nothing on another; so a save, a load into a fresh VM and a save
//! again give the same bytes. A count in progress would so restart whole at the load:
//! `devices::pit` carries channel 2's one-shot on by loading what was left of it; channel 0's
//! period (at most 55 ms) restarts.
//!
//! Must be created after the interrupt controller (KVM refuses a PIT without one). A fresh PIT
//! does not tick: KVM resets channel 0 to mode 0xff ("never programmed"), which arms no timer,
//! until the guest programs it; so a guest that never does (ferry's) is woken by no IRQ 0.

#![forbid(unsafe_code)]

use kvm_bindings::{kvm_pit_config, kvm_pit_state2};
use kvm_ioctls::VmFd;
use zerocopy::{FromBytes, IntoBytes};

use super::KvmError;
use super::state::{StateError, kvm};

/// The PIT's input clock: 1.193182 MHz (the PC's 14.31818 MHz crystal divided by 12).
pub const PIT_HZ: u64 = 1_193_182;

/// Size of the saved state: KVM's struct, unchanged in layout.
pub const STATE_BYTES: usize = size_of::<kvm_pit_state2>();
const _: () = assert!(STATE_BYTES == 112);

/// Channel 2, the one port 0x61 gates and reads: the speaker's, and the one a guest
/// calibrates its TSC with.
const CHANNEL_2: usize = 2;

/// Creates the PIT; after `irqchip::create`, before the first vCPU runs. Flags 0: no dummy
/// speaker, port 0x61 exits to the VMM.
pub fn create(vm: &VmFd) -> Result<(), KvmError> {
    vm.create_pit2(kvm_pit_config::default())
        .map_err(KvmError::Pit)
}

/// The PIT's state as KVM holds it, load times and all.
pub fn state(vm: &VmFd) -> Result<kvm_pit_state2, StateError> {
    vm.get_pit2().map_err(kvm("read the PIT"))
}

/// A state's bytes as saved (see the module doc: load times zeroed).
pub fn encode(mut s: kvm_pit_state2) -> [u8; STATE_BYTES] {
    for c in &mut s.channels {
        c.count_load_time = 0;
    }
    let mut out = [0; STATE_BYTES];
    out.copy_from_slice(s.as_bytes());
    out
}

/// The PIT's state as saved.
pub fn save(vm: &VmFd) -> Result<[u8; STATE_BYTES], StateError> {
    Ok(encode(state(vm)?))
}

/// Loads a state: every channel's count (re)starts now.
pub fn load(vm: &VmFd, s: &kvm_pit_state2) -> Result<(), StateError> {
    vm.set_pit2(s).map_err(kvm("write the PIT"))
}

/// A saved state's bytes as KVM's struct, refusing another size or reserved words not zero
/// (a layout this VMM does not know); the reason, when refused. Modes are not checked: KVM
/// resets a channel to mode 0xff, "never programmed".
pub fn decode(bytes: &[u8]) -> Result<kvm_pit_state2, String> {
    let s = kvm_pit_state2::read_from_bytes(bytes)
        .map_err(|_| format!("PIT state of {} bytes, want {STATE_BYTES}", bytes.len()))?;
    match s.reserved.iter().all(|&w| w == 0) {
        true => Ok(s),
        false => Err(format!("PIT state with reserved words {:?}", s.reserved)),
    }
}

/// Channel 2 as port 0x61 needs it: what its output depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Channel2 {
    pub mode: u8,
    /// The count loaded, 1..=0x10000 (KVM stores a written 0 as 0x10000).
    pub count: u32,
    pub gate: bool,
    /// The host's `CLOCK_MONOTONIC` (ns) when the count was loaded.
    pub loaded_ns: i64,
}

/// Reads channel 2's mode, count and load time from KVM.
pub fn channel_2(vm: &VmFd) -> Result<Channel2, StateError> {
    let s = vm.get_pit2().map_err(kvm("read the PIT"))?;
    let c = s.channels[CHANNEL_2];
    Ok(Channel2 {
        mode: c.mode,
        count: c.count,
        gate: c.gate != 0,
        loaded_ns: c.count_load_time,
    })
}

/// Sets channel 2's gate. Through `KVM_SET_PIT2`, as QEMU does for its in-kernel PIT, there
/// being no ioctl for the gate alone; that call reloads every channel's count (module doc), so
/// the caller makes it only when the gate changes.
pub fn set_gate_2(vm: &VmFd, high: bool) -> Result<(), StateError> {
    let mut s = vm.get_pit2().map_err(kvm("read the PIT"))?;
    s.channels[CHANNEL_2].gate = u8::from(high);
    vm.set_pit2(&s).map_err(kvm("write the PIT"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_of_another_size_or_with_reserved_words_set_is_refused() {
        let good = kvm_pit_state2::default();
        assert!(decode(good.as_bytes()).is_ok());
        let e = decode(&[0; 111]).unwrap_err();
        assert!(e.contains("111 bytes, want 112"), "{e}");
        let mut reserved = good;
        reserved.reserved[3] = 1;
        assert!(decode(reserved.as_bytes()).is_err());
    }
}
