//! The PIT as the VMM sees it: port 0x61, the PC's system control port B, and the PIT's state
//! section. KVM's in-kernel PIT (`kvm::pit`) handles ports 0x40-0x43; port 0x61 exits here.
//!
//! Port 0x61's bits: 0 = channel 2's gate (read/write), 1 = speaker data enable (read/write),
//! 4 = the refresh toggle (read: flips at each read, which a guest waiting for it to change
//! sees change), 5 = channel 2's output (read). Other bits read 0 and are ignored on write.
//!
//! One fact, one place: the gate lives in KVM's PIT (`channels[2].gate`), set there when a
//! write changes it and read from there; the speaker bit and the refresh toggle, which KVM does
//! not have, live here. A gate change reads KVM's PIT and writes it back whole (`kvm::pit`:
//! there is no call for the gate alone); a count the guest loads on another vCPU between the
//! two would be lost, as under QEMU's in-kernel PIT, which does the same.
//!
//! Channel 2's output is computed, not read: KVM has no call that reports it, and the guest's
//! own way (a read-back command on port 0x43) would change the latches the guest sees. It is
//! computed as KVM computes it for the counts the guest reads on port 0x42 (`pit_get_out` in
//! the kernel's `i8254.c`, the formula QEMU's 8254 uses too): the ticks of the 1.193182 MHz
//! clock since the count was loaded (KVM stamps the load with the host's `CLOCK_MONOTONIC`,
//! which this reads too), against the count, by mode. So the output rises when the count the
//! guest reads reaches 0, to within the exit's own latency.
//!
//! The section (`section_ids::PIT`, instance 0) holds KVM's PIT state (as `kvm::pit` saves it)
//! then one byte of port 0x61 (bits 1 and 4). It is optional on load: a source older than
//! the PIT writes none, and its guest never programmed a PIT (it had none), so the fresh PIT
//! this VM was built with is the state it would have had.

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::device::{Device, DeviceStateError, SectionKind, SectionNeed};
use super::telemetry::host_monotonic_ns;
use crate::kvm::pit::{self, Channel2, PIT_HZ};
use crate::kvm::{KvmError, KvmVm};
use crate::section_ids;

/// The port, and the one byte it spans.
pub const PORT: u16 = 0x61;
pub const LEN: u64 = 1;

/// Layout version of the section this VMM writes and the oldest it loads.
pub const VERSION: u32 = 1;

const GATE: u8 = 1 << 0;
const SPEAKER: u8 = 1 << 1;
const REFRESH: u8 = 1 << 4;
const OUTPUT: u8 = 1 << 5;
/// The bits this device keeps (the gate is KVM's).
const OWN: u8 = SPEAKER | REFRESH;

/// Port 0x61 over KVM's PIT.
pub struct PitPort {
    kvm: Arc<KvmVm>,
    /// `SPEAKER` and `REFRESH` as last written or toggled.
    bits: u8,
}

impl std::fmt::Debug for PitPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PitPort")
            .field("bits", &self.bits)
            .finish_non_exhaustive()
    }
}

impl PitPort {
    /// Creates KVM's PIT in `kvm` (after its interrupt controller) and the port over it; the
    /// PIT exists for as long as this device does, which is what its `save` counts on.
    pub fn create(kvm: Arc<KvmVm>) -> Result<PitPort, KvmError> {
        pit::create(&kvm.vm)?;
        Ok(PitPort { kvm, bits: 0 })
    }

    fn read_port(&mut self) -> u8 {
        self.bits ^= REFRESH;
        let (gate, out) = match pit::channel_2(&self.kvm.vm) {
            Ok(c) => (c.gate, output(&c, host_monotonic_ns())),
            Err(e) => {
                eprintln!("ferry: port 0x61 reads the gate and output as 0: {e}");
                (false, false)
            }
        };
        let pin = |high: bool, bit: u8| if high { bit } else { 0 };
        self.bits | pin(gate, GATE) | pin(out, OUTPUT)
    }

    fn write_port(&mut self, value: u8) {
        self.bits = (self.bits & !SPEAKER) | (value & SPEAKER);
        let gate = value & GATE != 0;
        let now = pit::channel_2(&self.kvm.vm).map(|c| c.gate);
        if now.as_ref().is_ok_and(|&g| g == gate) {
            return;
        }
        if let Err(e) = now.and_then(|_| pit::set_gate_2(&self.kvm.vm, gate)) {
            eprintln!("ferry: port 0x61 could not set PIT channel 2's gate: {e}");
        }
    }
}

