//! The RTC model on a clock the tests move by hand, and the device on the wall clock.

use super::model::*;
use super::*;
use ferry_guest_abi::rtc::{self as calendar, DM_BINARY, HOURS_24, Time};
use std::sync::Mutex;

const NS: i128 = 1_000_000_000;
const MS: i128 = 1_000_000;
/// 2026-11-28 12:00:00.250 UTC, as the host's wall clock.
const T0: i128 = 1_795_867_200 * NS + 250 * MS;

fn rtc() -> Rtc {
    Rtc::new(cmos::at_boot(128 << 20, 1), T0)
}

fn read(r: &mut Rtc, reg: u8, now: i128) -> u8 {
    r.select(reg);
    r.read(now).0
}

fn write(r: &mut Rtc, reg: u8, value: u8, now: i128) -> bool {
    r.select(reg);
    r.write(value, now)
}

/// The time registers' fields read the way a guest reads them, as a [`Time`].
fn time(r: &mut Rtc, now: i128) -> Time {
    let b = read(r, REG_B as u8, now);
    let regs = calendar::TIME_REGISTERS.map(|i| read(r, i as u8, now));
    Time::from_registers(&regs, b)
}

#[test]
fn a_fresh_rtc_reads_the_host_s_time_in_bcd_24_hour() {
    let mut r = rtc();
    assert_eq!(read(&mut r, 0x00, T0), 0x00, "seconds, BCD");
    assert_eq!(read(&mut r, 0x04, T0), 0x12, "hours");
    assert_eq!(read(&mut r, 0x09, T0), 0x26, "year");
    assert_eq!(read(&mut r, 0x32, T0), 0x20, "century");
    assert_eq!(read(&mut r, 0x08, T0), 0x11, "November");
    assert_eq!(
        time(&mut r, T0 + 61 * NS).to_unix(),
        1_795_867_261,
        "it runs"
    );
    assert_eq!(read(&mut r, REG_D as u8, T0), VRT);
    assert_eq!(read(&mut r, REG_A as u8, T0), 0x26);
}

#[test]
fn register_b_switches_binary_and_12_hour_at_once() {
    let mut r = rtc();
    write(&mut r, REG_B as u8, DM_BINARY, T0);
    let at = T0 + 2 * 3600 * NS; // 14:00
    assert_eq!(read(&mut r, 0x04, at), 2 | 0x80, "2 PM, binary");
    assert_eq!(read(&mut r, 0x09, at), 26);
    write(&mut r, REG_B as u8, HOURS_24, at);
    assert_eq!(read(&mut r, 0x04, at), 0x14);
}

/// The guest sets 2001-09-09 01:46:40 with SET: frozen while SET is set, running from the
/// moment it is cleared, and still that time plus what passed a minute later.
#[test]
fn a_time_written_under_set_freezes_then_sticks_and_runs() {
    let mut r = rtc();
    write(&mut r, REG_B as u8, SET | HOURS_24, T0);
    let frozen = read(&mut r, 0x00, T0 + 5 * NS);
    assert_eq!(frozen, 0x00, "frozen at the second SET was set");
    let regs = Time::from_unix(1_000_000_000).registers(HOURS_24);
    for (reg, v) in calendar::TIME_REGISTERS.into_iter().zip(regs) {
        write(&mut r, reg as u8, v, T0 + 6 * NS);
    }
    assert_eq!(
        time(&mut r, T0 + 9 * NS).to_unix(),
        1_000_000_000,
        "still frozen"
    );
    assert_eq!(
        read(&mut r, REG_A as u8, T0 + NS - 1000) & UIP,
        0,
        "no UIP under SET"
    );
    let start = T0 + 10 * NS;
    write(&mut r, REG_B as u8, HOURS_24, start);
    assert_eq!(time(&mut r, start + NS - 1).to_unix(), 1_000_000_000);
    assert_eq!(time(&mut r, start + NS).to_unix(), 1_000_000_001);
    assert_eq!(time(&mut r, start + 60 * NS).to_unix(), 1_000_000_060);
    assert_eq!(r.time_ns(start), 1_000_000_000 * NS);

    // A field written while the clock runs: the minutes, keeping the place in the second.
    write(&mut r, 0x02, 0x00, start + 60 * NS + 300 * MS);
    assert_eq!(
        r.time_ns(start + 60 * NS + 300 * MS),
        (1_000_000_060 - 47 * 60) * NS + 300 * MS
    );
}

