//! The four memory routines the compiler calls and a C runtime would provide. Written with
//! `rep movsb`/`rep stosb` (fast on every CPU with ERMSB, and impossible for the compiler to
//! turn back into a call to themselves, which a plain loop invites).

use core::arch::asm;

/// # Safety
///
/// `dst` and `src` must be valid for `n` bytes and must not overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees both ranges; the direction flag is clear (cleared at entry
    // and never set outside `memmove`, which restores it).
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _,
             options(nostack, preserves_flags))
    };
    dst
}

/// # Safety
///
/// `dst` and `src` must be valid for `n` bytes; they may overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) <= (src as usize) || (dst as usize) >= (src as usize) + n {
        // SAFETY: a forward copy is correct when dst is below src or the ranges are disjoint.
        return unsafe { memcpy(dst, src, n) };
    }
    // SAFETY: copy backwards from the last byte; std/cld bracket the instruction.
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
             options(nostack))
    };
    dst
}

/// # Safety
///
/// `dst` must be valid for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memset(dst: *mut u8, value: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees the range; the direction flag is clear.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") value as u8,
             options(nostack, preserves_flags))
    };
    dst
}

/// # Safety
///
/// `a` and `b` must be valid for `n` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    for i in 0..n {
        // SAFETY: i < n and the caller guarantees n bytes.
        let (x, y) = unsafe { (a.add(i).read(), b.add(i).read()) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
    }
    0
}

/// # Safety
///
/// As for `memcmp`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract.
    unsafe { memcmp(a, b, n) }
}

/// The unwinding personality routine that the precompiled `core` (built with unwinding for
/// the host target) refers to. This kernel builds with `panic=abort`, so nothing unwinds and
/// the routine is never called; it exists only to satisfy the linker.
#[unsafe(no_mangle)]
pub extern "C" fn rust_eh_personality() {}
