//! The telemetry port as a bus device: the guest writes, with one 32-bit `out`, the address of
//! a report in its memory; the device reads it and records it, stamped with the host's clock,
//! in the [`GuestTelemetry`] that the VM's status shows. Its state is the telemetry itself, so
//! counters and heartbeats continue across a migration.
//!
//! It is also the device the version-range tests bump: [`Layout::Next`] stands for the layout a
//! newer ferry would write, [`NEXT_VERSION`], which is [`VERSION`]'s bytes followed by one
//! counter the device keeps anyway (its bad writes, 8 bytes little-endian). A port of the next
//! layout writes it and loads both; one of today's loads [`VERSION`] only, and so refuses a
//! guest coming from the "newer" ferry, which is what the tests check is refused before the
//! source pauses.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use ferry_guest_abi::report::REPORT_SIZE;

use super::device::{Device, DeviceStateError, SectionKind};
use super::telemetry::{GuestTelemetry, host_monotonic_ns};
use crate::memory::GuestRam;
use crate::section_ids::{self, TELEMETRY_PORT};

/// Version of the telemetry section layout this ferry writes (3: version 2's bytes, then the
/// least late report before the move as guest and host ns, two little-endian u64, zero for
/// none, which the clock jump across the move is measured from).
pub const VERSION: u32 = 3;
/// The oldest layout it loads (2: counters per vCPU; the clock jump is then measured from the
/// source's latest report).
pub const OLDEST: u32 = 2;
/// The next layout ([`Layout::Next`]): [`VERSION`]'s bytes, then the port's bad writes.
pub const NEXT_VERSION: u32 = VERSION + 1;
/// The port takes one 32-bit write.
pub const LEN: u64 = 4;
/// Bytes version 3 appends to version 2: the least late report before the move.
const MARK_TAIL: usize = 16;
/// Bytes the next layout appends: the bad-write count as one little-endian u64.
const NEXT_TAIL: usize = 8;
const NAME: &str = section_ids::name(TELEMETRY_PORT);

/// Which section layout the port writes, and so which it loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// [`VERSION`], written and loaded: today's ferry.
    #[default]
    Current,
    /// [`NEXT_VERSION`] written, [`VERSION`] to [`NEXT_VERSION`] loaded: a newer ferry, as
    /// the version-range tests make one (`VmConfig::next_layout`).
    Next,
}

#[derive(Debug)]
pub struct TelemetryPort {
    telemetry: Arc<Mutex<GuestTelemetry>>,
    ram: Arc<GuestRam>,
    layout: Layout,
    /// Writes that named no report: not one 32-bit word, or an address outside guest RAM (a
    /// report that is there but invalid counts in the telemetry's `invalid_reports`). Kept by
    /// every port; only the next layout carries it across a migration, and a port that loads
    /// an older layout starts it at 0, the older ferry having passed none on.
    bad_writes: u64,
}

impl TelemetryPort {
    pub fn new(
        telemetry: Arc<Mutex<GuestTelemetry>>,
        ram: Arc<GuestRam>,
        layout: Layout,
    ) -> TelemetryPort {
        TelemetryPort {
            telemetry,
            ram,
            layout,
            bad_writes: 0,
        }
    }

    /// Writes that named no report since the guest booted, as far as the layouts it migrated
    /// in carried them.
    pub fn bad_writes(&self) -> u64 {
        self.bad_writes
    }
}