#[test]
fn setting_set_clears_uie() {
    let mut r = rtc();
    write(&mut r, REG_B as u8, SET | UIE | HOURS_24, T0);
    assert_eq!(read(&mut r, REG_B as u8, T0), SET | HOURS_24);
}

#[test]
fn uip_is_high_for_244_us_before_each_second() {
    let mut r = rtc();
    let second = T0 - 250 * MS + NS;
    assert_eq!(read(&mut r, REG_A as u8, second - 245_000) & UIP, 0);
    assert_eq!(read(&mut r, REG_A as u8, second - 243_000) & UIP, UIP);
    assert_eq!(read(&mut r, REG_A as u8, second) & UIP, 0);
}

/// 1024 Hz (rate 6): one period is 32 ticks of 32.768 kHz, 976,562.5 ns. PF is set by the
/// period's end whether or not enabled; with PIE the line goes high once, and stays high
/// (no second edge) until register C is read, which clears the flags and lowers it.
#[test]
fn the_periodic_flag_follows_the_rate_and_register_c_clears_it_and_the_line() {
    let mut r = rtc();
    assert_eq!(read(&mut r, REG_C as u8, T0), 0);
    let start = T0 - 250 * MS + NS; // a second boundary: a period boundary too
    assert_eq!(
        read(&mut r, REG_C as u8, start),
        UF | PF,
        "a second passed, a period with it"
    );
    assert_eq!(
        read(&mut r, REG_C as u8, start + 976_000),
        0,
        "within the period"
    );
    assert_eq!(
        read(&mut r, REG_C as u8, start + 977_000),
        PF,
        "past it, not enabled"
    );

    assert!(
        !write(&mut r, REG_B as u8, PIE | HOURS_24, start + 977_000),
        "no flag yet"
    );
    let next = r.next_event(start + 977_000).unwrap();
    assert_eq!(next, start + 1_953_125, "two periods after the second");
    assert!(!r.update(next - 1));
    assert!(r.update(next), "the line rises at the period's end");
    assert!(!r.update(next + 10 * MS), "and stays high: no second edge");
    assert_eq!(r.next_event(next + 10 * MS), None, "nothing to wake for");
    assert_eq!(read(&mut r, REG_C as u8, next + 10 * MS), IRQF | PF);
    assert!(!r.line);
    assert_eq!(read(&mut r, REG_C as u8, next + 10 * MS), 0);

    // Rate 15: 2 Hz; rate 0: none.
    write(&mut r, REG_A as u8, 0x2f, start + 20 * MS);
    read(&mut r, REG_C as u8, start + 20 * MS);
    assert_eq!(r.next_event(start + 20 * MS), Some(start + 500 * MS));
    write(&mut r, REG_A as u8, 0x20, start + 20 * MS);
    assert_eq!(r.next_event(start + 20 * MS), None);
    assert_eq!(period_ticks(1), Some(128));
    assert_eq!(period_ticks(3), Some(4));
}

#[test]
fn the_alarm_and_the_update_ended_interrupt() {
    let mut r = rtc(); // 12:00:00.25
    write(&mut r, 0x01, 0x05, T0);
    write(&mut r, 0x03, 0xc0, T0); // any minute
    write(&mut r, 0x05, 0x12, T0);
    write(&mut r, REG_B as u8, AIE | HOURS_24, T0);
    let second = T0 - 250 * MS + NS;
    assert_eq!(
        r.next_event(T0),
        Some(second),
        "wakes each second for the alarm"
    );
    assert!(!r.update(second + 3 * NS), "12:00:04");
    assert!(r.update(second + 4 * NS), "12:00:05 matches");
    assert_eq!(
        read(&mut r, REG_C as u8, second + 4 * NS + 1),
        IRQF | PF | AF | UF,
    );
    write(&mut r, REG_B as u8, UIE | HOURS_24, second + 4 * NS + 2);
    assert!(!r.update(second + 5 * NS - 1));
    assert!(r.update(second + 5 * NS), "update-ended at the next second");
}

