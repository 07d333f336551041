//! The CPL3 workload: parse the command line, place the working set, then dirty and verify it
//! forever (or for `run-ms`), reporting through telemetry and the serial port.

use ferry_guest::pace::Pace;
use ferry_guest::pattern::{Picker, Rng};
use ferry_guest::plan::{self, Plan, PlanError};
use ferry_guest::rate::WriteRate;
use ferry_guest_abi::layout::{Footprint, MAX_EXTENTS, default_working_set};
use ferry_guest_abi::params::{self, Fill, Params, Pattern, Rate};
use ferry_guest_abi::report::{self, HaltReason, Kind, Report};
use ferry_guest_abi::stamp::{self, expected_word, next_generation};

use super::clock::{self, Clock};
use super::clockgap::ClockWatch;
use super::disk::{self, Disk};
use super::freemem::FreeMemory;
use super::net::Net;
use super::pit::Calibrator;
use super::timer::Timer;
use super::vmgenid::Watcher;
use super::{announce, arch, boot, memory, net, smp, telemetry, virtio_mmio};
use crate::sprintln;

/// Pages in a batch: ~100 us of flat-out writing into memory the host has mapped, fine enough
/// for 1 ms heartbeats and cheap next to the writes (a clock read is ~50 ns).
const BATCH_PAGES: u64 = 2048;
/// Pages written between looks at the clock inside a batch, which ends early once a heartbeat
/// is due (the rest is written next): a batch's pages can each cost a trip through the host
/// (a dirty log's write fault, ~20 us on a shadow-paging host, so a batch took ~40 ms under a
/// migration; a postcopy fault), and a heartbeat that waited for the whole batch would make
/// the guest look paused when it was only slow. 64 pages keep the clock reads under 0.1% of
/// flat-out writing.
const CLOCK_EVERY_PAGES: u64 = 64;
/// Pages written between looks at the NIC's receive queue (`net=`): a look is one read of
/// guest memory, under 1% of 16 page writes, and 16 pages that each take a trip through the
/// host (~20 µs, as above) still answer a frame within ~0.3 ms. Divides [`CLOCK_EVERY_PAGES`].
const NET_EVERY_PAGES: u64 = 16;
const _: () = assert!(CLOCK_EVERY_PAGES.is_multiple_of(NET_EVERY_PAGES));
/// A paced guest writes in bursts this far apart and sleeps between them: finer than the
/// migration's 25 ms progress samples, and as long as the pace lets a burst be
/// ([`ferry_guest::pace::MAX_BURST_NS`]), because a wake-up is a trip through CPL0: on a
/// hypervisor that emulates CPL0 (see `entry.rs`) one costs ~0.3 ms, measured as 9% of a core
/// at 244 wakes a second; at 100 wakes a second at most, a sleeping guest stays under 5%.
const PACE_QUANTUM_NS: u64 = ferry_guest::pace::MAX_BURST_NS;
const MS: u64 = 1_000_000;

