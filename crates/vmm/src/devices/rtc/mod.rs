//! An MC146818-style RTC with its CMOS memory, at ports 0x70 (index; bit 7 masks NMIs, kept as
//! written) and 0x71 (data), raising IRQ 8 through the in-kernel interrupt controller.
//!
//! - `model.rs`: the chip as a pure value: the time of day (the host's wall clock plus the
//!   offset the guest's writes set), registers A-D, the periodic, alarm and update-ended
//!   interrupts' flags, UIP; every call takes the wall clock as an argument.
//! - `ferry_guest_abi::rtc`: the ports, the registers' bits, and seconds since 1970 to and
//!   from the time registers, BCD or binary, 12- or 24-hour, per register B (the guest reads
//!   them with the same code).
//! - `cmos.rs`: the bytes a PC guest reads at boot (memory sizes, equipment, vCPUs).
//! - `state.rs`: the section (`section_ids::RTC`, instance 0), optional on load.
//!
//! [`RtcDevice`] puts the model on the port bus, behind one lock shared with a timer thread.
//! The thread sleeps until the model's next enabled event ([`model::Rtc::next_event`]) and
//! then brings the model up to date, which raises IRQ 8 (one edge) when an enabled flag was
//! set; with no interrupt enabled, or with the line high until the guest reads register C, it
//! sleeps until an access changes that. So an RTC whose guest enables nothing costs no
//! thread wake-up at all, and a paused VM's RTC changes only by its enabled interrupts, as
//! the chip does, whose clock runs whether or not the CPU does.
//!
//! Optional on load: a source older than the RTC writes no section, and its guest never
//! touched one (it had none), so the RTC this VM was built with (the host's time, the boot
//! CMOS of this VM's own RAM size, which the source's had too) is the state it would have had.
//! A state loaded with its line high raises IRQ 8 again: the edge the source raised may have
//! come after its interrupt controller was saved, and a guest waits for it before it reads
//! register C; one more RTC interrupt, whose register C may read 0, is what a guest's handler
//! takes in its stride.

#![forbid(unsafe_code)]

pub mod cmos;
pub mod model;
pub mod state;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::device::{Device, DeviceStateError, SectionKind, SectionNeed};
use super::irq::IrqLine;
use crate::section_ids;
use model::Rtc;

/// The index port and the data port after it.
pub const PORT: u16 = ferry_guest_abi::rtc::INDEX_PORT;
pub const LEN: u64 = 2;
/// The PC's RTC interrupt: pin 8 of the IOAPIC and the slave PIC's first.
pub const IRQ: u32 = 8;
/// Layout version of the section this VMM writes and the oldest it loads.
pub const VERSION: u32 = 1;

/// What the index port reads: it is write-only on a PC, and reads as an unassigned port does.
const INDEX_READ: u8 = 0xff;

/// The host's wall clock, ns since the Unix epoch (negative before it).
pub fn wall_clock_ns() -> i128 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// The model and the timer thread's stop, under one lock.
struct Locked {
    rtc: Rtc,
    stop: bool,
}

/// What the device and its timer thread share.
struct Shared {
    locked: Mutex<Locked>,
    /// Signalled after every access and load, and at the stop: the next event may have moved.
    changed: Condvar,
    irq: IrqLine,
}

impl Shared {
    fn raise(&self, edge: bool) {
        if edge && let Err(e) = self.irq.raise() {
            eprintln!("ferry: the RTC could not raise IRQ {IRQ}: {e}");
        }
    }
}

/// The RTC on the port bus; see the module doc.
pub struct RtcDevice {
    shared: Arc<Shared>,
    timer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RtcDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RtcDevice").finish_non_exhaustive()
    }
}

impl RtcDevice {
    /// An RTC at the host's time with `cmos` as its other bytes (`cmos::at_boot`), raising
    /// `irq`; starts its timer thread.
    pub fn new(irq: IrqLine, cmos: [u8; model::CMOS_BYTES]) -> std::io::Result<RtcDevice> {
        let shared = Arc::new(Shared {
            locked: Mutex::new(Locked {
                rtc: Rtc::new(cmos, wall_clock_ns()),
                stop: false,
            }),
            changed: Condvar::new(),
            irq,
        });
        let theirs = shared.clone();
        let timer = std::thread::Builder::new()
            .name("ferry-rtc".into())
            .spawn(move || timer(&theirs))?;
        Ok(RtcDevice {
            shared,
            timer: Some(timer),
        })
    }

    /// The model as it is now (for tests and the host's own look at the guest's time).
    pub fn model(&self) -> Rtc {
        self.shared.locked.lock().unwrap().rtc.clone()
    }

    /// Runs `f` on the model at the wall clock's now, raises the line if it went high, and
    /// tells the timer the next event may have moved.
    fn access<T>(&self, f: impl FnOnce(&mut Rtc, i128) -> (T, bool)) -> T {
        let mut locked = self.shared.locked.lock().unwrap();
        let (value, edge) = f(&mut locked.rtc, wall_clock_ns());
        self.shared.raise(edge);
        drop(locked);
        self.shared.changed.notify_one();
        value
    }
}

/// The timer thread: brings the model up to date when an enabled event is due, else sleeps
/// until it is or until an access or a load changes the model. A wall clock stepped back
/// (the guest's time now before the time its flags were brought up to) is taken at once, or
/// the next event would wait for the clock to come back; a sleep is at most a second (the
/// longest event apart, the update), so a step is seen within one.
fn timer(shared: &Shared) {
    let mut locked = shared.locked.lock().unwrap();
    while !locked.stop {
        let now = wall_clock_ns();
        if locked.rtc.time_ns(now) < locked.rtc.seen_ns {
            let edge = locked.rtc.update(now);
            shared.raise(edge);
        }
        locked = match locked.rtc.next_event(now) {
            None => shared.changed.wait(locked).unwrap(),
            Some(at) if at <= now => {
                let edge = locked.rtc.update(now);
                shared.raise(edge);
                locked
            }
            Some(at) => {
                let wait = Duration::from_nanos((at - now).min(i128::from(u64::MAX)) as u64);
                shared.changed.wait_timeout(locked, wait).unwrap().0
            }
        };
    }
}

impl Drop for RtcDevice {
    fn drop(&mut self) {
        self.shared.locked.lock().unwrap().stop = true;
        self.shared.changed.notify_one();
        if let Some(t) = self.timer.take() {
            let _ = t.join();
        }
    }
}

impl Device for RtcDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            0 => INDEX_READ,
            _ => self.access(|rtc, now| rtc.read(now)),
        };
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = value;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&b) = data.first() else { return };
        match offset {
            0 => self.access(|rtc, _| (rtc.select(b), false)),
            _ => self.access(|rtc, now| ((), rtc.write(b, now))),
        }
    }

    fn kind(&self) -> SectionKind {
        SectionKind::single(section_ids::RTC, VERSION)
    }

    fn need(&self) -> SectionNeed {
        SectionNeed::Optional
    }

    fn save(&self) -> Vec<u8> {
        state::encode(&self.shared.locked.lock().unwrap().rtc)
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version("RTC", version, self.kind().loads())?;
        let rtc = state::decode(data).map_err(|reason| DeviceStateError::Malformed {
            device: "RTC",
            reason,
        })?;
        let line = rtc.line;
        self.access(|held, _| {
            *held = rtc;
            ((), false)
        });
        self.shared.raise(line);
        Ok(())
    }
}
