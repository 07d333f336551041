//! The VM's clocks across a move: kvmclock and every vCPU's TSC, saved at the pause and set on
//! the destination so that both continue advanced by the time the guest was paused, and no
//! more (the kernel's `Documentation/virt/kvm/devices/vcpu.rst`, `KVM_VCPU_TSC_OFFSET`).
//!
//! At the save (`save`): `KVM_GET_CLOCK` gives kvmclock, and with it, atomically, the host's
//! wall clock (`realtime`) and TSC (`host_tsc`) when KVM runs the VM on its master clock
//! (flags `KVM_CLOCK_REALTIME | KVM_CLOCK_HOST_TSC`); where it does not, the VMM reads both
//! itself right after (a few µs apart, well inside the 1 ms a guest may notice). Each vCPU's
//! TSC offset (guest TSC = host TSC + offset) and the guest's TSC frequency go with them.
//!
//! At the load (`restore`), before the vCPUs' registers: the guest's TSC frequency is given to
//! the vCPUs when it differs from this host's, or refused (`tsc::frequency`); `KVM_SET_CLOCK` with
//! `KVM_CLOCK_REALTIME` sets kvmclock to the saved value plus the wall-clock time since the save
//! (KVM adds it; a KVM without the flag gets the sum computed here), so a migration's, a
//! handover's and a restore's guest all see the time that passed, however long ago the
//! snapshot was taken. `KVM_GET_CLOCK` then says where kvmclock and the host's TSC are now, and
//! each vCPU's TSC offset is set, right after its MSRs (`TscPlan::apply`; a restored
//! `IA32_TSC` would otherwise set the offset again), to keep the guest's TSC where kvmclock puts it:
//! `offset_dst = offset_src + (clock_dst - clock_src) × f + host_tsc_src - host_tsc_dst`
//! ([`dest_offset`]). All vCPUs had one offset relation on the source and keep it, so the
//! guest's clocks stay monotonic across its vCPUs. A KVM without the offset attribute (before
//! Linux 5.16) gets the saved `IA32_TSC` advanced by the same ticks instead.
//!
//! Section layouts (id 2, instance 0): version 1 is kvmclock alone (8 bytes), restored as it
//! was: the guest's clocks stopped for the pause. Version 2 is [`ClockState`]'s encoding.

use kvm_bindings::{KVM_CLOCK_HOST_TSC, KVM_CLOCK_REALTIME, kvm_clock_data};
use kvm_ioctls::{VcpuFd, VmFd};

use super::state::{StateError, kvm};
use super::tsc;

/// The clock section layout this VMM writes, and the oldest it loads.
pub const CLOCK_STATE_VERSION: u32 = 2;
pub const CLOCK_STATE_OLDEST: u32 = 1;
/// Fixed bytes of a version 2 section before its offsets.
const V2_HEAD: usize = 8 + 4 + 4 + 8 + 8 + 4;
/// The VM's clocks at the pause (layout version 2): `clock_ns`, `flags` (u32: KVM's
/// `KVM_GET_CLOCK` flags, saying whether `realtime_ns` and `host_tsc` are KVM's or the VMM's
/// readings), `tsc_khz` (u32), `realtime_ns`, `host_tsc`, the vCPU count (u32) and each
/// vCPU's TSC offset (u64), all little-endian; no offsets when the source's KVM has no offset
/// attribute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClockState {
    /// kvmclock (ns).
    pub clock_ns: u64,
    pub flags: u32,
    /// The guest TSC's frequency (kHz).
    pub tsc_khz: u32,
    /// The host's `CLOCK_REALTIME` (ns since 1970) and TSC when `clock_ns` was read.
    pub realtime_ns: u64,
    pub host_tsc: u64,
    /// Each vCPU's TSC offset, by vCPU id.
    pub offsets: Vec<u64>,
}

impl ClockState {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(V2_HEAD + 8 * self.offsets.len());
        out.extend_from_slice(&self.clock_ns.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.tsc_khz.to_le_bytes());
        out.extend_from_slice(&self.realtime_ns.to_le_bytes());
        out.extend_from_slice(&self.host_tsc.to_le_bytes());
        out.extend_from_slice(&(self.offsets.len() as u32).to_le_bytes());
        for o in &self.offsets {
            out.extend_from_slice(&o.to_le_bytes());
        }
        out
    }
}

/// A clock section as loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Saved {
    /// Version 1: kvmclock only, restored as it was (the clocks stopped for the pause).
    Stopped { clock_ns: u64 },
    /// Version 2: the clocks continue across the move.
    Running(ClockState),
}