#[test]
fn the_index_port_keeps_the_nmi_mask_and_plain_cmos_bytes_hold_what_is_written() {
    let mut r = rtc();
    write(&mut r, 0x80 | 0x40, 0xab, T0);
    assert_eq!(r.index, 0xc0);
    assert_eq!(read(&mut r, 0x40, T0), 0xab);
    assert_eq!(read(&mut r, 0x15, T0), 0x80, "base memory, low byte");
    write(&mut r, REG_C as u8, 0xff, T0);
    write(&mut r, REG_D as u8, 0x00, T0);
    assert_eq!(read(&mut r, REG_D as u8, T0), VRT, "read only");
}

#[test]
fn the_state_round_trips_and_malformed_state_is_refused_by_cause() {
    let mut r = rtc();
    write(&mut r, REG_B as u8, PIE | HOURS_24, T0);
    r.update(T0 + 2 * MS);
    r.offset_ns = -25 * 365 * 86_400 * NS;
    let bytes = state::encode(&r);
    assert_eq!(bytes.len(), state::STATE_BYTES);
    assert_eq!(state::decode(&bytes), Ok(r.clone()));

    let e = state::decode(&bytes[1..]).unwrap_err();
    assert!(e.contains("163 bytes, want 164"), "{e}");
    let mut bad = bytes.clone();
    bad[129] = 2;
    assert!(state::decode(&bad).unwrap_err().contains("layout"));
    let mut bad = bytes.clone();
    bad[REG_C] = IRQF;
    bad[129] = 0;
    assert!(state::decode(&bad).is_ok());
    bad[REG_C] = 0;
    bad[129] = 1;
    assert!(state::decode(&bad).unwrap_err().contains("IRQF clear"));
    let mut bad = bytes.clone();
    bad[REG_A] |= UIP;
    assert!(state::decode(&bad).unwrap_err().contains("UIP"));
    let mut bad = bytes.clone();
    bad[132..148].copy_from_slice(&i128::MAX.to_le_bytes());
    assert!(state::decode(&bad).unwrap_err().contains("10,000 years"));
}

