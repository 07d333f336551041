//! The RTC on real KVM with the built-in guest (issue 53): the guest reads the host's time
//! of day from it; a time the guest set with SET goes with it across a migration; and the
//! PIT's and the RTC's state sections save, load into a fresh VM and save again bit for bit
//! (the PIT's but for its channel 2 count's age and the wall clock, which move on).

mod common;

use std::time::Duration;

use common::{boot, config, migrate_into, require_kvm, wait_for_telemetry};
use ferry_migrate::{DestinationVm, Section, SourceVm};
use ferry_vmm::Vm;
use ferry_vmm::devices::rtc::state;
use ferry_vmm::devices::telemetry::GuestTelemetry;
use ferry_vmm::devices::telemetry_rtc::GuestRtc;
use ferry_vmm::section_ids::{PIT, RTC};

const MIB: u64 = 1 << 20;
/// 2001-09-09 01:46:40 UTC.
const SET_TO: u64 = 1_000_000_000;

/// The guest's latest RTC reading once it made `at_least` calibrations (each reads it).
fn reading(g: &GuestTelemetry, at_least: u64) -> Option<GuestRtc> {
    let c = g.tsc_calibration?;
    (c.calibrations >= at_least).then_some(g.rtc).flatten()
}

/// The RTC's time minus the host's wall clock when the report arrived, seconds.
fn offset(r: &GuestRtc) -> i64 {
    r.unix_seconds as i64 - r.host_unix_seconds as i64
}

#[test]
fn the_guest_reads_the_host_s_time_of_day_from_the_rtc() {
    require_kvm();
    let vm = boot(64 * MIB, "ws=4M rate=10 verify-ms=0 log-ms=0");
    let g = vm.wait_for("an RTC reading", Duration::from_secs(20), |g| {
        g.tsc_calibration.is_some()
    });
    let r = g
        .rtc
        .unwrap_or_else(|| panic!("no RTC reading\n{}", vm.serial_log()));
    eprintln!("{r:?}");
    assert_eq!(r.format, ("bcd", "24h"), "as a PC's firmware leaves it");
    assert!(
        offset(&r).abs() <= 2,
        "the RTC reads the host's time: {r:?}"
    );
}

/// The guest sets 2001 with SET at boot and reads it back with each calibration (every
/// 200 ms); after a migration the destination's RTC still reads 2001, advanced by the time
/// that passed (read 2 s or more after the source's reading): its offset from the host's wall clock is the source's to within 2 s. (A
/// destination that lost the RTC's state would read the host's time, 25 years on.)
#[test]
fn a_migrated_rtc_keeps_the_time_of_day_the_guest_set() {
    require_kvm();
    let cmdline = format!("ws=4M rate=10 verify-ms=0 log-ms=0 calibrate-ms=200 rtc-set={SET_TO}");
    let src = boot(64 * MIB, &cmdline);
    let g = src.wait_for("the RTC read after its set", Duration::from_secs(20), |g| {
        reading(g, 1).is_some()
    });
    let before = g.rtc.unwrap();
    eprintln!("on the source: {before:?}");
    let since_set = before.unix_seconds - SET_TO;
    assert!(since_set <= 5, "the time set, run on since: {before:?}");

    let dir = tempfile::tempdir().unwrap();
    let incoming = Vm::incoming(config(64 * MIB, "", &dir.path().join("serial"))).unwrap();
    let (dst, _) = migrate_into(&src.handle(), incoming, |_| {});
    let seen = src
        .handle()
        .telemetry()
        .tsc_calibration
        .map_or(0, |c| c.calibrations);
    let after = wait_for_telemetry(
        &dst.handle(),
        "an RTC reading on the destination, 2 s after the source's",
        Duration::from_secs(10),
        |g| {
            reading(g, seen + 1)
                .is_some_and(|r| r.host_unix_seconds >= before.host_unix_seconds + 2)
        },
    );
    let after = after.rtc.unwrap();
    eprintln!("on the destination: {after:?}");
    assert!(after.unix_seconds < SET_TO + 3600, "still 2001: {after:?}");
    assert!(
        after.unix_seconds > before.unix_seconds,
        "and running: {before:?} then {after:?}"
    );
    assert!(
        (offset(&after) - offset(&before)).abs() <= 2,
        "the guest's time of day kept its offset from the wall clock: {before:?} then {after:?}"
    );
}

/// The section of `id` in a VM's saved state.
fn section(state: &[Section], id: ferry_migrate::wire::SectionId) -> &Section {
    state
        .iter()
        .find(|s| s.id == id)
        .unwrap_or_else(|| panic!("no {id} section"))
}

/// Issue 53's goal: a booted guest (its boot calibration programmed PIT channel 2, and it set
/// its RTC with SET) is paused and its state saved; the state loads into a fresh VM, which
/// saves its own: the PIT's and the RTC's sections are the same bytes.
#[test]
fn the_pit_and_rtc_state_save_load_into_a_fresh_vm_and_save_again_bit_exact() {
    require_kvm();
    let cmdline = format!("ws=4M rate=10 verify-ms=0 log-ms=0 rtc-set={SET_TO}");
    let src = boot(64 * MIB, &cmdline);
    src.wait_for("the boot calibration", Duration::from_secs(20), |g| {
        reading(g, 1).is_some()
    });
    let mut source = src.handle().migration_source();
    source.pause().unwrap();
    let saved = source.save_state().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut fresh = Vm::incoming(config(64 * MIB, "", &dir.path().join("serial"))).unwrap();
    let before_load = fresh.handle().migration_source().save_state().unwrap();
    fresh.load_state(&saved).unwrap();
    let again = fresh.handle().migration_source().save_state().unwrap();

    for id in [PIT, RTC] {
        let (a, b) = (section(&saved, id), section(&again, id));
        assert_ne!(
            section(&before_load, id).data,
            a.data,
            "the fresh VM's {id} differs before the load"
        );
        assert_eq!(a.version, b.version);
        // The PIT's channel 2 count's age and the wall clock after its state move on.
        let exact = match id {
            PIT => ferry_vmm::devices::pit::EXACT_BYTES,
            _ => a.data.len(),
        };
        assert_eq!(a.data.len(), b.data.len());
        assert_eq!(
            a.data[..exact],
            b.data[..exact],
            "{id}: save, load, save gives the same bytes"
        );
    }
    let rtc = state::decode(&section(&again, RTC).data).unwrap();
    let offset_s = rtc.offset_ns / 1_000_000_000;
    assert!(
        offset_s < -700_000_000,
        "the guest's 2001, kept: {offset_s} s"
    );
    let differing: Vec<String> = saved
        .iter()
        .filter(|s| {
            again
                .iter()
                .any(|t| (t.id, t.instance) == (s.id, s.instance) && t.data != s.data)
        })
        .map(|s| format!("{} {}", s.id, s.instance))
        .collect();
    eprintln!("sections that differ after save, load, save: {differing:?}");
    source.resume().unwrap();
}