impl Saved {
    /// Decodes a section of layout `version` (checked to be one this VMM loads), checking its
    /// length against what it says it holds.
    pub fn decode(version: u32, b: &[u8]) -> Result<Saved, StateError> {
        let malformed = |want: String| {
            StateError::Malformed(format!(
                "clock section version {version} of {} bytes, want {want}",
                b.len()
            ))
        };
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        if version == 1 {
            return match b.len() {
                8 => Ok(Saved::Stopped {
                    clock_ns: u64_at(0),
                }),
                _ => Err(malformed("8".into())),
            };
        }
        if b.len() < V2_HEAD {
            return Err(malformed(format!("at least {V2_HEAD}")));
        }
        let count = u32_at(V2_HEAD - 4) as usize;
        if count > ferry_guest_abi::smp::MAX_VCPUS || b.len() != V2_HEAD + 8 * count {
            return Err(malformed(format!(
                "{V2_HEAD} and 8 per vCPU, at most {}",
                ferry_guest_abi::smp::MAX_VCPUS
            )));
        }
        Ok(Saved::Running(ClockState {
            clock_ns: u64_at(0),
            flags: u32_at(8),
            tsc_khz: u32_at(12),
            realtime_ns: u64_at(16),
            host_tsc: u64_at(24),
            offsets: (0..count).map(|k| u64_at(V2_HEAD + 8 * k)).collect(),
        }))
    }
}

/// TSC ticks at `khz` in `ns` nanoseconds.
pub fn ticks(ns: u64, khz: u32) -> u64 {
    (u128::from(ns) * u128::from(khz) / 1_000_000) as u64
}

/// The TSC offset a vCPU gets on the destination so that its TSC is where it was at the save,
/// advanced by kvmclock's advance since (`clock_dst - clock_src`) at `khz`: its guest TSC at the
/// save was `host_tsc_src + offset_src`, and now reads `host_tsc_dst + offset_dst`.
pub fn dest_offset(offset_src: u64, src: (u64, u64), dst: (u64, u64), khz: u32) -> u64 {
    let ((clock_src, host_tsc_src), (clock_dst, host_tsc_dst)) = (src, dst);
    offset_src
        .wrapping_add(ticks(clock_dst.saturating_sub(clock_src), khz))
        .wrapping_add(host_tsc_src)
        .wrapping_sub(host_tsc_dst)
}

/// kvmclock and the host's wall clock and TSC at one instant: KVM's, or the VMM's readings
/// right after where KVM's flags say it gave none.
fn now(vm: &VmFd) -> Result<kvm_clock_data, StateError> {
    let mut data = vm.get_clock().map_err(kvm("read the VM clock"))?;
    if data.flags & KVM_CLOCK_HOST_TSC == 0 {
        data.host_tsc = tsc::host_tsc();
    }
    if data.flags & KVM_CLOCK_REALTIME == 0 {
        data.realtime = tsc::realtime_ns();
    }
    Ok(data)
}

/// The VM's clocks, taken at pause with its vCPUs (by id) paused.
pub fn save(vm: &VmFd, vcpus: &[&VcpuFd]) -> Result<Vec<u8>, StateError> {
    let data = now(vm)?;
    let tsc_khz = match vcpus.first() {
        Some(v) => v
            .get_tsc_khz()
            .map_err(kvm("read the guest's TSC frequency"))?,
        None => 0,
    };
    let offsets = match vcpus.iter().all(|v| tsc::has_offset(v)) {
        true => vcpus
            .iter()
            .map(|v| tsc::offset(v).map_err(kvm("read a vCPU's TSC offset")))
            .collect::<Result<_, _>>()?,
        false => Vec::new(),
    };
    Ok(ClockState {
        clock_ns: data.clock,
        flags: data.flags,
        tsc_khz,
        realtime_ns: data.realtime,
        host_tsc: data.host_tsc,
        offsets,
    }
    .encode())
}

/// What the vCPUs' TSCs get once their registers and MSRs are restored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TscPlan {
    /// A version 1 section: the saved `IA32_TSC` as it was.
    Keep,
    /// The saved `IA32_TSC` advanced by `ticks` (no offset attribute on one side), written
    /// with the MSRs.
    Advance { ticks: u64 },
    /// Each vCPU's offset, set after its MSRs; `ticks` advance the saved `IA32_TSC` written
    /// with the MSRs meanwhile, so the TSC is never far behind even between the two.
    Offsets { ticks: u64, offsets: Vec<u64> },
}

