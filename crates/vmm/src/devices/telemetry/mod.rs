//! The telemetry port: the guest's reports, timestamped with the host monotonic clock, folded
//! into counters that the control API serves. Each vCPU reports on its own share of the
//! working set with counters of its own; the guest's totals are their sums.

use std::collections::VecDeque;

use super::device::DeviceStateError;
use super::telemetry_clock::GuestTscCalibration;
use super::telemetry_disk::GuestDisk;
use super::telemetry_free::GuestFreeMemory;
use super::telemetry_move::{ClockMark, GuestClockGap, MoveClocks};
use super::telemetry_net::GuestNet;
use super::telemetry_rtc::GuestRtc;
use ferry_guest_abi::params::Pattern;
use ferry_guest_abi::report::{self, HaltReason, Kind, REPORT_SIZE, Report};
use ferry_guest_abi::vmgenid::GenerationId;
use serde::Serialize;

/// Window over which the write rate is computed: long enough to smooth 10 ms heartbeats,
/// short enough to show a migration's effect within a second.
const RATE_WINDOW_NS: u64 = 1_000_000_000;

/// The host's `CLOCK_MONOTONIC` in ns: comparable across processes on one host, which is what
/// lets a migration compare the timestamps of the source and destination VMMs.
pub fn host_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid pointer it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The guest's configuration, from its Boot report.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GuestConfig {
    pub ram_bytes: u64,
    pub working_set_pages: u64,
    /// MB/s per vCPU; `None` = flat out, 0 = idle.
    pub rate_mb_s: Option<u64>,
    pub pattern: String,
    pub zero_percent: u64,
    pub hot_percent: u64,
    pub verify_ms: u64,
    pub heartbeat_ms: u64,
    pub clock: String,
    /// vCPUs running the workload.
    pub vcpus: u64,
}

/// Where the working set is, from the Layout report: (first frame, pages) runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GuestLayout {
    pub extents: Vec<(u64, u64)>,
    pub record_gpa: u64,
}