/// The first Rust code: `entry.rs` drops here at CPL3 with the PVH start_info address.
#[unsafe(no_mangle)]
extern "C" fn user_main(start_info: u64) -> ! {
    let clock = Clock::new(clock::start());
    let boot = match boot::start(start_info) {
        Ok(b) => b,
        Err(why) => {
            sprintln!("ferry-guest: {why}");
            halt_with(HaltReason::BadBootInfo, &Counters::default(), &clock);
        }
    };
    let boot = &boot;
    let cmdline = boot::command_line(boot.cmdline);
    let params = match params::parse(cmdline) {
        Ok(p) => p,
        Err(e) => {
            sprintln!("ferry-guest: {e}");
            halt_with(HaltReason::BadCommandLine, &Counters::default(), &clock);
        }
    };
    let free = plan::free_bytes(boot.ram(), boot.floor);
    let ws = params.working_set.unwrap_or(default_working_set(free));
    let plan = match plan::plan(boot.ram(), boot.floor, Footprint::of(&params, ws)) {
        Ok(p) => p,
        Err(e) => {
            match e {
                PlanError::NotEnoughMemory { needed, free } => sprintln!(
                    "ferry-guest: working set of {} MiB needs {} MiB with its record, but only {} MiB of RAM is free; give the VM more memory or lower ws=",
                    ws >> 20,
                    needed.div_ceil(1 << 20),
                    free >> 20
                ),
                PlanError::TooFragmented => sprintln!(
                    "ferry-guest: the memory map splits RAM into more than {MAX_EXTENTS} ranges above the image; lower ws="
                ),
            }
            halt_with(HaltReason::NotEnoughMemory, &Counters::default(), &clock);
        }
    };
    announce::boot(boot, &params, &plan, &clock);
    let found = virtio_mmio::identify(&params);
    let free = match params.free > 0 || found.balloon.is_some() {
        false => None,
        true => {
            let after = plan.end().max(boot.floor);
            match FreeMemory::new(&params, found.balloon, boot.ram(), after, || clock.now_ns()) {
                Ok(f) => Some(f.announced(&params)),
                Err(e) => {
                    e.explain(&params);
                    halt_with(HaltReason::NotEnoughMemory, &Counters::default(), &clock);
                }
            }
        }
    };
    let disk = match disk::start(&params, found.blk, plan.disk_record, &clock) {
        Ok(disk) => disk,
        Err(reason) => halt_with(reason, &Counters::default(), &clock),
    };
    let net = match net::start(&params, found.net, &clock) {
        Ok(net) => net,
        Err(reason) => halt_with(reason, &Counters::default(), &clock),
    };
    smp::start_all(smp::Setup {
        params,
        plan,
        clock,
    });
    let own = BootDevices { free, disk, net };
    Workload::new(params, vcpu_plan(&params, &plan, 0), clock, own).run()
}

/// What vCPU `k` writes: its share of the pages (among the vCPUs that write), or with
/// `shared=1` every page (its own word of each) with a record of its own.
fn vcpu_plan(p: &Params, plan: &Plan, k: u64) -> Plan {
    match p.shared {
        true => plan.lane(k),
        false => plan.share(k, u64::from(p.writers())),
    }
}

/// A secondary vCPU's first Rust code: `entry.rs` drops here at CPL3 with its index, after
/// the boot vCPU published the setup and asked the VMM to start it.
#[unsafe(no_mangle)]
extern "C" fn ap_main(vcpu: u64) -> ! {
    let setup = smp::setup();
    let clock = setup.clock.on_vcpu(vcpu as usize);
    if vcpu >= u64::from(setup.params.writers()) {
        super::compute::run(&setup.params, clock);
    }
    let plan = vcpu_plan(&setup.params, &setup.plan, vcpu);
    Workload::new(setup.params, plan, clock, BootDevices::default()).run()
}

/// Cumulative counts, as every report carries them.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    pages_written: u64,
    verify_passes: u64,
    verify_failures: u64,
    bad_pages: u64,
}

impl Counters {
    fn report(&self, kind: Kind, clock: &Clock, detail: [u64; report::DETAIL_WORDS]) -> Report {
        Report {
            kind: kind as u16,
            vcpu: clock.vcpu(),
            seq: 0,
            guest_ns: clock.now_ns(),
            pages_written: self.pages_written,
            verify_passes: self.verify_passes,
            verify_failures: self.verify_failures,
            detail,
        }
    }
}

fn halt_with(reason: HaltReason, counters: &Counters, clock: &Clock) -> ! {
    let mut detail = [0u64; report::DETAIL_WORDS];
    detail[0] = reason as u64;
    telemetry::send(&counters.report(Kind::Halt, clock, detail));
    sprintln!("ferry-guest: halting: {}", reason.describe());
    arch::halt()
}

/// A verify pass looks at the clock every this many pages, for a heartbeat that is due, and
/// at the NIC's receive queue: 256 pages are read and checked in ~0.1 ms.
const HEARTBEAT_CHECK_PAGES: u64 = 256;

/// What only the boot vCPU drives: free memory and the balloon, the disk, the NIC.
#[derive(Default)]
struct BootDevices {
    free: Option<FreeMemory>,
    disk: Option<Disk>,
    net: Option<Net>,
}

