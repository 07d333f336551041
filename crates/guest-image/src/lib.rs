//! The built-in test guest as bytes: a PVH-bootable x86-64 ELF built from `crates/guest` by
//! this crate's build script with the host's own toolchain (no extra rustup target), so
//! `cargo build` of anything that depends on this crate carries the guest inside it.

#![forbid(unsafe_code)]

/// The guest kernel ELF (entered through its PVH note, type 18, owner "Xen").
pub static ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ferry-guest.elf"));

#[cfg(test)]
mod tests {
    use super::ELF;

    fn u16_at(o: usize) -> u16 {
        u16::from_le_bytes(ELF[o..o + 2].try_into().unwrap())
    }
    fn u32_at(o: usize) -> u32 {
        u32::from_le_bytes(ELF[o..o + 4].try_into().unwrap())
    }
    fn u64_at(o: usize) -> u64 {
        u64::from_le_bytes(ELF[o..o + 8].try_into().unwrap())
    }

    /// The ELF is a static x86-64 executable whose PT_NOTE holds the PVH entry note, and the
    /// note's entry is the ELF entry (a 32-bit address inside the loaded image).
    #[test]
    fn elf_carries_the_pvh_entry_note() {
        assert_eq!(&ELF[..4], b"\x7fELF");
        assert_eq!(ELF[4], 2, "ELFCLASS64");
        assert_eq!(u16_at(16), 2, "ET_EXEC");
        assert_eq!(u16_at(18), 62, "EM_X86_64");
        let entry = u64_at(24);
        let (phoff, phentsize, phnum) = (u64_at(32) as usize, u16_at(54) as usize, u16_at(56));
        let mut pvh_entry = None;
        for i in 0..phnum as usize {
            let ph = phoff + i * phentsize;
            if u32_at(ph) != 4 {
                continue; // not PT_NOTE
            }
            assert_eq!(
                u64_at(ph + 48),
                4,
                "PT_NOTE must be 4-byte aligned for QEMU"
            );
            let (mut off, end) = (
                u64_at(ph + 8) as usize,
                (u64_at(ph + 8) + u64_at(ph + 32)) as usize,
            );
            while off < end {
                let (namesz, descsz, kind) = (u32_at(off), u32_at(off + 4), u32_at(off + 8));
                let name = &ELF[off + 12..off + 12 + namesz as usize];
                let desc = off + 12 + (namesz as usize).next_multiple_of(4);
                if kind == 18 && name == b"Xen\0" {
                    pvh_entry = Some(u32_at(desc));
                }
                off = desc + (descsz as usize).next_multiple_of(4);
            }
        }
        assert_eq!(pvh_entry.map(u64::from), Some(entry));
        assert!((0x100000..1 << 32).contains(&entry));
    }
}