/// The device on the wall clock with its timer thread: PIE at 1024 Hz raises IRQ 8's line
/// (an eventfd here) again after each read of register C, at most once a period; a state
/// saved loads into another RTC and saves the same; a newer layout or a malformed one is
/// refused with the device named.
#[test]
fn the_device_raises_its_line_at_the_periodic_rate_and_its_state_round_trips() {
    let line = IrqLine::unconnected().unwrap();
    let counter = line.try_clone().unwrap();
    let mut d = RtcDevice::new(line, cmos::at_boot(64 << 20, 1)).unwrap();
    let out = |d: &mut RtcDevice, reg: u8, v: u8| {
        d.write(0, &[reg]);
        d.write(1, &[v]);
    };
    let mut r = [0u8];
    out(&mut d, REG_B as u8, PIE | HOURS_24);
    let started = std::time::Instant::now();
    let mut edges = 0;
    while started.elapsed() < Duration::from_millis(200) {
        if let Ok(n) = counter.eventfd().read() {
            edges += n;
            d.write(0, &[REG_C as u8]);
            d.read(1, &mut r);
            assert_eq!(r[0] & (IRQF | PF), IRQF | PF);
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let hz = edges as f64 / elapsed;
    eprintln!("periodic interrupt at rate 6: {edges} edges in {elapsed:.3} s, {hz:.0} Hz");
    // Never more than one edge a period (a hard bound, whatever the host's load: the periods
    // the window spans, one more for its ends, one for the flag pending at the start); and the line
    // rises again after each read of C (how often depends on how soon this thread reads it).
    assert!(
        edges as f64 <= 1024.0 * elapsed + 3.0,
        "at most 1024 Hz, {hz:.0} Hz"
    );
    assert!(edges >= 10, "the line rose again after each read: {edges}");

    out(&mut d, REG_B as u8, HOURS_24);
    d.write(0, &[REG_C as u8]);
    d.read(1, &mut r);
    let saved = d.save();
    let other = RtcDevice::new(IrqLine::unconnected().unwrap(), [0; 128]);
    let mut other = other.unwrap();
    other.restore(VERSION, &saved).unwrap();
    assert_eq!(other.save(), saved, "save, load, save: the same bytes");
    let e = other.restore(VERSION + 1, &saved).unwrap_err().to_string();
    assert!(e.contains("RTC state version 2"), "{e}");
    let e = other
        .restore(VERSION, &saved[..100])
        .unwrap_err()
        .to_string();
    assert!(e.contains("RTC state is malformed: 100 bytes"), "{e}");
}

/// A stream from a source older than the RTC (no section 12) loads, the RTC staying as it
/// was built; one with the section loads it. A state whose line was high raises the line
/// again at the load (the source's edge may have missed the saved interrupt controller).
#[test]
fn a_stream_without_the_rtc_section_loads_and_a_high_line_is_raised_again() {
    use crate::devices::{BusKind, Devices};
    use crate::part_timer::PartTimer;
    let build = || {
        let line = IrqLine::unconnected().unwrap();
        let edges = line.try_clone().unwrap();
        let device = RtcDevice::new(line, cmos::at_boot(64 << 20, 1)).unwrap();
        let mut d = Devices::default();
        let at = (BusKind::Pio, u64::from(PORT), LEN);
        d.register("RTC", 0, at, Arc::new(Mutex::new(device)))
            .unwrap();
        (d, edges)
    };
    let (source, _) = build();
    source.io_out(PORT, &[0x40]);
    source.io_out(PORT + 1, &[0x5a]);
    // The update-ended flag, enabled and not yet read: the line is high.
    source.io_out(PORT, &[REG_B as u8]);
    source.io_out(PORT + 1, &[UIE | HOURS_24]);
    std::thread::sleep(Duration::from_millis(1100));
    let saved = source.save(&mut PartTimer::start());
    assert_eq!((saved[0].id, saved[0].version), (section_ids::RTC, VERSION));
    assert!(state::decode(&saved[0].data).unwrap().line, "{saved:?}");

    let (destination, edges) = build();
    destination.load(&[], &mut PartTimer::start()).unwrap();
    let mut r = [0u8];
    destination.io_out(PORT, &[0x40]);
    destination.io_in(PORT + 1, &mut r);
    assert_eq!(r[0], 0, "as built");
    assert!(edges.eventfd().read().is_err(), "no edge yet");
    destination.load(&saved, &mut PartTimer::start()).unwrap();
    destination.io_in(PORT + 1, &mut r);
    assert_eq!(
        r[0],
        UIE | HOURS_24,
        "register B, the index the source's guest left"
    );
    destination.io_out(PORT, &[0x40]);
    destination.io_in(PORT + 1, &mut r);
    assert_eq!(r[0], 0x5a, "the source's");
    assert_eq!(
        edges.eventfd().read().unwrap(),
        1,
        "the high line raised again"
    );
}

/// On real KVM: the RTC's line connected to GSI 8 as the VMM connects it; with PIE set the
/// periodic interrupt lands in the slave PIC's request register, bit 0 (IRQ 8).
#[test]
fn the_periodic_interrupt_reaches_irq_8_of_the_in_kernel_controller() {
    use crate::kvm::{KvmVm, irqchip};
    use crate::memory::{GuestRam, MIN_MEMORY};
    crate::kvm::require_for_tests();
    let ram = GuestRam::new(MIN_MEMORY).unwrap();
    let vm = KvmVm::new(crate::kvm::open().unwrap(), &ram).unwrap();
    irqchip::create(&vm.vm).unwrap();
    let line = IrqLine::unconnected().unwrap();
    irqchip::connect(&vm.vm, &line, IRQ).unwrap();
    let mut d = RtcDevice::new(line, cmos::at_boot(MIN_MEMORY, 1)).unwrap();
    let slave_irr = || irqchip::pic_irr(&vm.vm, irqchip::Chip::PicSlave) & 1;
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(slave_irr(), 0, "nothing enabled, nothing raised");
    d.write(0, &[REG_B as u8]);
    d.write(1, &[PIE | HOURS_24]);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(slave_irr(), 1, "IRQ 8 requested within 20 ms at 1024 Hz");
}

/// The host's wall clock stepped back an hour: the flags are brought to the earlier time at
/// once, and the next periodic event is one period after it, not an hour away.
#[test]
fn a_wall_clock_stepped_back_is_taken_at_once() {
    let mut r = rtc();
    write(&mut r, REG_B as u8, PIE | HOURS_24, T0);
    read(&mut r, REG_C as u8, T0);
    let back = T0 - 3600 * NS;
    assert!(r.time_ns(back) < r.seen_ns);
    r.update(back);
    assert_eq!(r.seen_ns, back);
    let next = r.next_event(back).unwrap();
    assert!(next > back && next - back <= 976_563, "{}", next - back);
}