impl Device for TelemetryPort {
    fn read(&mut self, _: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write(&mut self, _: u64, data: &[u8]) {
        let Ok(word) = <[u8; 4]>::try_from(data) else {
            self.bad_writes += 1;
            tracing::warn!("telemetry port written with {} bytes, not 4", data.len());
            return;
        };
        let gpa = u64::from(u32::from_le_bytes(word));
        let host_ns = host_monotonic_ns();
        let mut bytes = [0u8; REPORT_SIZE];
        let result = match self.ram.read(gpa, &mut bytes) {
            Ok(()) => self
                .telemetry
                .lock()
                .unwrap()
                .record_bytes(&bytes, host_ns)
                .map(|_| ())
                .map_err(|e| format!("{e:?}")),
            Err(e) => {
                self.bad_writes += 1;
                Err(e.to_string())
            }
        };
        if let Err(e) = result {
            tracing::warn!("invalid telemetry report at {gpa:#x}: {e}");
        }
    }

    fn kind(&self) -> SectionKind {
        match self.layout {
            Layout::Current => SectionKind {
                id: TELEMETRY_PORT,
                version: VERSION,
                oldest: OLDEST,
            },
            Layout::Next => SectionKind {
                id: TELEMETRY_PORT,
                version: NEXT_VERSION,
                oldest: OLDEST,
            },
        }
    }

    fn save(&self) -> Vec<u8> {
        let telemetry = self.telemetry.lock().unwrap();
        let mut state = telemetry.encode_state();
        let (guest, host) = telemetry.clock_mark().unwrap_or((0, 0));
        state.extend_from_slice(&guest.to_le_bytes());
        state.extend_from_slice(&host.to_le_bytes());
        if self.layout == Layout::Next {
            state.extend_from_slice(&self.bad_writes.to_le_bytes());
        }
        state
    }

    fn restore(&mut self, version: u32, data: &[u8]) -> Result<(), DeviceStateError> {
        DeviceStateError::check_version(NAME, version, self.kind().loads())?;
        let (data, bad_writes) = match version {
            NEXT_VERSION => {
                let (head, tail) = split_tail(data, NEXT_TAIL, "the bad-write count")?;
                (head, u64::from_le_bytes(tail.try_into().unwrap()))
            }
            _ => (data, 0),
        };
        let (data, mark) = match version {
            OLDEST => (data, None),
            _ => {
                let (head, tail) = split_tail(data, MARK_TAIL, "the report before the move")?;
                let word =
                    |i: usize| u64::from_le_bytes(tail[8 * i..8 * i + 8].try_into().unwrap());
                (
                    head,
                    Some((word(0), word(1))).filter(|&(g, h)| g != 0 && h != 0),
                )
            }
        };
        let mut telemetry = GuestTelemetry::decode_state(data)?;
        telemetry.set_carried_mark(mark);
        *self.telemetry.lock().unwrap() = telemetry;
        self.bad_writes = bad_writes;
        Ok(())
    }
}

/// `data` less its last `len` bytes, and those bytes, which hold `what`.
fn split_tail<'a>(
    data: &'a [u8],
    len: usize,
    what: &str,
) -> Result<(&'a [u8], &'a [u8]), DeviceStateError> {
    let at = data
        .len()
        .checked_sub(len)
        .ok_or_else(|| DeviceStateError::Malformed {
            device: NAME,
            reason: format!("{} bytes, fewer than the {len} of {what}", data.len()),
        })?;
    Ok(data.split_at(at))
}

#[cfg(test)]
mod tests {
    use ferry_guest_abi::report::{DETAIL_WORDS, Kind, Report};

    use super::*;

    /// Where the tests put a report in guest RAM.
    const REPORT_GPA: u32 = 0x1000;

    fn port(layout: Layout) -> TelemetryPort {
        let ram = Arc::new(GuestRam::new(crate::memory::MIN_MEMORY).unwrap());
        TelemetryPort::new(Default::default(), ram, layout)
    }

    /// A heartbeat of `pages` pages written, reported through the port, and one write of the
    /// wrong width.
    fn report(port: &mut TelemetryPort, pages: u64) {
        let heartbeat = Report {
            kind: Kind::Heartbeat as u16,
            pages_written: pages,
            ..Report::default()
        };
        port.ram
            .write(u64::from(REPORT_GPA), &heartbeat.to_bytes())
            .unwrap();
        port.write(0, &REPORT_GPA.to_le_bytes());
        port.write(0, &[1, 2]);
    }

    fn pages(port: &TelemetryPort) -> u64 {
        port.telemetry.lock().unwrap().pages_written
    }

    /// A report of `kind` with `detail`, written where the guest writes one and sent.
    fn deliver(port: &mut TelemetryPort, kind: Kind, detail: [u64; DETAIL_WORDS]) {
        let r = Report {
            kind: kind as u16,
            detail,
            ..Report::default()
        };
        port.ram
            .write(u64::from(REPORT_GPA), &r.to_bytes())
            .unwrap();
        port.write(0, &REPORT_GPA.to_le_bytes());
    }