struct Workload {
    p: Params,
    plan: Plan,
    clock: Clock,
    record: &'static mut [u32],
    picker: Picker,
    pace: Option<Pace>,
    /// The APIC timer a paced guest sleeps on between bursts; `None`: it polls its clock.
    timer: Option<Timer>,
    cursor: u64,
    counters: Counters,
    /// Decides which accesses read (`read=`), apart from the picker so that the pages written
    /// are the same whatever the read share.
    reads: Rng,
    pages_read: u64,
    bad_reads: u64,
    /// The longest batch of accesses since the last heartbeat, and the slow batches so far
    /// (see `report::heartbeat`): the stall the guest itself sees.
    max_batch_ns: u64,
    slow_batches: u64,
    slow_batch_ns: u64,
    /// Pages of a batch that ended early for a heartbeat, written before any new grant.
    owed: u64,
    /// Free memory, its churn and the balloon (`free=`, `churn=`, a virtio-mmio device); the
    /// boot vCPU's only.
    free: Option<FreeMemory>,
    /// The VM generation ID, looked at every heartbeat; the boot vCPU's only.
    vmgenid: Option<Watcher>,
    /// The TSC's calibrations against the PIT (`calibrate-ms`); the boot vCPU's only.
    pit: Option<Calibrator>,
    /// The disk workload (`disk=`); the boot vCPU's only.
    disk: Option<Disk>,
    /// The network workload (`net=`); the boot vCPU's only.
    net: Option<Net>,
    /// The clocks' last readings and their gaps: they must never go back, across a migration
    /// least of all, and must advance by a pause (`clockgap.rs`).
    clocks: ClockWatch,
    /// When the next heartbeat is due (also looked at inside a verify pass, so that a pass
    /// never reads as a pause to the host).
    next_heartbeat: u64,
    /// With `shared=1`, the word of each page this vCPU owns (its index).
    lane: Option<usize>,
}

impl Workload {
    fn new(p: Params, plan: Plan, clock: Clock, own: BootDevices) -> Workload {
        // SAFETY: the plan puts the record in RAM of its own, apart from the working set.
        let record = unsafe { memory::record(plan.record, plan.pages) };
        let pace = match p.rate {
            Rate::FlatOut | Rate::Idle => None,
            Rate::MegabytesPerSecond(mb) => {
                Some(Pace::new(u64::from(mb) * 1_000_000, clock.now_ns()))
            }
        };
        // vCPU 0 keeps the seed as given, so a one-vCPU guest writes what it always did.
        let seed = p.seed.wrapping_add(u64::from(clock.vcpu()));
        Workload {
            picker: Picker::new(p.pattern, plan.pages, p.hot_percent, seed),
            p,
            plan,
            clock,
            record,
            pace,
            timer: Timer::start(),
            reads: Rng::new(seed ^ 0x7265_6164),
            clocks: ClockWatch::new(p.heartbeat_ms),
            next_heartbeat: 0,
            lane: p.shared.then_some(usize::from(clock.vcpu())),
            // vCPUs sharing the pages start apart, so that they do not write in lockstep.
            cursor: match p.shared {
                true => plan.pages * u64::from(clock.vcpu()) / u64::from(p.vcpus),
                false => 0,
            },
            pages_read: 0,
            bad_reads: 0,
            counters: Counters::default(),
            max_batch_ns: 0,
            slow_batches: 0,
            slow_batch_ns: 0,
            owed: 0,
            free: own.free,
            disk: own.disk,
            net: own.net,
            // The boot vCPU's first look, reported after its Boot and Layout reports.
            vmgenid: (clock.vcpu() == 0).then(|| Watcher::boot(&clock)),
            pit: (clock.vcpu() == 0).then(|| Calibrator::boot(&p, &clock)),
        }
    }

