//! Starting the guest's other vCPUs.
//!
//! ferry's VMM starts a secondary vCPU when the guest asks it to, in the same 32-bit flat
//! protected mode a PVH boot vCPU starts in, at an entry point the guest names: the guest
//! writes, with one 32-bit `out` to [`START_PORT`], the guest-physical address of a
//! [`StartVcpu`] request. This is the idea of Xen's `VCPUOP_up` for PVH guests, which start
//! their secondary vCPUs with a hypercall rather than INIT/SIPI; it spares the guest a 16-bit
//! real-mode trampoline below 1 MiB and the protocol's waits. A vCPU nobody starts stays in
//! KVM's wait-for-SIPI state, so a guest that uses INIT/SIPI still can.

/// The start port. Unassigned on a PC, like the telemetry and exit ports; QEMU drops the write.
pub const START_PORT: u16 = 0x0fec;

/// Most vCPUs a VM has: one byte of APIC id in CPUID leaf 1, with the seeds' largest examples
/// (32 and 40 vCPUs) well inside.
pub const MAX_VCPUS: usize = 64;

/// Encoded size of a [`StartVcpu`].
pub const START_SIZE: usize = 16;

/// "FRSV", little-endian: marks a start request.
pub const START_MAGIC: u32 = u32::from_le_bytes(*b"FRSV");

/// A request to start vCPU `vcpu` at the 32-bit physical address `entry`, with `%ebx = arg`,
/// the other general registers zero, flat 4 GiB code and data segments (selectors 0x08 and
/// 0x10), CR0 = PE | ET and paging off: PVH's entry state, with `arg` where PVH puts its
/// start_info.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartVcpu {
    pub vcpu: u32,
    pub entry: u32,
    pub arg: u32,
}

impl StartVcpu {
    /// `magic:u32 vcpu:u32 entry:u32 arg:u32`, little-endian.
    pub fn to_bytes(&self) -> [u8; START_SIZE] {
        let mut b = [0; START_SIZE];
        for (i, w) in [START_MAGIC, self.vcpu, self.entry, self.arg]
            .into_iter()
            .enumerate()
        {
            b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// Decodes a request; `None` when the magic is wrong.
    pub fn from_bytes(b: &[u8; START_SIZE]) -> Option<StartVcpu> {
        let w = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
        (w(0) == START_MAGIC).then(|| StartVcpu {
            vcpu: w(1),
            entry: w(2),
            arg: w(3),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_requests_round_trip_and_need_their_magic() {
        let r = StartVcpu {
            vcpu: 63,
            entry: 0x10_2000,
            arg: 63,
        };
        let b = r.to_bytes();
        assert_eq!(&b[0..4], b"FRSV");
        assert_eq!(StartVcpu::from_bytes(&b), Some(r));
        assert_eq!(StartVcpu::from_bytes(&[0; START_SIZE]), None);
    }
}
