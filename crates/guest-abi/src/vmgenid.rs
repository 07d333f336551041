//! The VM generation ID: 128 bits the VMM shows the guest on read-only I/O ports, which change
//! when the VM is cloned (every restore of a snapshot draws a new one) and stay the same across
//! a live migration or a local handover. Two restores of one snapshot are two VMs with the same
//! memory (the same RNG state, the same identities kept in RAM); the ID is how a guest tells
//! that it was cloned and must re-seed. It is QEMU's and Firecracker's vmgenid, on ports rather
//! than in a page an ACPI table points at, because ferry's guest has no ACPI.
//!
//! The ID is [`SIZE`] bytes at ports [`PORT`]`..`[`PORT`]` + 16`, read as [`WORDS`] 32-bit `in`s:
//! word k at `PORT + 4k`, little-endian, so byte i of the ID answers at port `PORT + i`. Reads
//! have no side effect and writes are ignored. Under QEMU (or any VMM without the device) the
//! ports are unassigned and read as all-ones: the guest then sees [`GenerationId::ABSENT`],
//! which ferry's VMM never shows (it draws again when the random ID comes out all-ones).
//!
//! A guest reads the ID when it boots and again whenever it looks (ferry's built-in guest: at
//! every heartbeat, four `in`s), and treats any difference from its last look as a clone. It
//! learns of the clone at its next look, not at the instant of the restore.

use core::fmt;

/// First of the ID's ports. 0x0ff0..0x1000 is unassigned on a PC (like the telemetry, exit and
/// start ports just below it), and the 16 ports hold the 16 bytes one to one.
pub const PORT: u16 = 0x0ff0;
/// Bytes in an ID: 128 bits, vmgenid's size, as a random UUID's (the chance two clones of the
/// world's VMs ever draw the same is negligible).
pub const SIZE: usize = 16;
/// 32-bit words a guest reads the ID in.
pub const WORDS: usize = SIZE / 4;

/// Whether `len` ports at `base` lie clear of the ID's.
const fn clear(base: u16, len: u32) -> bool {
    base as u32 + len <= PORT as u32 || base as u32 >= PORT as u32 + SIZE as u32
}

// The ports lie clear of every other port of the ABI: COM1's eight, the telemetry and start
// ports (a 32-bit `out` each) and the exit port (one byte); and below 0x1000.
const _: () = {
    assert!(clear(crate::SERIAL_PORT, 8));
    assert!(clear(crate::TELEMETRY_PORT, 4));
    assert!(clear(crate::EXIT_PORT, 1));
    assert!(clear(crate::smp::START_PORT, 4));
    assert!(PORT as u32 + SIZE as u32 <= 0x1000);
};

/// A VM generation ID, byte 0 first (byte i at port `PORT + i`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GenerationId(pub [u8; SIZE]);

impl GenerationId {
    /// What a guest reads with no device behind the ports (QEMU, another VMM): all-ones.
    pub const ABSENT: GenerationId = GenerationId([0xff; SIZE]);

    /// The ID from the [`WORDS`] words read at `PORT`, `PORT + 4`, ... (little-endian).
    pub fn from_words(words: [u32; WORDS]) -> GenerationId {
        let mut b = [0; SIZE];
        for (chunk, w) in b.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        GenerationId(b)
    }

    /// The bytes at `offset..offset + data.len()` into the ID's ports, all-ones past its end:
    /// what a read of any width answers.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            let at = usize::try_from(offset).ok().and_then(|o| o.checked_add(i));
            *d = at.and_then(|at| self.0.get(at)).copied().unwrap_or(0xff);
        }
    }

    /// As two report detail words: bytes 0..8 and 8..16, each little-endian.
    pub fn to_detail(&self) -> [u64; 2] {
        let half = |i: usize| u64::from_le_bytes(self.0[8 * i..8 * i + 8].try_into().unwrap());
        [half(0), half(1)]
    }

    /// The ID from the two words of [`Self::to_detail`].
    pub fn from_detail(words: [u64; 2]) -> GenerationId {
        let mut b = [0; SIZE];
        b[..8].copy_from_slice(&words[0].to_le_bytes());
        b[8..].copy_from_slice(&words[1].to_le_bytes());
        GenerationId(b)
    }
}

/// 32 lowercase hex digits, byte 0 first.
impl fmt::Display for GenerationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::string::ToString;

    use super::*;

    const ID: GenerationId = GenerationId([
        0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee,
        0xff,
    ]);

    #[test]
    fn four_32_bit_reads_give_the_id_back_byte_for_byte() {
        let words: [u32; WORDS] = core::array::from_fn(|k| {
            let mut w = [0; 4];
            ID.read(4 * k as u64, &mut w);
            u32::from_le_bytes(w)
        });
        assert_eq!(words[0], 0x3322_1100, "word 0 at PORT, little-endian");
        assert_eq!(GenerationId::from_words(words), ID);
        let mut b = [0; 2];
        ID.read(15, &mut b);
        assert_eq!(b, [0xff, 0xff], "byte 15, then all-ones past the end");
        ID.read(u64::MAX, &mut b);
        assert_eq!(b, [0xff, 0xff]);
        assert_eq!(
            GenerationId::from_words([u32::MAX; WORDS]),
            GenerationId::ABSENT
        );
    }

    #[test]
    fn detail_words_and_hex_round_trip() {
        assert_eq!(
            ID.to_detail(),
            [0x7766_5544_3322_1100, 0xffee_ddcc_bbaa_9988]
        );
        assert_eq!(GenerationId::from_detail(ID.to_detail()), ID);
        assert_eq!(ID.to_string(), "00112233445566778899aabbccddeeff");
        assert_eq!(GenerationId::ABSENT.to_string(), "f".repeat(32));
    }
}
