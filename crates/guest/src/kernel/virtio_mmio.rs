//! The virtio-mmio transport (version 2) as the guest's drivers use it: register access, the
//! initialisation handshake up to `FEATURES_OK` (virtio 1.2, 3.1.1), queue setup, and telling
//! which device sits at each `virtio_mmio.device=` of the command line by its device ID.
//!
//! Every access traps to the VMM; the guest reads a device's registers only at boot and when
//! its workload polls it.

use core::ptr::{read_volatile, write_volatile};

use ferry_guest_abi::params::{MmioDevice, Params};
use ferry_guest_abi::virtio::{self, balloon, blk, mmio, net, status};

/// The devices the guest drives, as found at boot.
#[derive(Clone, Copy, Debug, Default)]
pub struct Found {
    pub balloon: Option<MmioDevice>,
    pub blk: Option<MmioDevice>,
    pub net: Option<MmioDevice>,
}

/// Reads each announced device's ID: a balloon, a block device and a network device are kept
/// (the first of each), anything else is named on the serial port and left alone.
pub fn identify(p: &Params) -> Found {
    let mut found = Found::default();
    for dev in p.mmio_devices() {
        let t = Transport { base: dev.addr };
        let id = match t.read(mmio::MAGIC_VALUE) == mmio::MAGIC && t.read(mmio::VERSION) == 2 {
            true => t.read(mmio::DEVICE_ID),
            false => 0,
        };
        let slot = match id {
            balloon::DEVICE_ID => &mut found.balloon,
            blk::DEVICE_ID => &mut found.blk,
            net::DEVICE_ID => &mut found.net,
            _ => {
                crate::sprintln!(
                    "ferry-guest: virtio-mmio device at {:#x} has device ID {id} (not a version 2 balloon, block or network device): left alone",
                    dev.addr
                );
                continue;
            }
        };
        if slot.is_some() {
            crate::sprintln!(
                "ferry-guest: a second virtio device of ID {id} at {:#x}: left alone",
                dev.addr
            );
            continue;
        }
        *slot = Some(dev);
    }
    found
}

/// Why a device was given up on (its status then has `FAILED`).
#[derive(Clone, Copy, Debug)]
pub enum Refusal {
    /// The device lacks a feature the driver needs: what it offered.
    Features(u64),
    /// The device cleared `FEATURES_OK`: it does not take the subset the driver chose.
    FeaturesNotOk,
    /// Queue `queue` holds fewer descriptors than the driver uses.
    QueueTooSmall { queue: u32, max: u32 },
}

impl core::fmt::Display for Refusal {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Refusal::Features(offered) => write!(
                f,
                "it offers features {offered:#x}, without one the driver needs (VERSION_1 at least)"
            ),
            Refusal::FeaturesNotOk => f.write_str("it refused the features the driver chose"),
            Refusal::QueueTooSmall { queue, max } => {
                write!(f, "its queue {queue} holds {max} descriptors, too few")
            }
        }
    }
}

/// One device's registers.
#[derive(Clone, Copy, Debug)]
pub struct Transport {
    base: u64,
}

impl Transport {
    pub fn new(dev: MmioDevice) -> Transport {
        Transport { base: dev.addr }
    }

    /// Resets the device, acknowledges it, and agrees on features: all of `required` (which
    /// must include `VERSION_1`) and those of `optional` the device offers. Returns the agreed
    /// set; on a refusal the device is marked `FAILED`.
    pub fn negotiate(&self, required: u64, optional: u64) -> Result<u64, Refusal> {
        // Reset, and wait until the device says it is done (virtio 1.2, 4.2.3.1).
        self.write(mmio::STATUS, 0);
        while self.read(mmio::STATUS) != 0 {
            core::hint::spin_loop();
        }
        self.write(mmio::STATUS, status::ACKNOWLEDGE | status::DRIVER);
        let mut offered = 0u64;
        for half in 0..2 {
            self.write(mmio::DEVICE_FEATURES_SEL, half);
            offered |= u64::from(self.read(mmio::DEVICE_FEATURES)) << (32 * half);
        }
        if offered & required != required {
            return Err(self.fail(Refusal::Features(offered)));
        }
        let agreed = required | (offered & optional);
        for half in 0..2 {
            self.write(mmio::DRIVER_FEATURES_SEL, half);
            self.write(mmio::DRIVER_FEATURES, (agreed >> (32 * half)) as u32);
        }
        self.write(mmio::STATUS, Self::NEGOTIATED);
        if self.read(mmio::STATUS) & status::FEATURES_OK == 0 {
            return Err(self.fail(Refusal::FeaturesNotOk));
        }
        Ok(agreed)
    }

