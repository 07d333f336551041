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
//! then one byte of port 0x61 (bits 1 and 4); layout 2 adds how long channel 2's count had
//! been running at the save (u64 ns) and the host's wall clock then (u64 ns since 1970). It is
//! optional on load: a source older than the PIT writes none, and its guest never programmed
//! a PIT (it had none), so the fresh PIT this VM was built with is the state it would have had.
//!
//! **Channel 2's one-shot goes on across a move.** KVM restarts every count at a load, so a
//! guest timing a TSC calibration window across a move would see the window last the pause
//! longer on its TSC than on the PIT, and calibrate that far wrong. For channel 2 in mode 0 (a
//! calibration's), the load gives KVM what is left of the count: the count less the ticks of
//! its age at the save plus the wall-clock time since (the pause, which the guest's TSC and
//! kvmclock advance by too, `kvm::clock`); a count already run out is loaded as 1 tick, so the
//! output is high within a microsecond (KVM has no way to load a count that has finished). The
//! count the guest loaded is kept ([`Carried`]) and saved again in its place while KVM's
//! channel is still that load, so the state round-trips bit-exact. Channel 0's period (at most
//! 55 ms) restarts, as under QEMU's in-kernel PIT.

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::device::{Device, DeviceStateError, SectionKind, SectionNeed};
use super::rtc::wall_clock_ns;
use super::telemetry::host_monotonic_ns;
use crate::kvm::pit::{self, Channel2, PIT_HZ};
use crate::kvm::{KvmError, KvmVm};
use crate::section_ids;

/// The port, and the one byte it spans.
pub const PORT: u16 = 0x61;
pub const LEN: u64 = 1;

/// Layout version of the section this VMM writes, and the oldest it loads.
pub const VERSION: u32 = 2;
pub const OLDEST: u32 = 1;
/// Bytes after KVM's state: port 0x61's, then (layout 2) channel 2's age and the wall clock.
const TAIL_V1: usize = 1;
const TAIL_V2: usize = 1 + 8 + 8;
/// The bytes of a layout 2 section that a save, a load into a fresh VM and a save again give
/// back exactly: KVM's state and port 0x61's byte. The count's age and the wall clock after
/// them move on with time.
pub const EXACT_BYTES: usize = pit::STATE_BYTES + TAIL_V1;
/// Channel 2's mode that is carried on: 0, interrupt on terminal count (a one-shot).
const ONE_SHOT: u8 = 0;

const GATE: u8 = 1 << 0;
const SPEAKER: u8 = 1 << 1;
const REFRESH: u8 = 1 << 4;
const OUTPUT: u8 = 1 << 5;
/// The bits this device keeps (the gate is KVM's).
const OWN: u8 = SPEAKER | REFRESH;
/// The channel port 0x61 gates and reads.
const CHANNEL_2: usize = 2;

/// Port 0x61 over KVM's PIT.
pub struct PitPort {
    kvm: Arc<KvmVm>,
    /// `SPEAKER` and `REFRESH` as last written or toggled.
    bits: u8,
    /// Channel 2's count as the guest loaded it, where a move's load gave KVM what was left.
    carried: Option<Carried>,
}

/// Channel 2's one-shot carried on across a move (module doc): the count the guest loaded and
/// how long it had run when KVM was given `left` of it at `loaded_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Carried {
    count: u32,
    ran_ns: u64,
    left: u32,
    loaded_ns: i64,
}