impl GuestLayout {
    /// The guest-physical address of working-set page `index`.
    pub fn page_gpa(&self, index: u64) -> Option<u64> {
        let mut first = 0;
        for &(pfn, pages) in &self.extents {
            if index < first + pages {
                return Some((pfn + index - first) * ferry_guest_abi::PAGE_SIZE);
            }
            first += pages;
        }
        None
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VerifyResult {
    /// The vCPU that verified (its share of the working set).
    pub vcpu: u8,
    pub pass: u64,
    pub bad_pages: u64,
    /// The first bad frame numbers, in address order.
    pub first_bad_pfns: Vec<u64>,
    pub duration_ns: u64,
    pub host_ns: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GuestException {
    /// The vCPU that took it.
    pub vcpu: u8,
    pub vector: u64,
    pub rip: u64,
    pub error_code: u64,
    pub cr2: u64,
    pub cpl: u64,
    pub host_ns: u64,
}

/// One vCPU's counters: its reports and its share of the working set.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VcpuTelemetry {
    pub vcpu: u8,
    pub reports: u64,
    pub heartbeats: u64,
    pub lost_reports: u64,
    pub last_guest_ns: u64,
    pub pages_written: u64,
    pub verify_passes: u64,
    pub verify_failures: u64,
    pub bad_pages: u64,
    pub pages_read: u64,
    pub bad_reads: u64,
    pub max_batch_ns: u64,
    pub slow_batches: u64,
    pub slow_batch_ns: u64,
    /// A computing vCPU's (`compute=`) work units so far (0 on a writing vCPU).
    pub work_units: u64,
    #[serde(skip)]
    next_seq: u64,
}

impl VcpuTelemetry {
    /// Counters in the telemetry section, per vCPU, in this order.
    const STATE_WORDS: usize = 8;

    fn state_words(&self) -> [u64; Self::STATE_WORDS] {
        [
            u64::from(self.vcpu),
            self.next_seq,
            self.heartbeats,
            self.last_guest_ns,
            self.pages_written,
            self.verify_passes,
            self.verify_failures,
            self.bad_pages,
        ]
    }

    fn from_state_words(w: &[u64]) -> VcpuTelemetry {
        VcpuTelemetry {
            vcpu: w[0] as u8,
            next_seq: w[1],
            heartbeats: w[2],
            last_guest_ns: w[3],
            pages_written: w[4],
            verify_passes: w[5],
            verify_failures: w[6],
            bad_pages: w[7],
            ..VcpuTelemetry::default()
        }
    }
}

/// Everything the guest has told the VMM, with host timestamps. The counters are the sums of
/// the vCPUs' (`vcpus`), the maxima where a sum means nothing (times).
#[derive(Clone, Debug, Default, Serialize)]
pub struct GuestTelemetry {
    pub config: Option<GuestConfig>,
    pub layout: Option<GuestLayout>,
    pub reports: u64,
    pub heartbeats: u64,
    /// Reports the guest numbered but the VMM never saw.
    pub lost_reports: u64,
    pub invalid_reports: u64,
    pub first_report_host_ns: Option<u64>,
    pub last_report_host_ns: Option<u64>,
    /// Longest gap between consecutive reports, as the host saw them.
    pub max_report_gap_ns: u64,
    pub last_guest_ns: u64,
    pub pages_written: u64,
    pub write_rate_pages_per_s: f64,
    pub write_rate_mb_s: f64,
    pub verify_passes: u64,
    pub verify_failures: u64,
    pub bad_pages_total: u64,
    /// The longest batch of page writes the guest timed, over the heartbeats this VMM
    /// received (a destination's includes the pause across the migration).
    pub max_batch_ns: u64,
    /// Write batches the guest timed over 1 ms, and their total time, since it booted.
    pub slow_batches: u64,
    pub slow_batch_ns: u64,
    /// Pages the guest read and checked (`read=`), and those that did not hold their last
    /// write: a page migration lost or served stale, caught the moment it was read.
    pub pages_read: u64,
    pub bad_reads: u64,
    pub last_verify: Option<VerifyResult>,
    pub first_failed_verify: Option<VerifyResult>,
    /// Free memory and the balloon, when the guest has them (`free=`, a balloon).
    pub free_memory: Option<GuestFreeMemory>,
    /// The disk workload's counters (`disk=`), from its latest report, when it runs.
    pub disk: Option<GuestDisk>,
    /// The network workload's counters (`net=`), from its latest report, when it runs.
    pub net: Option<GuestNet>,
    /// The guest's latest calibration of its TSC against the PIT, and the TSC frequency KVM
    /// gives the guest (`KVM_GET_TSC_KHZ`; filled in by `VmHandle::telemetry`, not the guest).
    pub tsc_calibration: Option<GuestTscCalibration>,
    pub tsc_host_hz: Option<u64>,
    /// The RTC's time of day the guest read with its latest calibration.
    pub rtc: Option<GuestRtc>,
    pub exception: Option<GuestException>,
    pub halt_reason: Option<String>,
    /// The VM generation ID the guest last reported reading (32 hex digits, all `f` for a VM
    /// without the device) and the changes of it it has seen since it booted: none before its
    /// first report (a guest that does not read the ID sends none). Carried across a migration
    /// by the ID's device (`vmgenid`), not in the telemetry's own section.
    #[serde(serialize_with = "hex")]
    pub generation_id: Option<GenerationId>,
    pub generation_changes: Option<u64>,
    /// On a migration destination: the gap between the last report the source VMM received
    /// and the first this VMM received, i.e. the pause the guest saw across the migration.
    pub migration_pause_ns: Option<u64>,
    /// When that first report came (the host's `CLOCK_MONOTONIC`, as every `host_ns`): the
    /// guest's resume on the host clock, and less the pause, the last report before it.
    pub migration_resumed_host_ns: Option<u64>,
    /// On a destination: the guest's clocks across the move (the clock jump, the guest's gap).
    pub migration_clocks: Option<MoveClocks>,
    /// The boot vCPU's latest report of a gap in its clocks.
    pub clock_gap: Option<GuestClockGap>,
    /// Each reporting vCPU's own counters, by vCPU index.
    pub vcpus: Vec<VcpuTelemetry>,
    #[serde(skip)]
    awaiting_first_report_after_migration: bool,
    /// The least late of the latest reports, for the clock jump of a move away from here, and
    /// on a destination the one the source carried over ([`ClockMark`]).
    #[serde(skip)]
    clock_mark: ClockMark,
    #[serde(skip)]
    carried_mark: Option<(u64, u64)>,
    #[serde(skip)]
    window: VecDeque<(u64, u64)>,
    /// The Boot and Layout reports as received, carried along when the VM migrates.
    #[serde(skip)]
    raw_config: Vec<[u8; REPORT_SIZE]>,
}

/// Words in the telemetry section before the vCPUs', in [`GuestTelemetry::encode_state`]
/// order; the last is the number of vCPUs that follow.
const STATE_WORDS: usize = 6;

impl GuestTelemetry {
    /// Decodes and records the report bytes the guest pointed at, received at `host_ns`.
    pub fn record_bytes(
        &mut self,
        bytes: &[u8; REPORT_SIZE],
        host_ns: u64,
    ) -> Result<Kind, report::DecodeError> {
        match Report::from_bytes(bytes) {
            Ok(r) if usize::from(r.vcpu) >= ferry_guest_abi::smp::MAX_VCPUS => {
                self.invalid_reports += 1;
                Err(report::DecodeError::BadVcpu(r.vcpu))
            }
            Ok(r) => {
                if matches!(r.kind(), Kind::Boot | Kind::Layout) {
                    self.raw_config
                        .retain(|b| Report::from_bytes(b).map(|o| o.kind) != Ok(r.kind));
                    self.raw_config.push(*bytes);
                }
                self.record(&r, host_ns);
                Ok(r.kind())
            }
            Err(e) => {
                self.invalid_reports += 1;
                Err(e)
            }
        }
    }

    /// Folds one report in.
    pub fn record(&mut self, r: &Report, host_ns: u64) {
        self.reports += 1;
        if let Some(last) = self.last_report_host_ns {
            let gap = host_ns.saturating_sub(last);
            self.max_report_gap_ns = self.max_report_gap_ns.max(gap);
            if std::mem::take(&mut self.awaiting_first_report_after_migration) {
                self.migration_pause_ns = Some(gap);
                self.migration_resumed_host_ns = Some(host_ns);
                let latest = self.vcpus.iter().map(|v| v.last_guest_ns).max();
                let latest = latest.unwrap_or(0);
                // A source too old to carry its least late report: its latest.
                let before = self.carried_mark.take().unwrap_or((latest, last));
                if let Some(m) = &mut self.migration_clocks {
                    m.first_report(before, latest, r.guest_ns, host_ns);
                }
            } else if let Some(m) = &mut self.migration_clocks {
                m.report(r.guest_ns, host_ns);
            }
        }
        self.first_report_host_ns.get_or_insert(host_ns);
        self.last_report_host_ns = Some(host_ns);
        self.clock_mark.report(r.guest_ns, host_ns);
        let v = self.vcpu_mut(r.vcpu);
        v.reports += 1;
        v.lost_reports += r.seq.saturating_sub(v.next_seq);
        v.next_seq = v.next_seq.max(r.seq + 1);
        let d = &r.detail;
        match r.kind() {
            Kind::Boot => {
                self.config = Some(GuestConfig {
                    ram_bytes: d[report::boot::RAM_BYTES],
                    working_set_pages: d[report::boot::WS_PAGES],
                    rate_mb_s: match d[report::boot::RATE] {
                        0 => None,
                        report::boot::RATE_IDLE => Some(0),
                        r => Some(r),
                    },
                    pattern: Pattern::from_u8(d[report::boot::PATTERN] as u8)
                        .map_or("unknown", Pattern::name)
                        .to_string(),
                    zero_percent: d[report::boot::ZERO_PERCENT],
                    hot_percent: d[report::boot::HOT_PERCENT],
                    verify_ms: d[report::boot::VERIFY_MS],
                    heartbeat_ms: d[report::boot::HEARTBEAT_MS],
                    clock: match d[report::boot::CLOCK] {
                        1 => "kvmclock",
                        2 => "tsc",
                        _ => "tsc (guessed frequency)",
                    }
                    .to_string(),
                    vcpus: d[report::boot::VCPUS].max(1),
                });
                self.sum_vcpus();
                return;
            }
            Kind::Layout => {
                let n =
                    (d[report::layout::EXTENTS] as usize).min(ferry_guest_abi::layout::MAX_EXTENTS);
                self.layout = Some(GuestLayout {
                    extents: (0..n)
                        .map(|i| {
                            (
                                d[report::layout::FIRST + 2 * i],
                                d[report::layout::FIRST + 2 * i + 1],
                            )
                        })
                        .collect(),
                    record_gpa: d[report::layout::RECORD],
                });
                self.sum_vcpus();
                return;
            }
            Kind::Exception => {
                self.exception = Some(GuestException {
                    vcpu: r.vcpu,
                    vector: d[report::exception::VECTOR],
                    rip: d[report::exception::RIP],
                    error_code: d[report::exception::ERROR_CODE],
                    cr2: d[report::exception::CR2],
                    cpl: d[report::exception::CS] & 3,
                    host_ns,
                });
                self.sum_vcpus();
                return;
            }
            Kind::Heartbeat => {
                use report::heartbeat::*;
                v.heartbeats += 1;
                v.bad_pages = v.bad_pages.max(d[BAD_PAGES_TOTAL]);
                v.max_batch_ns = v.max_batch_ns.max(d[MAX_BATCH_NS]);
                v.slow_batches = v.slow_batches.max(d[SLOW_BATCHES]);
                v.slow_batch_ns = v.slow_batch_ns.max(d[SLOW_BATCH_TIME_NS]);
                v.pages_read = v.pages_read.max(d[PAGES_READ]);
                v.bad_reads = v.bad_reads.max(d[BAD_READS]);
                let free = GuestFreeMemory::from_heartbeat(d);
                if free != GuestFreeMemory::default() {
                    self.free_memory = Some(free);
                }
            }
            Kind::Disk => self.disk = Some(GuestDisk::from_detail(d)),
            Kind::Net => self.net = Some(GuestNet::from_detail(d)),
            Kind::Clock => {
                self.tsc_calibration = Some(GuestTscCalibration::from_detail(d));
                self.rtc = GuestRtc::from_detail(d, super::rtc::wall_clock_ns());
            }
            Kind::ClockGap => {
                let gap = GuestClockGap::from_detail(d);
                self.clock_gap = Some(gap);
                if let Some(m) = &mut self.migration_clocks {
                    m.gap(gap, host_ns);
                }
            }
            Kind::Work => {
                v.heartbeats += 1;
                v.work_units = v.work_units.max(d[report::work::UNITS]);
            }
            Kind::Verify => {
                let listed = (d[report::verify::LISTED] as usize).min(report::LISTED_BAD_PAGES);
                let result = VerifyResult {
                    vcpu: r.vcpu,
                    pass: d[report::verify::PASS],
                    bad_pages: d[report::verify::BAD_PAGES],
                    first_bad_pfns: d[report::verify::FIRST_BAD..][..listed].to_vec(),
                    duration_ns: d[report::verify::DURATION_NS],
                    host_ns,
                };
                if result.bad_pages > 0 {
                    v.bad_pages += result.bad_pages;
                    self.first_failed_verify
                        .get_or_insert_with(|| result.clone());
                }
                self.last_verify = Some(result);
            }
            Kind::Halt => {
                self.halt_reason = Some(HaltReason::from_u64(d[0]).describe().to_string())
            }
            Kind::VmGeneration => {
                use report::vm_generation::*;
                self.generation_id = Some(GenerationId::from_detail([d[ID_LOW], d[ID_HIGH]]));
                self.generation_changes = Some(d[CHANGES]);
                self.sum_vcpus();
                return;
            }
            Kind::Invalid => {
                self.sum_vcpus();
                return;
            }
        }
        // Counters are cumulative in the guest; never let a stale report move them back.
        let v = self.vcpu_mut(r.vcpu);
        v.last_guest_ns = v.last_guest_ns.max(r.guest_ns);
        v.pages_written = v.pages_written.max(r.pages_written);
        v.verify_passes = v.verify_passes.max(r.verify_passes);
        v.verify_failures = v.verify_failures.max(r.verify_failures);
        self.sum_vcpus();
        self.update_rate(host_ns);
    }

    /// vCPU `vcpu`'s counters, new ones in index order.
    fn vcpu_mut(&mut self, vcpu: u8) -> &mut VcpuTelemetry {
        let at = match self.vcpus.binary_search_by_key(&vcpu, |v| v.vcpu) {
            Ok(at) => at,
            Err(at) => {
                self.vcpus.insert(
                    at,
                    VcpuTelemetry {
                        vcpu,
                        ..VcpuTelemetry::default()
                    },
                );
                at
            }
        };
        &mut self.vcpus[at]
    }

    /// The guest's counters from its vCPUs'.
    fn sum_vcpus(&mut self) {
        let sum = |f: fn(&VcpuTelemetry) -> u64| self.vcpus.iter().map(f).sum::<u64>();
        let max = |f: fn(&VcpuTelemetry) -> u64| self.vcpus.iter().map(f).max().unwrap_or(0);
        self.heartbeats = sum(|v| v.heartbeats);
        self.lost_reports = sum(|v| v.lost_reports);
        self.pages_written = sum(|v| v.pages_written);
        self.verify_passes = sum(|v| v.verify_passes);
        self.verify_failures = sum(|v| v.verify_failures);
        self.bad_pages_total = sum(|v| v.bad_pages);
        self.pages_read = sum(|v| v.pages_read);
        self.bad_reads = sum(|v| v.bad_reads);
        self.slow_batches = sum(|v| v.slow_batches);
        self.slow_batch_ns = sum(|v| v.slow_batch_ns);
        self.max_batch_ns = max(|v| v.max_batch_ns);
        self.last_guest_ns = max(|v| v.last_guest_ns);
    }

    /// The least late report of the last moments, (guest, host) ns: what a destination
    /// measures the clock jump across a move from (the telemetry section carries it).
    pub fn clock_mark(&self) -> Option<(u64, u64)> {
        self.clock_mark.best().or(self.carried_mark)
    }

    /// On a destination: the source's [`GuestTelemetry::clock_mark`].
    pub fn set_carried_mark(&mut self, mark: Option<(u64, u64)>) {
        self.carried_mark = mark;
    }

    /// The state a destination VMM needs to continue this telemetry seamlessly: the report
    /// counts, the last report's host time (so the pause across the migration shows as one
    /// gap), each vCPU's counters and report sequence, and the Boot and Layout reports.
    pub fn encode_state(&self) -> Vec<u8> {
        let words: [u64; STATE_WORDS] = [
            self.last_report_host_ns.unwrap_or(0),
            self.first_report_host_ns.unwrap_or(0),
            self.max_report_gap_ns,
            self.reports,
            self.invalid_reports,
            self.vcpus.len() as u64,
        ];
        let vcpus = self.vcpus.iter().flat_map(VcpuTelemetry::state_words);
        let mut v: Vec<u8> = words
            .into_iter()
            .chain(vcpus)
            .flat_map(|w| w.to_le_bytes())
            .collect();
        for raw in &self.raw_config {
            v.extend_from_slice(raw);
        }
        v
    }

    pub fn decode_state(b: &[u8]) -> Result<GuestTelemetry, DeviceStateError> {
        let malformed = |reason: String| DeviceStateError::Malformed {
            device: "telemetry port",
            reason,
        };
        let word = |i: usize| {
            b.get(8 * i..8 * i + 8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
        };
        let count = word(STATE_WORDS - 1)
            .filter(|&n| n <= ferry_guest_abi::smp::MAX_VCPUS as u64)
            .ok_or_else(|| {
                malformed(format!(
                    "{} bytes, or more than {} vCPUs",
                    b.len(),
                    ferry_guest_abi::smp::MAX_VCPUS
                ))
            })? as usize;
        let head = (STATE_WORDS + count * VcpuTelemetry::STATE_WORDS) * 8;
        if b.len() < head
            || !(b.len() - head).is_multiple_of(REPORT_SIZE)
            || b.len() > head + 2 * REPORT_SIZE
        {
            return Err(malformed(format!(
                "{} bytes, want {head} for {count} vCPUs plus up to two {REPORT_SIZE}-byte reports",
                b.len()
            )));
        }
        let w = |i: usize| word(i).expect("length checked");
        let mut t = GuestTelemetry::default();
        for raw in b[head..].chunks_exact(REPORT_SIZE) {
            let raw: &[u8; REPORT_SIZE] = raw.try_into().unwrap();
            t.record_bytes(raw, 0)
                .map_err(|e| malformed(format!("a carried report: {e:?}")))?;
        }
        let nonzero = |v: u64| (v != 0).then_some(v);
        t.last_report_host_ns = nonzero(w(0));
        t.first_report_host_ns = nonzero(w(1));
        t.max_report_gap_ns = w(2);
        t.reports = w(3);
        t.invalid_reports = w(4);
        t.vcpus = (0..count)
            .map(|k| {
                let at = STATE_WORDS + k * VcpuTelemetry::STATE_WORDS;
                let words: Vec<u64> = (at..at + VcpuTelemetry::STATE_WORDS).map(w).collect();
                VcpuTelemetry::from_state_words(&words)
            })
            .collect();
        let indices_valid = (0..count).all(|k| {
            w(STATE_WORDS + k * VcpuTelemetry::STATE_WORDS) < ferry_guest_abi::smp::MAX_VCPUS as u64
        });
        if !indices_valid || t.vcpus.windows(2).any(|p| p[0].vcpu >= p[1].vcpu) {
            return Err(malformed(
                "vCPU indices out of order, repeated or above 63".into(),
            ));
        }
        t.sum_vcpus();
        t.window.clear();
        t.awaiting_first_report_after_migration = true;
        t.migration_clocks = Some(MoveClocks::arrived());
        Ok(t)
    }

    fn update_rate(&mut self, host_ns: u64) {
        self.window.push_back((host_ns, self.pages_written));
        while self.window.len() > 2 && host_ns - self.window[1].0 >= RATE_WINDOW_NS {
            self.window.pop_front();
        }
        let (t0, p0) = self.window[0];
        // Each vCPU's report carries its own total, so a window of a few reports (after a
        // start, or a migration cleared it) may hold one vCPU's whole backlog over the
        // microseconds between two vCPUs' reports: no rate until it spans a quarter of its
        // length, whatever the last rate was until then.
        if host_ns >= t0 + RATE_WINDOW_NS / 4 {
            let rate = (self.pages_written - p0) as f64 * 1e9 / (host_ns - t0) as f64;
            self.write_rate_pages_per_s = rate;
            self.write_rate_mb_s = rate * ferry_guest_abi::PAGE_SIZE as f64 / 1e6;
        }
    }
}

/// A generation ID as its 32 hex digits.
fn hex<S: serde::Serializer>(id: &Option<GenerationId>, s: S) -> Result<S::Ok, S::Error> {
    match id {
        Some(id) => s.collect_str(id),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests;