/// Channel 2's output at the host's `now_ns`, as KVM's `pit_get_out` computes it: `d` ticks
/// elapsed since the load against the count, by mode (0: high once the count has elapsed; 1:
/// high until it has; 2: high on the tick that ends each period, as KVM and QEMU model it; 3:
/// a square wave, high for the first half of each period; 4 and 5: the one tick at the count).
/// The gate is not looked at, as KVM does not for modes 0 and 4 ("just disable/enable
/// counting", left undone) and restarts the other modes' counts itself.
pub fn output(c: &Channel2, now_ns: u64) -> bool {
    let elapsed = (now_ns as i128 - i128::from(c.loaded_ns)).max(0) as u128;
    let d = (elapsed * u128::from(PIT_HZ) / 1_000_000_000) as u64;
    let count = u64::from(c.count.max(1));
    match c.mode {
        1 => d < count,
        2 => d.is_multiple_of(count) && d != 0,
        3 => d % count < count.div_ceil(2),
        4 | 5 => d == count,
        _ => d >= count,
    }
}

impl Device for PitPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        let value = self.read_port();
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = value;
        }
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        if let Some(&b) = data.first() {
            self.write_port(b);
        }
    }

    fn kind(&self) -> SectionKind {
        SectionKind::single(section_ids::PIT, VERSION)
    }

    fn need(&self) -> SectionNeed {
        SectionNeed::Optional
    }

    fn save(&self) -> Vec<u8> {
        // The PIT was created with this device (`create`), so KVM_GET_PIT2 has one to read:
        // it fails only on a VM descriptor that is not one, which this VM's is.
        let state = pit::save(&self.kvm.vm).expect("the PIT created with its port is there");
        let mut out = state.to_vec();
        out.push(self.bits);
        out
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version("PIT", version, self.kind().loads())?;
        let malformed = |reason: String| DeviceStateError::Malformed {
            device: "PIT",
            reason,
        };
        let [state @ .., bits] = data else {
            return Err(malformed("no bytes".into()));
        };
        if bits & !OWN != 0 {
            return Err(malformed(format!("port 0x61 byte {bits:#04x}")));
        }
        pit::decode(state).map_err(malformed)?;
        pit::restore(&self.kvm.vm, state).map_err(|e| malformed(e.to_string()))?;
        self.bits = *bits;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvm_bindings::kvm_pit_state2;
    use zerocopy::{FromBytes, IntoBytes};

    use super::*;
    use crate::kvm::irqchip;
    use crate::memory::{GuestRam, MIN_MEMORY};

    /// A KVM VM with its interrupt controller and the port over its PIT, as `vm::build` makes
    /// them (no vCPU: the test plays the guest's port accesses itself).
    fn port() -> PitPort {
        crate::kvm::require_for_tests();
        let ram = GuestRam::new(MIN_MEMORY).unwrap();
        let vm = KvmVm::new(crate::kvm::open().unwrap(), &ram).unwrap();
        irqchip::create(&vm.vm).unwrap();
        PitPort::create(Arc::new(vm)).unwrap()
    }

    fn state(saved: &[u8]) -> kvm_pit_state2 {
        kvm_pit_state2::read_from_bytes(&saved[..pit::STATE_BYTES]).unwrap()
    }

    /// The goal: a PIT programmed (channel 2 in mode 0 with a 1 ms count, the gate
    /// and the speaker set through port 0x61) saves, loads into a fresh VM and saves again
    /// bit for bit; on both, port 0x61's output bit rises once the count has elapsed.
    #[test]
    fn the_pit_round_trips_bit_exact_and_port_0x61_gates_and_reads_channel_2() {
        let mut a = port();
        let fresh = a.save();
        assert_eq!(fresh.len(), pit::STATE_BYTES + 1);
        let mut s = state(&fresh);
        let c = &mut s.channels[2];
        (c.mode, c.count, c.rw_mode, c.read_state, c.write_state) = (0, 1193, 3, 3, 3);
        let mut programmed = s.as_bytes().to_vec();
        programmed.push(0);
        a.restore(VERSION, &programmed).unwrap();
        a.write(0, &[GATE | SPEAKER]);
        let saved = a.save();
        assert_eq!(
            state(&saved).channels[2].gate,
            1,
            "the gate reached KVM's PIT"
        );
        assert_eq!(saved[pit::STATE_BYTES], SPEAKER);

        let mut b = port();
        assert_ne!(b.save(), saved, "a fresh PIT differs");
        b.restore(VERSION, &saved).unwrap();
        assert_eq!(b.save(), saved, "save, load, save: the same bytes");

        for p in [&mut a, &mut b] {
            std::thread::sleep(std::time::Duration::from_millis(2));
            let mut r = [0u8; 2];
            p.read(0, &mut r);
            assert_eq!(r[0] & (GATE | SPEAKER | OUTPUT), GATE | SPEAKER | OUTPUT);
            let refresh = r[0] & REFRESH;
            p.read(0, &mut r[..1]);
            assert_ne!(
                r[0] & REFRESH,
                refresh,
                "the refresh bit toggles at each read"
            );
        }
        b.write(0, &[0]);
        let mut r = [0u8];
        b.read(0, &mut r);
        assert_eq!(r[0] & (GATE | SPEAKER), 0);

        let mut bad = saved.clone();
        *bad.last_mut().unwrap() = 0x80;
        assert!(b.restore(VERSION, &bad).is_err());
        assert!(b.restore(VERSION + 1, &saved).is_err());
        assert!(b.restore(VERSION, &saved[1..]).is_err());
    }

    const MS: u64 = 1_000_000;

    fn channel(mode: u8, count: u32) -> Channel2 {
        Channel2 {
            mode,
            count,
            gate: true,
            loaded_ns: 1_000 * MS as i64,
        }
    }

    /// A stream from a source older than the PIT (no section 11) loads, the PIT staying as
    /// it was built; one with the section loads it.
    #[test]
    fn a_stream_without_the_pit_section_loads_and_one_with_it_restores_it() {
        use crate::devices::{BusKind, Devices};
        use crate::part_timer::PartTimer;
        let devices = |p: PitPort| {
            let mut d = Devices::default();
            let at = (BusKind::Pio, u64::from(PORT), LEN);
            d.register("PIT", 0, at, Arc::new(std::sync::Mutex::new(p)))
                .unwrap();
            d
        };
        let mut source = port();
        source.write(0, &[SPEAKER]);
        let saved = devices(source).save(&mut PartTimer::start());
        assert_eq!(saved.len(), 1);
        assert_eq!((saved[0].id, saved[0].version), (section_ids::PIT, VERSION));
        let destination = devices(port());
        destination.load(&[], &mut PartTimer::start()).unwrap();
        let mut r = [0u8];
        destination.io_in(PORT, &mut r);
        assert_eq!(r[0] & SPEAKER, 0, "as built");
        destination.load(&saved, &mut PartTimer::start()).unwrap();
        destination.io_in(PORT, &mut r);
        assert_eq!(r[0] & SPEAKER, SPEAKER, "the source's");
    }

    /// Mode 0 with a 50 ms count (59,659 ticks): low until 50 ms have passed, high after;
    /// the other modes as KVM computes them.
    #[test]
    fn channel_2_output_follows_the_count_by_mode() {
        let at = |c: &Channel2, ms_after: f64| output(c, 1_000 * MS + (ms_after * 1e6) as u64);
        let one_shot = channel(0, 59_659);
        assert!(!at(&one_shot, 0.0));
        assert!(!at(&one_shot, 49.9));
        assert!(at(&one_shot, 50.0));
        assert!(at(&one_shot, 5_000.0), "stays high");
        assert!(
            !output(&one_shot, 0),
            "a clock before the load reads as the load"
        );
        let retrigger = channel(1, 1193);
        assert!(at(&retrigger, 0.5) && !at(&retrigger, 1.0));
        let square = channel(3, 1193);
        assert!(at(&square, 0.2) && !at(&square, 0.7) && at(&square, 1.2));
        let rate = channel(2, 1193);
        assert!(!at(&rate, 0.0) && at(&rate, 1.0001) && !at(&rate, 1.5));
        let strobe = channel(4, 1193);
        assert!(!at(&strobe, 0.5) && at(&strobe, 1.0001) && !at(&strobe, 1.5));
    }
}
