//! The boot vCPU's first words once it knows its plan: the Boot and Layout reports, and the
//! serial line that says what the guest will do.

use ferry_guest::plan::Plan;
use ferry_guest::rate::RateText;
use ferry_guest_abi::PAGE_SIZE;
use ferry_guest_abi::params::{Params, Rate};
use ferry_guest_abi::report::{self, Kind, Report};

use super::boot_info::BootInfo;
use super::clock::Clock;
use super::telemetry;
use crate::sprintln;

/// Sends the Boot and Layout reports and prints the plan.
pub fn boot(boot: &BootInfo, p: &Params, plan: &Plan, clock: &Clock) {
    let mut detail = [0u64; report::DETAIL_WORDS];
    detail[report::boot::RAM_BYTES] = boot.ram_bytes;
    detail[report::boot::WS_PAGES] = plan.pages;
    detail[report::boot::RATE] = match p.rate {
        Rate::FlatOut => 0,
        Rate::Idle => report::boot::RATE_IDLE,
        Rate::MegabytesPerSecond(r) => u64::from(r),
    };
    detail[report::boot::PATTERN] = p.pattern as u64;
    detail[report::boot::ZERO_PERCENT] = u64::from(p.zero_percent);
    detail[report::boot::VERIFY_MS] = u64::from(p.verify_ms);
    detail[report::boot::HEARTBEAT_MS] = u64::from(p.heartbeat_ms);
    detail[report::boot::CLOCK] = clock.source() as u64;
    detail[report::boot::HOT_PERCENT] = u64::from(p.hot_percent);
    detail[report::boot::VCPUS] = u64::from(p.vcpus);
    telemetry::send(&Report {
        kind: Kind::Boot as u16,
        guest_ns: clock.now_ns(),
        detail,
        ..Report::default()
    });
    let mut layout = [0u64; report::DETAIL_WORDS];
    layout[report::layout::EXTENTS] = plan.extent_count as u64;
    for (i, e) in plan.extents().iter().enumerate() {
        layout[report::layout::FIRST + 2 * i] = e.first_pfn;
        layout[report::layout::FIRST + 2 * i + 1] = e.pages;
    }
    layout[report::layout::RECORD] = plan.record;
    telemetry::send(&Report {
        kind: Kind::Layout as u16,
        guest_ns: clock.now_ns(),
        detail: layout,
        ..Report::default()
    });
    sprintln!(
        "ferry-guest: {} MiB RAM, working set {} MiB ({} pages at frame {:#x}), pattern {}, rate {}, zero {}%, verify every {} ms, clock {:?}, {} vCPU(s)",
        boot.ram_bytes >> 20,
        (plan.pages * PAGE_SIZE) >> 20,
        plan.pages,
        plan.extents[0].first_pfn,
        p.pattern.name(),
        RateText(p.rate),
        p.zero_percent,
        p.verify_ms,
        clock.source(),
        p.vcpus
    );
}
