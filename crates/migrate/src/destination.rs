//! The receiving side: check the hello, then treat every byte as hostile: record kinds,
//! counts and lengths are bounded by the header check, every page address is checked against
//! guest RAM before a byte lands there, and records must come in the legal order (pages and
//! pass ends, then device state, then Complete). Only then is the state loaded and the guest
//! resumed.

#![forbid(unsafe_code)]

use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::conn::Conn;
use crate::error::MigrateError;
use crate::ram::Ram;
use crate::stats;
use crate::vm::{DestinationVm, Section};
use crate::wire::{self, Header, Hello, Kind, PAGE_SIZE, Refusal, Role, SectionId};

/// How long the destination waits for the next record before it gives up on a silent source.
/// Generous: a rate-limited source still sends a record at least every few ms.
const RECORD_TIMEOUT: Duration = Duration::from_secs(60);

/// What the destination measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReceiveStats {
    pub pages: u64,
    pub zero_pages: u64,
    pub passes: u32,
    pub bytes: u64,
    pub load: Duration,
    pub resume: Duration,
}

/// Receives a migration into `vm` and resumes it. On error nothing runs: the caller discards
/// the VM.
pub fn receive(
    vm: &mut dyn DestinationVm,
    stream: TcpStream,
) -> Result<ReceiveStats, MigrateError> {
    let mut conn =
        Conn::new(stream).map_err(|e| MigrateError::io("setting up the connection", e))?;
    let _ = conn.stream().set_read_timeout(Some(RECORD_TIMEOUT));
    let ram = Ram::new(vm.ram())?;
    let result = Receiver {
        written: vec![0; (ram.size() / PAGE_SIZE).div_ceil(64) as usize],
        ram,
        stats: ReceiveStats::default(),
        cpu_start: stats::thread_cpu_ns(),
    }
    .run(vm, &mut conn);
    if let Err(e) = &result
        && !matches!(e, MigrateError::Remote(_))
    {
        conn.send_error(&format!("destination: {e}"));
    }
    result
}

struct Receiver {
    ram: Ram,
    /// Pages this migration has written data into. Guest RAM starts as holes (zero), so a
    /// zero page for a page never written needs no work at all: the destination touches no
    /// memory for it.
    written: Vec<u64>,
    stats: ReceiveStats,
    cpu_start: u64,
}

impl Receiver {
    fn run(
        mut self,
        vm: &mut dyn DestinationVm,
        conn: &mut Conn,
    ) -> Result<ReceiveStats, MigrateError> {
        let hello = conn.read_hello()?;
        let mut reply = Hello {
            role: Role::Main,
            channel: 0,
            uuid: hello.uuid,
            memory_size: self.ram.size(),
            status: Refusal::Accepted as u32,
        };
        if hello.memory_size != self.ram.size() {
            reply.status = Refusal::MemorySize as u32;
            conn.write_hello(&reply)?;
            return Err(MigrateError::Refused(format!(
                "guest memory sizes differ (source {} bytes, destination {} bytes); start the destination with the same --memory",
                hello.memory_size,
                self.ram.size()
            )));
        }
        conn.write_hello(&reply)?;

        let mut sections: Vec<Section> = Vec::new();
        let mut addresses = Vec::new();
        loop {
            let h = conn.read_header("receiving the migration")?;
            let in_state = !sections.is_empty();
            match h.kind {
                Kind::Pages | Kind::ZeroPages | Kind::EndOfPass if in_state => {
                    return Err(MigrateError::Order(format!(
                        "{:?} record after device state",
                        h.kind
                    )));
                }
                Kind::Pages => {
                    self.read_addresses(conn, h.count, &mut addresses)?;
                    for &gpa in &addresses {
                        conn.read_exact(self.ram.page_mut(gpa)?, "receiving pages")?;
                        let i = self.ram.page_index(gpa)?;
                        self.written[(i / 64) as usize] |= 1 << (i % 64);
                    }
                    self.stats.pages += u64::from(h.count);
                }
                Kind::ZeroPages => {
                    self.read_addresses(conn, h.count, &mut addresses)?;
                    let mut stale = Vec::new();
                    for &gpa in &addresses {
                        let i = self.ram.page_index(gpa)?;
                        let (word, bit) = ((i / 64) as usize, 1u64 << (i % 64));
                        if self.written[word] & bit != 0 {
                            self.written[word] &= !bit;
                            stale.push(gpa);
                        }
                    }
                    self.zero(&stale)?;
                    self.stats.zero_pages += u64::from(h.count);
                }
                Kind::EndOfPass => {
                    if h.count != self.stats.passes + 1 {
                        return Err(MigrateError::Order(format!(
                            "end of pass {} after pass {}",
                            h.count, self.stats.passes
                        )));
                    }
                    self.stats.passes = h.count;
                }
                Kind::DeviceState => {
                    if self.stats.passes == 0 {
                        return Err(MigrateError::Order(
                            "device state before any memory pass".into(),
                        ));
                    }
                    let data = conn.read_payload(h.len, "receiving device state")?;
                    sections.push(Section {
                        id: SectionId::from_u16(h.section),
                        version: h.count,
                        data,
                    });
                }
                Kind::Complete => {
                    if sections.is_empty() {
                        return Err(MigrateError::Order(
                            "Complete without any device state".into(),
                        ));
                    }
                    return self.finish(vm, conn, &sections);
                }
                Kind::Error => {
                    let p = conn.read_payload(h.len, "reading the source's error")?;
                    return Err(MigrateError::Remote(
                        String::from_utf8_lossy(&p).into_owned(),
                    ));
                }
                Kind::Resumed | Kind::Invalid => {
                    return Err(MigrateError::Order(format!(
                        "{:?} record from the source",
                        h.kind
                    )));
                }
            }
        }
    }