    /// Writes the page at `pfn` for generation `generation`, as `fill=` says.
    #[inline(always)]
    fn store(&self, pfn: u64, generation: u32) {
        let word = expected_word(pfn, generation, self.p.zero_percent);
        match (self.lane, self.p.fill) {
            (Some(lane), _) => memory::write_lane(pfn, lane, word),
            (None, Fill::Stamp) => memory::write_stamp(pfn, word),
            (None, Fill::Random) => memory::write_filled(pfn, word, stamp::fill_word),
            (None, Fill::Mixed) => memory::write_filled(pfn, word, stamp::mixed_word),
        }
    }

    /// Whether the page at `pfn` holds `want`, as `fill=` writes it.
    fn holds(&self, pfn: u64, want: u64) -> bool {
        match (self.lane, self.p.fill) {
            (Some(lane), _) => memory::lane_matches(pfn, lane, want),
            (None, Fill::Stamp) => memory::page_matches(pfn, want),
            (None, Fill::Random) => memory::page_matches_filled(pfn, want, stamp::fill_word),
            (None, Fill::Mixed) => memory::page_matches_filled(pfn, want, stamp::mixed_word),
        }
    }

    /// One access to working-set page `index` at frame `pfn`: with `read=`'s odds a read that
    /// checks the page against its last write, else a write of its next generation.
    #[inline(always)]
    fn access(&mut self, index: usize, pfn: u64) {
        if self.p.read_percent != 0 && self.reads.below(100) < u64::from(self.p.read_percent) {
            let want = expected_word(pfn, self.record[index], self.p.zero_percent);
            if !self.holds(pfn, want) {
                self.bad_reads += 1;
            }
            self.pages_read += 1;
            return;
        }
        self.record[index] = next_generation(self.record[index]);
        self.store(pfn, self.record[index]);
        self.counters.pages_written += 1;
    }

    /// `prefill=1`: every page once, in order, before the workload (and its clock) starts.
    fn prefill(&mut self) {
        let extents = self.plan.extents;
        for e in &extents[..self.plan.extent_count] {
            for k in 0..e.pages {
                let index = (e.first_index + k) as usize;
                self.record[index] = next_generation(self.record[index]);
                self.store(e.first_pfn + k, self.record[index]);
            }
        }
        self.counters.pages_written += self.plan.pages;
        sprintln!(
            "ferry-guest: vCPU {} prefilled {} pages",
            self.clock.vcpu(),
            self.plan.pages
        );
    }