    /// The status once the features are agreed.
    const NEGOTIATED: u32 = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;

    /// Gives queue `q` `size` descriptors at guest-physical `desc`, its driver (avail) ring at
    /// `driver` and its device (used) ring at `device`, and makes it ready.
    pub fn setup_queue(
        &self,
        q: u32,
        size: u32,
        desc: u64,
        driver: u64,
        device: u64,
    ) -> Result<(), Refusal> {
        self.write(mmio::QUEUE_SEL, q);
        let max = self.read(mmio::QUEUE_NUM_MAX);
        if max < size {
            return Err(self.fail(Refusal::QueueTooSmall { queue: q, max }));
        }
        self.write(mmio::QUEUE_NUM, size);
        for (reg, addr) in [
            (mmio::QUEUE_DESC_LOW, desc),
            (mmio::QUEUE_DRIVER_LOW, driver),
            (mmio::QUEUE_DEVICE_LOW, device),
        ] {
            self.write(reg, addr as u32);
            self.write(reg + 4, (addr >> 32) as u32);
        }
        self.write(mmio::QUEUE_READY, 1);
        Ok(())
    }

    /// The driver is set up: the device may use its queues.
    pub fn driver_ok(&self) {
        self.write(mmio::STATUS, Self::NEGOTIATED | status::DRIVER_OK);
    }

    /// Tells the device the driver gave up on it (`FAILED`, virtio 1.2, 3.1.1).
    pub fn fail(&self, why: Refusal) -> Refusal {
        let s = self.read(mmio::STATUS);
        self.write(mmio::STATUS, s | status::FAILED);
        why
    }

    pub fn notify(&self, q: u32) {
        self.write(mmio::QUEUE_NOTIFY, q);
    }

    /// A 32-bit field of the device's configuration space.
    pub fn config(&self, offset: u64) -> u32 {
        self.read(mmio::CONFIG + offset)
    }

    pub fn set_config(&self, offset: u64, value: u32) {
        self.write(mmio::CONFIG + offset, value);
    }

    /// A 64-bit field of the configuration space, read as two 32-bit halves until the
    /// configuration generation says no change came between them (virtio 1.2, 2.5.1).
    pub fn config_u64(&self, offset: u64) -> u64 {
        loop {
            let before = self.read(mmio::CONFIG_GENERATION);
            let value = u64::from(self.config(offset)) | u64::from(self.config(offset + 4)) << 32;
            if self.read(mmio::CONFIG_GENERATION) == before {
                return value;
            }
        }
    }

    /// Bytes of the configuration space from `offset`, read one at a time (a field such as a
    /// MAC is no whole number of 32-bit words) until the configuration generation says no
    /// change came between them.
    pub fn config_bytes<const N: usize>(&self, offset: u64) -> [u8; N] {
        loop {
            let before = self.read(mmio::CONFIG_GENERATION);
            let mut out = [0u8; N];
            for (i, b) in out.iter_mut().enumerate() {
                let at = self.base + mmio::CONFIG + offset + i as u64;
                // SAFETY: as for `read`, one byte of the device's configuration space.
                *b = unsafe { read_volatile(at as *const u8) };
            }
            if self.read(mmio::CONFIG_GENERATION) == before {
                return out;
            }
        }
    }

    pub fn read(&self, reg: u64) -> u32 {
        // SAFETY: the device's MMIO window as the command line announced it, identity mapped
        // (and user-accessible) by the boot page tables like all of the low 4 GiB; each access
        // traps to the VMM.
        unsafe { read_volatile((self.base + reg) as *const u32) }
    }

    pub fn write(&self, reg: u64, value: u32) {
        // SAFETY: as for `read`.
        unsafe { write_volatile((self.base + reg) as *mut u32, value) }
    }
}

/// `VIRTIO_F_VERSION_1` as a bit of the 64-bit feature set.
pub const VERSION_1: u64 = 1 << virtio::F_VERSION_1;

/// A split queue's descriptor (virtio 1.2, 2.7.5), as both drivers lay their queues out.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// An entry of the device (used) ring (2.7.8).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UsedElem {
    pub id: u32,
    pub len: u32,
}