    /// Reads `count` addresses and checks every one before any page data is read.
    fn read_addresses(
        &self,
        conn: &mut Conn,
        count: u32,
        out: &mut Vec<u64>,
    ) -> Result<(), MigrateError> {
        let bytes = conn.read_payload(u64::from(count) * 8, "receiving page addresses")?;
        out.clear();
        out.extend(wire::decode_addresses(&bytes));
        for &gpa in out.iter() {
            self.ram.page(gpa)?;
        }
        Ok(())
    }

    /// Zeroes pages that hold data from an earlier pass by punching them out of the backing
    /// file, a run of adjacent pages at a time.
    fn zero(&self, gpas: &[u64]) -> Result<(), MigrateError> {
        let mut i = 0;
        while i < gpas.len() {
            let mut n = 1;
            while i + n < gpas.len()
                && gpas[i + n] == gpas[i] + n as u64 * PAGE_SIZE
                && self.ram.page(gpas[i + n]).is_ok()
            {
                n += 1;
            }
            let punched = self.ram.punch_zero(gpas[i], n as u64).or_else(|_| {
                // A run that crosses a region boundary: punch page by page.
                (0..n).try_for_each(|k| self.ram.punch_zero(gpas[i + k], 1))
            });
            punched.map_err(|e| MigrateError::io("zeroing pages", e))?;
            i += n;
        }
        Ok(())
    }

    fn finish(
        mut self,
        vm: &mut dyn DestinationVm,
        conn: &mut Conn,
        sections: &[Section],
    ) -> Result<ReceiveStats, MigrateError> {
        let t = Instant::now();
        vm.load_state(sections)?;
        self.stats.load = t.elapsed();
        self.stats.resume = vm.resume()?;
        let cpu = stats::thread_cpu_ns() - self.cpu_start;
        let mut payload = Vec::with_capacity(wire::RESUMED_SIZE as usize);
        for v in [
            self.stats.load.as_nanos() as u64,
            self.stats.resume.as_nanos() as u64,
            cpu,
        ] {
            payload.extend_from_slice(&v.to_le_bytes());
        }
        conn.write_record(&Header::new(Kind::Resumed, 0, wire::RESUMED_SIZE), &payload)?;
        conn.flush("acknowledging the resume")?;
        self.stats.bytes = conn.bytes_written;
        Ok(self.stats)
    }
}