/// What is left of a count of `count` ticks that has run `ran_ns`: at least 1 tick, KVM's
/// shortest (a count run out is loaded as one that runs out at once).
fn left_of(count: u32, ran_ns: u64) -> u32 {
    let ran = u128::from(ran_ns) * u128::from(PIT_HZ) / 1_000_000_000;
    (u128::from(count).saturating_sub(ran)).max(1) as u32
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
        Ok(PitPort {
            kvm,
            bits: 0,
            carried: None,
        })
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
        SectionKind {
            id: section_ids::PIT,
            version: VERSION,
            oldest: OLDEST,
        }
    }

    fn need(&self) -> SectionNeed {
        SectionNeed::Optional
    }

    fn save(&self) -> Vec<u8> {
        // The PIT was created with this device (`create`), so KVM_GET_PIT2 has one to read:
        // it fails only on a VM descriptor that is not one, which this VM's is.
        let mut state = pit::state(&self.kvm.vm).expect("the PIT created with its port is there");
        let now = host_monotonic_ns() as i64;
        let c = &mut state.channels[CHANNEL_2];
        let ran_ns = match self.carried {
            Some(k) if c.count == k.left && c.count_load_time == k.loaded_ns => {
                c.count = k.count;
                k.ran_ns + (now - k.loaded_ns).max(0) as u64
            }
            _ => (now - c.count_load_time).max(0) as u64,
        };
        let mut out = pit::encode(state).to_vec();
        out.push(self.bits);
        out.extend_from_slice(&ran_ns.to_le_bytes());
        out.extend_from_slice(&(wall_clock_ns().max(0) as u64).to_le_bytes());
        out
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version("PIT", version, self.kind().loads())?;
        let malformed = |reason: String| DeviceStateError::Malformed {
            device: "PIT",
            reason,
        };
        let tail = match version {
            1 => TAIL_V1,
            _ => TAIL_V2,
        };
        if data.len() != pit::STATE_BYTES + tail {
            return Err(malformed(format!(
                "{} bytes, want {}",
                data.len(),
                pit::STATE_BYTES + tail
            )));
        }
        let (state, tail) = data.split_at(pit::STATE_BYTES);
        let bits = tail[0];
        if bits & !OWN != 0 {
            return Err(malformed(format!("port 0x61 byte {bits:#04x}")));
        }
        let mut s = pit::decode(state).map_err(malformed)?;
        let u64_at = |at: usize| u64::from_le_bytes(tail[at..at + 8].try_into().unwrap());
        let c = &mut s.channels[CHANNEL_2];
        let carried = match (version, c.mode) {
            (1, _) => None,
            (_, ONE_SHOT) => {
                let since = wall_clock_ns() - i128::from(u64_at(9));
                let ran_ns = u64_at(1).saturating_add(since.clamp(0, i128::from(u64::MAX)) as u64);
                let count = c.count;
                c.count = left_of(count, ran_ns);
                Some((count, ran_ns, c.count))
            }
            _ => None,
        };
        let vm = &self.kvm.vm;
        pit::load(vm, &s).map_err(|e| malformed(e.to_string()))?;
        self.carried = match carried {
            Some((count, ran_ns, left)) => {
                let loaded_ns = pit::channel_2(vm)
                    .map_err(|e| malformed(e.to_string()))?
                    .loaded_ns;
                Some(Carried {
                    count,
                    ran_ns,
                    left,
                    loaded_ns,
                })
            }
            None => None,
        };
        self.bits = bits;
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
    /// bit for bit (the count's age and the wall clock after it move on); on both, port
    /// 0x61's output bit rises once the count has elapsed.
    #[test]
    fn the_pit_round_trips_bit_exact_and_port_0x61_gates_and_reads_channel_2() {
        let mut a = port();
        let fresh = a.save();
        assert_eq!(fresh.len(), pit::STATE_BYTES + TAIL_V2);
        a.restore(1, &layout_1(0, 1193)).unwrap();
        a.write(0, &[GATE | SPEAKER]);
        let saved = a.save();
        assert_eq!(
            state(&saved).channels[2].gate,
            1,
            "the gate reached KVM's PIT"
        );
        assert_eq!(saved[pit::STATE_BYTES], SPEAKER);

        let mut b = port();
        assert_ne!(
            b.save()[..EXACT_BYTES],
            saved[..EXACT_BYTES],
            "a fresh PIT differs"
        );
        b.restore(VERSION, &saved).unwrap();
        let again = b.save();
        assert_eq!(
            again[..EXACT_BYTES],
            saved[..EXACT_BYTES],
            "save, load, save: the same bytes"
        );
        let ((age, wall), (age_after, wall_after)) = (tail(&saved), tail(&again));
        assert!(
            age_after >= age && wall_after >= wall,
            "the age and the clock go on"
        );

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
        bad[pit::STATE_BYTES] = 0x80;
        assert!(b.restore(VERSION, &bad).is_err());
        assert!(b.restore(VERSION + 1, &saved).is_err());
        assert!(b.restore(VERSION, &saved[1..]).is_err());
        assert!(
            b.restore(1, &saved).is_err(),
            "layout 2's bytes as layout 1"
        );
    }

    /// A layout 1 section with channel 2 in `mode` with `count` ticks, the gate low.
    fn layout_1(mode: u8, count: u32) -> Vec<u8> {
        let mut s = kvm_pit_state2::default();
        let c = &mut s.channels[2];
        (c.mode, c.count, c.rw_mode, c.read_state, c.write_state) = (mode, count, 3, 3, 3);
        let mut out = s.as_bytes().to_vec();
        out.push(0);
        out
    }

    /// A layout 2 section's channel 2 age and wall clock.
    fn tail(saved: &[u8]) -> (u64, u64) {
        let at = |k: usize| u64::from_le_bytes(saved[k..k + 8].try_into().unwrap());
        (at(EXACT_BYTES), at(EXACT_BYTES + 8))
    }

    /// A 50 ms one-shot on channel 2 that ran 20 ms before the save and waited 10 ms more
    /// before the load (a move's pause) goes on with what is left of it, at most 20 ms, where
    /// a layout 1 load restarts it whole; a save after gives the guest's count again.
    #[test]
    fn channel_2s_one_shot_goes_on_across_a_move_with_what_was_left_of_it() {
        let mut a = port();
        a.restore(1, &layout_1(0, 59_659)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let saved = a.save();
        assert!(tail(&saved).0 >= 20 * MS, "{:?}", tail(&saved));
        std::thread::sleep(std::time::Duration::from_millis(10));
        let mut b = port();
        b.restore(VERSION, &saved).unwrap();
        let loaded = pit::channel_2(&b.kvm.vm).unwrap().count;
        let ran = u32::try_from(30 * PIT_HZ / 1000).unwrap();
        assert!((1..=59_659 - ran).contains(&loaded), "{loaded} ticks left");
        let again = b.save();
        assert_eq!(state(&again).channels[2].count, 59_659, "the guest's count");
        assert!(tail(&again).0 >= 30 * MS, "{:?}", tail(&again));
        let mut c = port();
        c.restore(1, &saved[..EXACT_BYTES]).unwrap();
        assert_eq!(
            pit::channel_2(&c.kvm.vm).unwrap().count,
            59_659,
            "restarted"
        );
        // Another mode is not carried on: its count restarts whole.
        let mut d = port();
        d.restore(1, &layout_1(2, 1193)).unwrap();
        let saved = d.save();
        b.restore(VERSION, &saved).unwrap();
        assert_eq!(pit::channel_2(&b.kvm.vm).unwrap().count, 1193);
    }

    #[test]
    fn what_is_left_of_a_count_is_at_least_one_tick() {
        assert_eq!(left_of(59_659, 0), 59_659);
        assert_eq!(left_of(1193, 500_000), 1193 - 596);
        assert_eq!(left_of(59_659, 50 * MS), 1, "run out");
        assert_eq!(left_of(59_659, u64::MAX), 1);
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
