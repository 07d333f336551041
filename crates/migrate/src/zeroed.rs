//! Zeroed words straight from the kernel, for the bitmaps that span all of guest RAM (a bit
//! per page: 16 MiB at 512 GiB). An anonymous mapping reads as zeros and costs memory only
//! where a word is written, so a bitmap costs what is set in it from the moment it exists.
//!
//! Why not `vec![0; n]`: the allocator's zeroed memory is free only while it comes from a
//! fresh mapping. glibc raises its mmap threshold to the size of the last mapped chunk it
//! freed, so after one bitmap of a migration is dropped the next one of that size comes from
//! the heap and is cleared with `memset`, every page of it: measured at 6.8-7.3 ms for the
//! 16 MiB copy postcopy takes while the guest is paused, in a 511 GiB guest. A mapping of our
//! own never is.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// Types for which all-zero bytes are a valid value.
///
/// # Safety
///
/// All-zero bytes must be a valid value of the implementing type.
pub unsafe trait Zeroable: Sized {}

// SAFETY: zero is a valid u64.
unsafe impl Zeroable for u64 {}
// SAFETY: AtomicU64 has u64's layout, and zero is a valid value of it.
unsafe impl Zeroable for AtomicU64 {}

/// `len` values of `T`, all zero when made, in an anonymous mapping of their own.
pub struct Zeroed<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: `Zeroed` owns its mapping exclusively, like a `Vec<T>` owns its buffer.
unsafe impl<T: Zeroable + Send> Send for Zeroed<T> {}
// SAFETY: shared access hands out only `&[T]`, as `Vec<T>` does.
unsafe impl<T: Zeroable + Sync> Sync for Zeroed<T> {}

impl<T: Zeroable> Zeroed<T> {
    /// `len` zeros. Panics when the address space cannot be had, as `Vec` aborts when memory
    /// cannot (the mapping is `MAP_NORESERVE`: only written pages take memory).
    pub fn new(len: usize) -> Zeroed<T> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("a bitmap's size fits the address space");
        if bytes == 0 {
            return Zeroed {
                ptr: NonNull::dangling(),
                len,
            };
        }
        // SAFETY: a new private anonymous mapping: no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert!(
            p != libc::MAP_FAILED,
            "cannot map {bytes} bytes of bitmap: {}",
            std::io::Error::last_os_error()
        );
        Zeroed {
            ptr: NonNull::new(p.cast()).expect("mmap returned a non-null address"),
            len,
        }
    }
}

impl<T: Zeroable> Deref for Zeroed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` is a live mapping (or dangling for 0 elements) of `len` values of `T`,
        // each valid since the mapping began zeroed (`Zeroable`) and was only written as `T`s.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for Zeroed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> Drop for Zeroed<T> {
    fn drop(&mut self) {
        let bytes = self.len * std::mem::size_of::<T>();
        if bytes != 0 {
            // SAFETY: the mapping made in `new`, of `bytes` bytes, no longer referenced (the
            // slices borrowed from it cannot outlive `self`).
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), bytes) };
        }
    }
}

impl<T: Zeroable> std::fmt::Debug for Zeroed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Zeroed({} words)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_that_can_be_written_and_read_back() {
        let mut w: Zeroed<u64> = Zeroed::new(1 << 21); // 16 MiB: a 512 GiB guest's bitmap
        assert_eq!(w.len(), 1 << 21);
        assert!(w[..1024].iter().all(|&x| x == 0) && w[(1 << 21) - 1] == 0);
        w[12_345] = 7;
        assert_eq!(w.iter().filter(|&&x| x != 0).count(), 1);
        let empty: Zeroed<AtomicU64> = Zeroed::new(0);
        assert!(empty.is_empty());
    }
}