    fn run(mut self) -> ! {
        if self.plan.pages == 0 {
            // More vCPUs than pages (the VMM refuses that before boot; another VMM might not):
            // nothing of the working set is this vCPU's.
            sprintln!(
                "ferry-guest: vCPU {} has no pages to write; give ws= at least a page per vCPU",
                self.clock.vcpu()
            );
            if self.clock.vcpu() == 0 {
                halt_with(HaltReason::NotEnoughMemory, &self.counters, &self.clock);
            }
            self.stop_for_good();
        }
        if self.p.prefill {
            self.prefill();
        }
        let every = |ms: u32| u64::from(ms) * MS;
        let mut next_log = every(self.p.log_ms);
        let mut next_verify = every(self.p.verify_ms);
        // The first line's rate counts from here: not the boot's setup, nor `prefill=1`'s pages.
        let mut last_log = (self.clock.now_ns(), self.counters.pages_written);
        loop {
            self.poll_net();
            let now = self.clock.now_ns();
            // Before the heartbeat, so that a gap ending here is in the report it sends.
            self.look_at_clocks();
            if now >= self.next_heartbeat {
                self.heartbeat(now);
            }
            if self.p.log_ms != 0 && now >= next_log && self.clock.vcpu() == 0 {
                let (t0, w0) = last_log;
                let rate = WriteRate {
                    pages: self.counters.pages_written - w0,
                    ns: now - t0,
                };
                sprintln!(
                    "ferry-guest: t={}.{:03}s written={} pages ({rate}) verify passes={} failures={}{}{}",
                    now / 1_000_000_000,
                    now / MS % 1000,
                    self.counters.pages_written,
                    self.counters.verify_passes,
                    self.counters.verify_failures,
                    disk::LogText(self.disk.as_ref()),
                    super::net::LogText(self.net.as_ref())
                );
                last_log = (now, self.counters.pages_written);
                next_log = now + every(self.p.log_ms);
            }
            if self.p.verify_ms != 0 && now >= next_verify {
                self.verify();
                self.verify_disk();
                let done = self.clock.now_ns();
                next_verify = done + every(self.p.verify_ms);
                if let Some(pace) = &mut self.pace {
                    pace.make_up(done.saturating_sub(now), every(self.p.verify_ms));
                }
            }
            if let Some(free) = &mut self.free {
                let bad = free.churn(now);
                if bad > 0 {
                    self.counters.verify_failures += 1;
                    self.counters.bad_pages += bad;
                    sprintln!(
                        "ferry-guest: VERIFY FAILED: {bad} page(s) of a churned block lost their content"
                    );
                }
            }
            if let Some(disk) = &mut self.disk {
                let net = &mut self.net;
                disk.work(&self.clock, self.next_heartbeat, &mut || poll(net));
            }
            if self.p.run_ms != 0 && now >= every(self.p.run_ms) {
                self.stop_for_good();
            }
            if self.p.fault_after_ms != 0
                && now >= every(self.p.fault_after_ms)
                && self.clock.vcpu() == self.p.fault_vcpu
            {
                sprintln!(
                    "ferry-guest: fault-after-ms reached, vCPU {} executing ud2",
                    self.clock.vcpu()
                );
                arch::undefined_instruction();
            }
            let n = match (&mut self.pace, self.p.rate) {
                _ if self.owed > 0 => core::mem::take(&mut self.owed),
                (_, Rate::Idle) => 0,
                (None, _) => BATCH_PAGES,
                (Some(pace), _) => pace.grant(now, BATCH_PAGES),
            };
            if n == 0 {
                // Asleep until the next burst the pace allows (an idle guest has none), or
                // until something else is due.
                let mut wake = match &self.pace {
                    Some(pace) => {
                        let burst = pace.pages_in(PACE_QUANTUM_NS).min(BATCH_PAGES);
                        pace.due_ns(now, burst).min(self.next_heartbeat)
                    }
                    None => self.next_heartbeat,
                };
                if let Some(disk) = &self.disk {
                    wake = wake.min(disk.due_ns(now));
                }
                for (interval, at) in [
                    (self.p.log_ms, next_log),
                    (self.p.verify_ms, next_verify),
                    (self.p.run_ms, every(self.p.run_ms)),
                    (self.p.fault_after_ms, every(self.p.fault_after_ms)),
                ] {
                    if interval != 0 {
                        wake = wake.min(at);
                    }
                }
                // A sleeping vCPU answers no frame: with a NIC it polls until then instead.
                match (&mut self.net, &self.timer) {
                    (Some(net), _) => net.wait_until(&self.clock, wake),
                    (None, Some(timer)) => timer.sleep_until(&self.clock, wake),
                    (None, None) => core::hint::spin_loop(),
                }
                continue;
            }
            let started = self.clock.now_ns();
            self.owed = n - self.write_batch(n, self.next_heartbeat);
            let took = self.clock.now_ns().saturating_sub(started);
            self.max_batch_ns = self.max_batch_ns.max(took);
            if took > report::heartbeat::SLOW_BATCH_NS {
                self.slow_batches += 1;
                self.slow_batch_ns += took;
            }
        }
    }

    /// `run-ms` elapsed: a secondary vCPU parks for good; the boot vCPU waits (briefly) for
    /// them and halts the machine, so every vCPU's last counts were reported.
    fn stop_for_good(&mut self) -> ! {
        if let Some(disk) = &mut self.disk {
            disk.flush(self.clock.now_ns());
        }
        self.send_disk();
        self.send_net();
        let hb = self
            .counters
            .report(Kind::Heartbeat, &self.clock, [0; report::DETAIL_WORDS]);
        telemetry::send(&hb);
        if self.clock.vcpu() != 0 {
            smp::park();
            loop {
                match &self.timer {
                    Some(timer) => timer.sleep_until(&self.clock, self.clock.now_ns() + 1_000 * MS),
                    None => core::hint::spin_loop(),
                }
            }
        }
        let others = u32::from(self.p.vcpus) - 1;
        let give_up = self.clock.now_ns() + 100 * MS;
        while smp::parked() < others && self.clock.now_ns() < give_up {
            core::hint::spin_loop();
        }
        halt_with(HaltReason::RunTimeElapsed, &self.counters, &self.clock)
    }

