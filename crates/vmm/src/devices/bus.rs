//! An address bus: non-overlapping ranges, each owned by one device. The VMM has two, one for
//! I/O ports and one for MMIO; a vCPU exit is routed by address to the device whose range holds
//! it, with the offset from the range's start.
//!
//! Invariant: ranges never overlap (insertion refuses an overlap), so an address has at most
//! one owner. The bus is built before the first vCPU runs and is read-only afterwards, so a
//! lookup takes no lock; only the device found is locked, for the one access.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::device::Device;

/// Why a device could not be placed on a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("{name} at {base:#x}+{len:#x} overlaps {other} at {other_base:#x}")]
    Overlap {
        name: String,
        base: u64,
        len: u64,
        other: String,
        other_base: u64,
    },
    #[error("{name} at {base:#x} has an empty or wrapping range of {len:#x} bytes")]
    Range { name: String, base: u64, len: u64 },
}

/// One range and its device.
struct Slot {
    name: String,
    len: u64,
    device: Arc<Mutex<dyn Device>>,
}

/// Ranges of addresses, by base.
#[derive(Default)]
pub struct Bus {
    slots: BTreeMap<u64, Slot>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.slots.iter().map(|(b, s)| (b, (&s.name, s.len))))
            .finish()
    }
}

impl Bus {
    /// Gives `device` the addresses `base..base + len`.
    pub fn insert(
        &mut self,
        name: &str,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn Device>>,
    ) -> Result<(), BusError> {
        let range_error = || BusError::Range {
            name: name.into(),
            base,
            len,
        };
        let end = base.checked_add(len).ok_or_else(range_error)?;
        if len == 0 {
            return Err(range_error());
        }
        let below = self.slots.range(..end).next_back();
        if let Some((&other_base, other)) = below
            && other_base + other.len > base
        {
            return Err(BusError::Overlap {
                name: name.into(),
                base,
                len,
                other: other.name.clone(),
                other_base,
            });
        }
        self.slots.insert(
            base,
            Slot {
                name: name.into(),
                len,
                device,
            },
        );
        Ok(())
    }

    /// The device owning `addr`, and `addr`'s offset into its range; `None` when no device
    /// does or the access of `len` bytes runs past the range's end.
    fn find(&self, addr: u64, len: usize) -> Option<(&Arc<Mutex<dyn Device>>, u64)> {
        let (&base, slot) = self.slots.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset + len as u64 <= slot.len).then_some((&slot.device, offset))
    }

    /// Reads from the device at `addr`; false when no device owns it.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((d, offset)) => {
                d.lock().unwrap().read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Writes to the device at `addr`; false when no device owns it.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((d, offset)) => {
                d.lock().unwrap().write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::device::{DeviceStateError, SectionKind};

    /// Remembers the last access.
    #[derive(Default)]
    struct Probe {
        last: Option<(u64, Vec<u8>)>,
    }

    impl Device for Probe {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last = Some((offset, data.to_vec()));
        }
        fn kind(&self) -> SectionKind {
            unreachable!("not saved in these tests")
        }
        fn save(&self) -> Vec<u8> {
            Vec::new()
        }
        fn restore(&mut self, _: u32, _: &[u8]) -> Result<(), DeviceStateError> {
            Ok(())
        }
    }

    fn probe() -> Arc<Mutex<Probe>> {
        Arc::new(Mutex::new(Probe::default()))
    }

    #[test]
    fn accesses_reach_the_owner_with_their_offset() {
        let mut bus = Bus::default();
        let (a, b) = (probe(), probe());
        bus.insert("a", 0x3f8, 8, a.clone()).unwrap();
        bus.insert("b", 0x400, 4, b.clone()).unwrap();
        assert!(bus.write(0x3fb, &[7]));
        assert_eq!(a.lock().unwrap().last, Some((3, vec![7])));
        let mut d = [0u8; 2];
        assert!(bus.read(0x402, &mut d));
        assert_eq!(d, [2, 2]);
        assert!(!bus.write(0x3f7, &[1]), "below every range");
        assert!(!bus.write(0x400 + 4, &[1]), "just past a range");
        assert!(
            !bus.read(0x403, &mut [0u8; 2]),
            "an access running past the end"
        );
        assert!(b.lock().unwrap().last.is_none());
    }

    #[test]
    fn overlaps_and_empty_ranges_are_refused() {
        let mut bus = Bus::default();
        bus.insert("uart", 0x3f8, 8, probe()).unwrap();
        for (base, len) in [(0x3f0, 9), (0x3ff, 1), (0x3f8, 8), (0x3f0, 0x100)] {
            let err = bus.insert("x", base, len, probe()).unwrap_err();
            assert!(
                matches!(&err, BusError::Overlap { other, .. } if other == "uart"),
                "{base:#x}+{len}: {err}"
            );
        }
        assert!(matches!(
            bus.insert("x", 0x500, 0, probe()),
            Err(BusError::Range { .. })
        ));
        assert!(matches!(
            bus.insert("x", u64::MAX, 2, probe()),
            Err(BusError::Range { .. })
        ));
        bus.insert("after", 0x400, 1, probe()).unwrap();
        bus.insert("before", 0x3f0, 8, probe()).unwrap();
    }
}