    #[test]
    fn a_disk_report_through_the_port_shows_on_the_telemetry() {
        use ferry_guest_abi::report::DiskCounters;
        let mut port = port(Layout::Current);
        assert_eq!(
            port.telemetry.lock().unwrap().disk,
            None,
            "no disk workload"
        );
        let counters = DiskCounters {
            blocks_written: 10,
            blocks: 256,
            ..DiskCounters::default()
        };
        deliver(&mut port, Kind::Disk, counters.to_detail());
        let disk = port.telemetry.lock().unwrap().disk.unwrap();
        assert_eq!(
            (disk.blocks_written, disk.blocks, disk.first_bad_block),
            (10, 256, None)
        );
    }

    #[test]
    fn a_net_report_through_the_port_shows_on_the_telemetry() {
        use ferry_guest_abi::report::NetCounters;
        let mut port = port(Layout::Current);
        assert_eq!(
            port.telemetry.lock().unwrap().net,
            None,
            "no network workload"
        );
        let counters = NetCounters {
            echoes_sent: 99,
            last_seq: 100,
            seq_gaps: 1,
            ..NetCounters::default()
        };
        deliver(&mut port, Kind::Net, counters.to_detail());
        let net = port.telemetry.lock().unwrap().net.unwrap();
        assert_eq!((net.echoes_sent, net.last_seq, net.seq_gaps), (99, 100, 1));
    }

    #[test]
    fn the_report_before_the_move_goes_with_the_guest_and_version_2_loads_without_it() {
        let source = port(Layout::Current);
        for (guest_ns, host_ns) in [(5_000_000, 1_000_000_000), (15_000_000, 1_013_000_000)] {
            let r = Report {
                kind: Kind::Heartbeat as u16,
                guest_ns,
                ..Report::default()
            };
            let mut t = source.telemetry.lock().unwrap();
            t.record_bytes(&r.to_bytes(), host_ns).unwrap();
        }
        let saved = source.save();
        let mark = Some((5_000_000, 1_000_000_000));
        assert_eq!(
            source.telemetry.lock().unwrap().clock_mark(),
            mark,
            "the second was late"
        );
        let mut dest = port(Layout::Current);
        dest.restore(VERSION, &saved).unwrap();
        assert_eq!(dest.telemetry.lock().unwrap().clock_mark(), mark);
        let mut old = port(Layout::Current);
        old.restore(OLDEST, &saved[..saved.len() - MARK_TAIL])
            .unwrap();
        assert_eq!(old.telemetry.lock().unwrap().clock_mark(), None);
        assert_eq!(old.telemetry.lock().unwrap().reports, 2);
        assert!(matches!(
            dest.restore(VERSION, &saved[..MARK_TAIL - 1]),
            Err(DeviceStateError::Malformed { .. })
        ));
    }

    #[test]
    fn the_next_layout_loads_todays_and_today_refuses_the_next() {
        let mut old = port(Layout::Current);
        report(&mut old, 100);
        assert_eq!((pages(&old), old.bad_writes()), (100, 1));
        assert_eq!(old.kind().version, VERSION);

        // Today's layout into a newer ferry: the counter it did not carry starts at 0.
        let mut new = port(Layout::Next);
        new.restore(VERSION, &old.save()).unwrap();
        assert_eq!((pages(&new), new.bad_writes()), (100, 0));
        report(&mut new, 200);
        let saved = new.save();
        assert_eq!(new.kind().version, NEXT_VERSION);
        assert_eq!(saved.len(), old.save().len() + NEXT_TAIL);

        // The next layout into a newer ferry again carries the counter.
        let mut next = port(Layout::Next);
        next.restore(NEXT_VERSION, &saved).unwrap();
        assert_eq!((pages(&next), next.bad_writes()), (200, 1));
        assert_eq!(next.save(), saved);

        // And into today's ferry: refused by version, the state left as it was.
        let mut today = port(Layout::Current);
        let e = today.restore(NEXT_VERSION, &saved).unwrap_err();
        assert_eq!(
            e,
            DeviceStateError::Version {
                device: NAME.into(),
                got: NEXT_VERSION,
                oldest: OLDEST,
                newest: VERSION
            }
        );
        assert!(
            e.to_string().contains("update the destination's ferry"),
            "{e}"
        );
        assert_eq!(pages(&today), 0);

        assert!(matches!(
            next.restore(NEXT_VERSION, &[0; NEXT_TAIL - 1]),
            Err(DeviceStateError::Malformed { .. })
        ));
    }
}