    /// Writes up to `n` pages from the cursor on, looking at the clock every
    /// [`CLOCK_EVERY_PAGES`] and stopping once it reads `until_ns` or later, and at the NIC's
    /// receive queue every [`NET_EVERY_PAGES`]; returns the pages written.
    fn write_batch(&mut self, n: u64, until_ns: u64) -> u64 {
        let step = match self.net {
            Some(_) => NET_EVERY_PAGES,
            None => CLOCK_EVERY_PAGES,
        };
        let mut written = 0;
        while written < n {
            let k = step.min(n - written);
            match self.p.pattern {
                Pattern::Sequential => self.write_sequential(k),
                Pattern::Random | Pattern::HotCold => self.write_picked(k),
            }
            written += k;
            self.poll_net();
            if written < n
                && written.is_multiple_of(CLOCK_EVERY_PAGES)
                && self.clock.now_ns() >= until_ns
            {
                break;
            }
        }
        written
    }

    fn write_sequential(&mut self, mut n: u64) {
        while n > 0 {
            let index = self.cursor;
            let extent = self
                .plan
                .extents()
                .iter()
                .rev()
                .find(|e| e.first_index <= index)
                .copied()
                .unwrap_or_default();
            let run = n.min(extent.first_index + extent.pages - index);
            let first_pfn = extent.first_pfn + (index - extent.first_index);
            for k in 0..run {
                self.access((index + k) as usize, first_pfn + k);
            }
            self.cursor = (index + run) % self.plan.pages;
            n -= run;
        }
    }

    fn write_picked(&mut self, n: u64) {
        for _ in 0..n {
            let index = self.picker.next_index();
            self.access(index as usize, self.plan.pfn(index));
        }
    }

    /// A look at the clocks; one that went back is a verify failure.
    fn look_at_clocks(&mut self) {
        if self.clocks.look(&self.clock) {
            self.counters.verify_failures += 1;
        }
    }

    /// Sends a heartbeat with the workload's figures, and sets when the next is due.
    fn heartbeat(&mut self, now: u64) {
        let mut detail = [0; report::DETAIL_WORDS];
        detail[report::heartbeat::BAD_PAGES_TOTAL] = self.counters.bad_pages;
        detail[report::heartbeat::MAX_BATCH_NS] = core::mem::take(&mut self.max_batch_ns);
        detail[report::heartbeat::SLOW_BATCHES] = self.slow_batches;
        detail[report::heartbeat::SLOW_BATCH_TIME_NS] = self.slow_batch_ns;
        detail[report::heartbeat::PAGES_READ] = self.pages_read;
        detail[report::heartbeat::BAD_READS] = self.bad_reads;
        if let Some(free) = &mut self.free {
            free.poll();
            free.heartbeat(&mut detail);
        }
        let hb = self.counters.report(Kind::Heartbeat, &self.clock, detail);
        telemetry::send(&hb);
        self.send_disk();
        self.send_net();
        if let Some(vmgenid) = &mut self.vmgenid {
            vmgenid.look(&self.clock);
        }
        if let Some(pit) = &mut self.pit {
            pit.look(&self.clock, now);
        }
        let tsc_hz = self.pit.as_ref().map_or(0, Calibrator::hz);
        self.clocks.report(&self.clock, tsc_hz);
        self.next_heartbeat = now + u64::from(self.p.heartbeat_ms) * MS;
    }

    /// The disk workload's report, after each heartbeat.
    fn send_disk(&self) {
        if let Some(disk) = &self.disk {
            let detail = disk.counters().to_detail();
            telemetry::send(&self.counters.report(Kind::Disk, &self.clock, detail));
        }
    }