impl TscPlan {
    /// Ticks to add to a vCPU's saved `IA32_TSC` as its MSRs are written.
    pub fn msr_advance(&self) -> u64 {
        match *self {
            TscPlan::Keep => 0,
            TscPlan::Advance { ticks } | TscPlan::Offsets { ticks, .. } => ticks,
        }
    }

    /// Sets vCPU `id`'s offset, after its MSRs were written.
    pub fn apply(&self, id: usize, vcpu: &VcpuFd) -> Result<(), StateError> {
        if let TscPlan::Offsets { offsets, .. } = self
            && let Some(&offset) = offsets.get(id)
        {
            tsc::set_offset(vcpu, offset).map_err(kvm("set a vCPU's TSC offset"))?;
            tracing::debug!(
                "vCPU {id}: TSC offset {offset:#x} set, reads back {:#x?}",
                tsc::offset(vcpu).ok()
            );
        }
        Ok(())
    }
}

/// Sets the arriving VM's clock from `saved`, its vCPUs (by id) created and not yet run, and
/// says what their TSCs get once their MSRs are in.
pub fn restore(vm: &VmFd, vcpus: &[&VcpuFd], saved: &Saved) -> Result<TscPlan, StateError> {
    let s = match saved {
        Saved::Stopped { clock_ns } => {
            vm.set_clock(&kvm_clock_data {
                clock: *clock_ns,
                ..Default::default()
            })
            .map_err(kvm("write the VM clock"))?;
            return Ok(TscPlan::Keep);
        }
        Saved::Running(s) => s,
    };
    if let Some(first) = vcpus.first() {
        let own = first
            .get_tsc_khz()
            .map_err(kvm("read the guest's TSC frequency"))?;
        let tolerance = tsc::tolerance_ppm();
        if let Some(khz) = tsc::frequency(s.tsc_khz, own, tsc::can_scale(vm), tolerance)? {
            for v in vcpus {
                v.set_tsc_khz(khz)
                    .map_err(kvm("set the guest's TSC frequency"))?;
            }
        }
    }
    let set = match tsc::clock_flags(vm) & KVM_CLOCK_REALTIME {
        0 => kvm_clock_data {
            clock: s
                .clock_ns
                .saturating_add(tsc::realtime_ns().saturating_sub(s.realtime_ns)),
            ..Default::default()
        },
        _ => kvm_clock_data {
            clock: s.clock_ns,
            realtime: s.realtime_ns,
            flags: KVM_CLOCK_REALTIME,
            ..Default::default()
        },
    };
    vm.set_clock(&set).map_err(kvm("write the VM clock"))?;
    let here = now(vm)?;
    let ticks = ticks(here.clock.saturating_sub(s.clock_ns), s.tsc_khz);
    let offsets_here = vcpus.iter().all(|v| tsc::has_offset(v));
    tracing::info!(
        "guest clock advanced by {:.3} ms across the move (source flags {:#x}, here {:#x}); TSC offsets {}",
        here.clock.saturating_sub(s.clock_ns) as f64 / 1e6,
        s.flags,
        here.flags,
        match (s.offsets.len() == vcpus.len(), offsets_here) {
            (true, true) => "set",
            _ => "not offered: IA32_TSC advanced instead",
        }
    );
    tracing::debug!(
        "clocks at the save: kvmclock {} ns, host TSC {}, offsets {:#x?}; here: kvmclock {} ns, host TSC {}, realtime {} ns (saved {} ns)",
        s.clock_ns,
        s.host_tsc,
        s.offsets,
        here.clock,
        here.host_tsc,
        here.realtime,
        s.realtime_ns
    );
    if s.offsets.len() != vcpus.len() || !offsets_here {
        return Ok(TscPlan::Advance { ticks });
    }
    let offsets = s
        .offsets
        .iter()
        .map(|&o| {
            dest_offset(
                o,
                (s.clock_ns, s.host_tsc),
                (here.clock, here.host_tsc),
                s.tsc_khz,
            )
        })
        .collect();
    Ok(TscPlan::Offsets { ticks, offsets })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_round_trips_and_a_bad_length_is_refused() {
        let s = ClockState {
            clock_ns: 5_000_000_000,
            flags: KVM_CLOCK_REALTIME | KVM_CLOCK_HOST_TSC,
            tsc_khz: 2_445_406,
            realtime_ns: 1_790_000_000_000_000_000,
            host_tsc: 123_456_789_000,
            offsets: vec![u64::MAX - 7, u64::MAX - 7],
        };
        let b = s.encode();
        assert_eq!(b.len(), V2_HEAD + 16);
        assert_eq!(Saved::decode(2, &b).unwrap(), Saved::Running(s));
        assert!(Saved::decode(2, &b[..b.len() - 1]).is_err());
        assert!(Saved::decode(2, &b[..V2_HEAD - 1]).is_err());
        let mut lying = b.clone();
        lying[V2_HEAD - 4..V2_HEAD].copy_from_slice(&3u32.to_le_bytes());
        assert!(
            Saved::decode(2, &lying).is_err(),
            "3 offsets claimed, 2 held"
        );
        assert_eq!(
            Saved::decode(1, &42u64.to_le_bytes()).unwrap(),
            Saved::Stopped { clock_ns: 42 }
        );
        assert!(Saved::decode(1, &b).is_err());
    }

    /// On real KVM: a forged section whose guest TSC ran 1% off this host's is refused by the
    /// load when the host cannot scale (this project's host cannot), naming both frequencies;
    /// one within KVM's tolerance is given to the vCPUs; and a section saved here restores
    /// with its kvmclock advanced by the time since the save and one TSC offset per vCPU.
    #[test]
    fn a_restore_sets_the_frequency_it_can_refuses_the_one_it_cannot_and_advances_the_clock() {
        crate::kvm::require_for_tests();
        let vm = kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap();
        let fds = [vm.create_vcpu(0).unwrap(), vm.create_vcpu(1).unwrap()];
        let vcpus: Vec<&VcpuFd> = fds.iter().collect();
        let saved = save(&vm, &vcpus).unwrap();
        let Saved::Running(s) = Saved::decode(CLOCK_STATE_VERSION, &saved).unwrap() else {
            panic!("version 2 is a running clock")
        };
        let own = s.tsc_khz;
        eprintln!("this host: {own} kHz, scales: {}", tsc::can_scale(&vm));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let fresh = kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap();
        let fresh_fds = [fresh.create_vcpu(0).unwrap(), fresh.create_vcpu(1).unwrap()];
        let fresh_vcpus: Vec<&VcpuFd> = fresh_fds.iter().collect();
        let plan = restore(&fresh, &fresh_vcpus, &Saved::Running(s.clone())).unwrap();
        let advanced = fresh.get_clock().unwrap().clock - s.clock_ns;
        assert!(
            (200_000_000..5_000_000_000).contains(&advanced),
            "{advanced} ns"
        );
        match &plan {
            TscPlan::Offsets { offsets, .. } => assert_eq!(offsets[0], offsets[1]),
            TscPlan::Advance { .. } => eprintln!("no TSC offset attribute here"),
            TscPlan::Keep => panic!("a version 2 section keeps the TSC running"),
        }
        if !tsc::can_scale(&vm) {
            let forged = ClockState {
                tsc_khz: own + own / 100,
                ..s.clone()
            };
            let e = restore(&fresh, &fresh_vcpus, &Saved::Running(forged)).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(&format!("{} kHz", own + own / 100)), "{text}");
            assert!(text.contains(&format!("{own} kHz here")), "{text}");
        }
        // A version 1 section restores as it did: kvmclock where it was, the TSC kept.
        let v1 = Saved::Stopped {
            clock_ns: s.clock_ns,
        };
        assert_eq!(restore(&fresh, &fresh_vcpus, &v1).unwrap(), TscPlan::Keep);
        let kept = fresh.get_clock().unwrap().clock - s.clock_ns;
        assert!(kept < 100_000_000, "{kept} ns: the pause is not added");
        let near = ClockState {
            tsc_khz: own + own / 10_000,
            ..s
        };
        restore(&fresh, &fresh_vcpus, &Saved::Running(near)).unwrap();
        assert_eq!(fresh_fds[1].get_tsc_khz().unwrap(), own + own / 10_000);
    }

    #[test]
    fn the_offset_keeps_the_tsc_where_kvmclock_puts_it() {
        let khz = 2_000_000; // 2 ticks per ns
        let offset_src = 1_000u64.wrapping_sub(5_000_000); // a guest TSC behind the host's
        let (src, dst) = ((1_000_000, 5_000_000), (1_500_000, 90_000_000));
        let o = dest_offset(offset_src, src, dst, khz);
        let guest_src = src.1.wrapping_add(offset_src);
        let guest_dst = dst.1.wrapping_add(o);
        assert_eq!(
            guest_dst - guest_src,
            1_000_000,
            "0.5 ms of kvmclock at 2 GHz"
        );
        // Another host whose TSC is behind the source's: the offset takes the difference.
        let o = dest_offset(offset_src, src, (1_500_000, 7), khz);
        assert_eq!(7u64.wrapping_add(o).wrapping_sub(guest_src), 1_000_000);
        assert_eq!(ticks(1_000_000_000, 2_445_406), 2_445_406_000);
    }
}
