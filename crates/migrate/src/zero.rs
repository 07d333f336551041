//! Is a page all zeros? Vectorised with runtime CPU detection (AVX-512, AVX2, SSE2), reading
//! 256 bytes per step and leaving at the first step with a non-zero byte, so a data page costs
//! one step and only a zero page is read in full.

use std::sync::OnceLock;

/// Bytes examined per step: four 64-byte lines, enough for the loads to overlap.
const STEP: usize = 256;

/// The instruction set the scan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Sse2,
}

impl Isa {
    /// The best this CPU offers (detected once).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            if std::arch::is_x86_feature_detected!("avx512f") {
                Isa::Avx512
            } else if std::arch::is_x86_feature_detected!("avx2") {
                Isa::Avx2
            } else {
                Isa::Sse2
            }
        })
    }
}

/// Whether `bytes` (a multiple of 256 bytes long, e.g. a page) are all zero, with the best ISA.
pub fn is_zero(bytes: &[u8]) -> bool {
    is_zero_with(Isa::detect(), bytes)
}

/// Whether `bytes` are all zero, using `isa` (which must be supported; callers use
/// [`Isa::detect`] or a lesser one).
pub fn is_zero_with(isa: Isa, bytes: &[u8]) -> bool {
    assert_eq!(
        bytes.len() % STEP,
        0,
        "zero scan works on whole 256-byte steps"
    );
    match isa {
        // SAFETY: AVX-512F was detected at run time before `Avx512` can be chosen.
        Isa::Avx512 if Isa::detect() == Isa::Avx512 => unsafe { zero_avx512(bytes) },
        // SAFETY: AVX2 is implied by AVX-512F machines and detected otherwise.
        Isa::Avx2 | Isa::Avx512 if Isa::detect() != Isa::Sse2 => unsafe { zero_avx2(bytes) },
        // SAFETY: SSE2 is part of the x86-64 baseline every build of ferry targets.
        _ => unsafe { zero_sse2(bytes) },
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn zero_avx512(bytes: &[u8]) -> bool {
    use std::arch::x86_64::*;
    for step in bytes.chunks_exact(STEP) {
        let p = step.as_ptr() as *const __m512i;
        // SAFETY: `step` is 256 readable bytes; unaligned loads are allowed.
        let v = unsafe {
            _mm512_or_si512(
                _mm512_or_si512(_mm512_loadu_si512(p), _mm512_loadu_si512(p.add(1))),
                _mm512_or_si512(_mm512_loadu_si512(p.add(2)), _mm512_loadu_si512(p.add(3))),
            )
        };
        if _mm512_test_epi64_mask(v, v) != 0 {
            return false;
        }
    }
    true
}

#[target_feature(enable = "avx2")]
unsafe fn zero_avx2(bytes: &[u8]) -> bool {
    use std::arch::x86_64::*;
    for step in bytes.chunks_exact(STEP) {
        let p = step.as_ptr() as *const __m256i;
        // SAFETY: `step` is 256 readable bytes; unaligned loads are allowed.
        let v = unsafe {
            let a = _mm256_or_si256(_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1)));
            let b = _mm256_or_si256(_mm256_loadu_si256(p.add(2)), _mm256_loadu_si256(p.add(3)));
            let c = _mm256_or_si256(_mm256_loadu_si256(p.add(4)), _mm256_loadu_si256(p.add(5)));
            let d = _mm256_or_si256(_mm256_loadu_si256(p.add(6)), _mm256_loadu_si256(p.add(7)));
            _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d))
        };
        if _mm256_testz_si256(v, v) == 0 {
            return false;
        }
    }
    true
}

/// SSE2 is part of x86-64, so this needs no detection.
#[target_feature(enable = "sse2")]
fn zero_sse2(bytes: &[u8]) -> bool {
    use std::arch::x86_64::*;
    for step in bytes.chunks_exact(STEP) {
        let p = step.as_ptr() as *const __m128i;
        let mut acc = _mm_setzero_si128();
        for i in 0..STEP / 16 {
            // SAFETY: `step` is 256 readable bytes, 16 loads of 16; unaligned loads allowed.
            acc = _mm_or_si128(acc, unsafe { _mm_loadu_si128(p.add(i)) });
        }
        if _mm_movemask_epi8(_mm_cmpeq_epi8(acc, _mm_setzero_si128())) != 0xffff {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_isa_agrees_on_every_byte_position() {
        let mut page = vec![0u8; 4096];
        for isa in [Isa::Sse2, Isa::Avx2, Isa::Avx512] {
            assert!(is_zero_with(isa, &page), "{isa:?}");
            for pos in [0, 1, 63, 64, 255, 256, 2048, 4095] {
                page[pos] = 0x80;
                assert!(!is_zero_with(isa, &page), "{isa:?} missed byte {pos}");
                page[pos] = 0;
            }
        }
    }

    #[test]
    fn detection_picks_something_this_cpu_runs() {
        assert!(is_zero(&[0u8; 512]));
        assert!(!is_zero(&[1u8; 512]));
    }
}