    /// The network workload's report, after each heartbeat (and the disk's), and a look at
    /// the NIC's MAC.
    fn send_net(&mut self) {
        if let Some(net) = &mut self.net {
            net.look_at_config();
            let detail = net.counters().to_detail();
            telemetry::send(&self.counters.report(Kind::Net, &self.clock, detail));
        }
    }

    /// Answers the frames the NIC received, if there is one: a read of guest memory when
    /// none came.
    #[inline(always)]
    fn poll_net(&mut self) {
        poll(&mut self.net);
    }

    /// The disk's share of a verify pass: its sweep goes on for [`disk::VERIFY_NS`] at most
    /// (or to the end of the disk), with heartbeats in between.
    fn verify_disk(&mut self) {
        let end = self.clock.now_ns() + disk::VERIFY_NS;
        while let Some(disk) = &mut self.disk {
            let net = &mut self.net;
            let until = self.next_heartbeat.min(end);
            let swept = disk.verify(&self.clock, until, &mut || poll(net));
            let now = self.clock.now_ns();
            if swept || now >= end {
                break;
            }
            self.heartbeat(now);
        }
    }

    fn verify(&mut self) {
        let start = self.clock.now_ns();
        let zero = self.p.zero_percent;
        let mut bad = 0u64;
        let mut listed = [0u64; report::LISTED_BAD_PAGES];
        let mut first_bad = None;
        let plan = self.plan;
        for e in plan.extents() {
            for k in 0..e.pages {
                if k % HEARTBEAT_CHECK_PAGES == 0 {
                    self.poll_net();
                    let now = self.clock.now_ns();
                    self.look_at_clocks();
                    if now >= self.next_heartbeat {
                        self.heartbeat(now);
                    }
                }
                let generation = self.record[(e.first_index + k) as usize];
                let pfn = e.first_pfn + k;
                let want = expected_word(pfn, generation, zero);
                if !self.holds(pfn, want) {
                    if (bad as usize) < listed.len() {
                        listed[bad as usize] = pfn;
                    }
                    first_bad.get_or_insert((pfn, want));
                    bad += 1;
                }
            }
        }
        if let Some(free) = &self.free {
            let mut found = 0;
            free.verify(&mut |pfn| {
                if let Some(slot) = listed.get_mut((bad + found) as usize) {
                    *slot = pfn;
                }
                first_bad.get_or_insert((pfn, 0));
                found += 1;
            });
            bad += found;
        }
        self.counters.verify_passes += 1;
        if bad > 0 {
            self.counters.verify_failures += 1;
            self.counters.bad_pages += bad;
        }
        let mut detail = [0u64; report::DETAIL_WORDS];
        detail[report::verify::PASS] = self.counters.verify_passes;
        detail[report::verify::BAD_PAGES] = bad;
        detail[report::verify::DURATION_NS] = self.clock.now_ns() - start;
        detail[report::verify::LISTED] = bad.min(listed.len() as u64);
        detail[report::verify::FIRST_BAD..][..listed.len()].copy_from_slice(&listed);
        telemetry::send(&self.counters.report(Kind::Verify, &self.clock, detail));
        if let Some((pfn, want)) = first_bad {
            let (word_pfn, word_gen) =
                ferry_guest_abi::stamp::decode(memory::read_word(pfn, self.lane.unwrap_or(0)));
            sprintln!(
                "ferry-guest: VERIFY FAILED vCPU {} pass {}: {} bad page(s); first bad frame {:#x} holds stamp (frame {:#x}, generation {}) where (frame {:#x}, generation {}) was written",
                self.clock.vcpu(),
                self.counters.verify_passes,
                bad,
                pfn,
                word_pfn,
                word_gen,
                want >> 32,
                want as u32
            );
        }
    }
}

/// [`Workload::poll_net`] for a caller that holds another of the workload's fields.
#[inline(always)]
fn poll(net: &mut Option<Net>) {
    if let Some(net) = net {
        net.poll();
    }
}
