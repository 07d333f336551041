//! The command-line parser's tests: every key, good values and bad.

extern crate std;

use super::*;

#[test]
fn empty_command_line_gives_defaults() {
    assert_eq!(parse(""), Ok(Params::default()));
    assert_eq!(parse("   "), Ok(Params::default()));
}

#[test]
fn every_key_parses() {
    let p = parse(
        "ws=64M rate=400 pattern=hotcold hot=20 zero=15 read=30 verify-ms=250 heartbeat-ms=5 \
         log-ms=0 run-ms=3000 fault-after-ms=9 seed=42",
    )
    .unwrap();
    assert_eq!(p.working_set, Some(64 << 20));
    assert_eq!(p.rate, Rate::MegabytesPerSecond(400));
    assert_eq!(p.pattern, Pattern::HotCold);
    assert_eq!(
        (p.hot_percent, p.zero_percent, p.read_percent),
        (20, 15, 30)
    );
    assert_eq!((p.verify_ms, p.heartbeat_ms, p.log_ms), (250, 5, 0));
    assert_eq!((p.run_ms, p.fault_after_ms, p.seed), (3000, 9, 42));
}

#[test]
fn free_memory_churn_and_a_virtio_device_parse() {
    let p = parse("free=6G churn=50 virtio_mmio.device=4K@0xd0000000:5").unwrap();
    assert_eq!((p.free, p.churn_mb_s), (6 << 30, 50));
    assert_eq!(
        p.mmio_devices().collect::<std::vec::Vec<_>>(),
        [MmioDevice {
            size: 4096,
            addr: 0xd000_0000,
            irq: 5
        }]
    );
    assert_eq!(parse("free=3M").unwrap().free, 2 << 20, "whole blocks");
    for bad in ["4K@0xd0000000", "4K:5", "0@0x10:5", "4K@0x:5", "4K@0xzz:5"] {
        assert_eq!(parse_mmio_device(bad), None, "{bad}");
    }
    assert_eq!(parse_mmio_device("1M@4096:9").unwrap().addr, 4096);
}

#[test]
fn several_virtio_devices_are_kept_in_order_up_to_the_limit() {
    let p = parse("virtio_mmio.device=4K@0xd0001000:6 ws=4M virtio_mmio.device=4K@0xd0000000:5")
        .unwrap();
    let addrs: std::vec::Vec<u64> = p.mmio_devices().map(|d| d.addr).collect();
    assert_eq!(addrs, [0xd000_1000, 0xd000_0000]);
    // The same address again replaces the device (the VMM appends what the user wrote).
    let p = parse("virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=8K@0xd0000000:7").unwrap();
    let devs: std::vec::Vec<MmioDevice> = p.mmio_devices().collect();
    assert_eq!((devs.len(), devs[0].size, devs[0].irq), (1, 8192, 7));
    let four = "virtio_mmio.device=4K@0x1000:1 virtio_mmio.device=4K@0x2000:2 \
                virtio_mmio.device=4K@0x3000:3 virtio_mmio.device=4K@0x4000:4";
    assert_eq!(
        parse(four).unwrap().mmio_devices().count(),
        MAX_MMIO_DEVICES
    );
    let five = std::format!("{four} virtio_mmio.device=4K@0x5000:5");
    let msg = std::format!("{}", parse(&five).unwrap_err());
    assert!(msg.contains("at most 4 virtio-mmio devices"), "{msg}");
    // A fifth naming a device already listed is no fifth.
    let again = std::format!("{four} virtio_mmio.device=4K@0x3000:9");
    assert_eq!(parse(&again).unwrap().mmio[2].unwrap().irq, 9);
    assert_eq!(parse("").unwrap().mmio_devices().count(), 0);
}

#[test]
fn disk_keys_parse_and_default() {
    let d = parse("").unwrap();
    assert_eq!((d.disk, d.disk_blocks()), (0, 0));
    assert_eq!(
        d.disk_rate,
        Rate::MegabytesPerSecond(DEFAULT_DISK_RATE_MB_S)
    );
    assert_eq!((d.disk_pattern, d.disk_read_percent), (Pattern::Random, 20));
    let p = parse("disk=64M disk-rate=max disk-pattern=seq disk-read=0").unwrap();
    assert_eq!((p.disk, p.disk_blocks()), (64 << 20, 16384));
    assert_eq!(p.disk_rate, Rate::FlatOut);
    assert_eq!(
        (p.disk_pattern, p.disk_read_percent),
        (Pattern::Sequential, 0)
    );
    let p = parse("disk=2G disk-rate=250 disk-pattern=random disk-read=100").unwrap();
    assert_eq!(p.disk, 2 << 30);
    assert_eq!(p.disk_rate, Rate::MegabytesPerSecond(250));
    assert_eq!(p.disk_read_percent, 100);
    assert_eq!(parse("disk=16T").unwrap().disk_blocks(), MAX_DISK_BLOCKS);
    assert_eq!(parse("disk=4096").unwrap().disk_blocks(), 1);
}

#[test]
fn net_keys_parse_and_default() {
    let d = parse("").unwrap();
    assert_eq!((d.net, d.net_port), (None, 7));
    let p = parse("net=10.0.0.2").unwrap();
    assert_eq!(
        (p.net, p.net_port),
        (Some(crate::net::Ipv4([10, 0, 0, 2])), 7)
    );
    let p = parse("net=192.168.100.7 net-port=65535").unwrap();
    assert_eq!(p.net, Some(crate::net::Ipv4([192, 168, 100, 7])));
    assert_eq!(p.net_port, 65535);
    assert_eq!(parse("net-port=1").unwrap().net_port, 1);
}

#[test]
fn vcpus_and_the_faulting_vcpu_parse_in_range() {
    let p = parse("vcpus=64 fault-vcpu=63").unwrap();
    assert_eq!((p.vcpus, p.fault_vcpu), (64, 63));
    assert_eq!(p.records(), 1);
    assert_eq!(parse("vcpus=8 shared=1").unwrap().records(), 8);
    assert_eq!(parse("").unwrap().vcpus, 1);
    for bad in ["vcpus=0", "vcpus=65", "fault-vcpu=64"] {
        assert!(parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn later_keys_win() {
    assert_eq!(parse("rate=5 rate=max").unwrap().rate, Rate::FlatOut);
    assert_eq!(parse("rate=max rate=idle").unwrap().rate, Rate::Idle);
}

#[test]
fn bad_values_name_key_and_expectation() {
    let table: &[(&str, &str)] = &[
        ("ws=lots", "bad value 'lots' for guest parameter 'ws'"),
        ("ws=0", "at least 4K"),
        ("rate=0", "'max', 'idle' or megabytes per second"),
        ("pattern=zigzag", "seq, random or hotcold"),
        ("zero=101", "a percentage 0-100"),
        ("read=101", "a percentage 0-100"),
        ("hot=0", "a percentage 1-100"),
        ("heartbeat-ms=0", "at least 1"),
        ("verify-ms=-1", "milliseconds"),
        ("run-ms=99999999999", "milliseconds"),
        ("fill=lots", "stamp, random or mixed"),
        ("prefill=yes", "0 or 1"),
        ("vcpus=65", "a vCPU count from 1 to 64"),
        ("shared=2", "0 or 1"),
        ("shared=1 fill=random", "0 with fill=random"),
        ("shared=1 fill=mixed", "0 with fill=random or mixed"),
        ("fault-vcpu=2 vcpus=2", "below vcpus="),
        ("disk=6000", "a multiple of 4K"),
        ("disk=1.5K", "a multiple of 4K"),
        ("disk=lots", "bad value 'lots' for guest parameter 'disk'"),
        ("disk=17T", "at most 16T"),
        ("disk-rate=0", "'max' or megabytes per second"),
        ("disk-rate=idle", "'max' or megabytes per second"),
        ("disk-pattern=hotcold", "seq or random"),
        ("disk-read=101", "a percentage 0-100"),
        ("virtio_mmio.device=4K", "<size>@<address>:<irq>"),
        ("net=10.0.0", "a unicast IPv4 address"),
        ("net=10.0.0.256", "a unicast IPv4 address"),
        ("net=0.0.0.0", "a unicast IPv4 address"),
        ("net=239.1.1.1", "a unicast IPv4 address"),
        ("net=255.255.255.255", "a unicast IPv4 address"),
        ("net-port=0", "a UDP port from 1 to 65535"),
        ("net-port=65536", "a UDP port from 1 to 65535"),
        (
            "frobnicate=1",
            "unknown guest parameter 'frobnicate'; known keys are: ws rate",
        ),
        ("ws", "'ws' is not key=value"),
    ];
    for (line, want) in table {
        let err = parse(line).unwrap_err();
        let msg = std::format!("{err}");
        assert!(msg.contains(want), "{line}: got '{msg}'");
    }
}

#[test]
fn overlong_command_line_is_refused() {
    let long = [b'x'; crate::CMDLINE_MAX + 1];
    let long = core::str::from_utf8(&long).unwrap();
    assert_eq!(
        parse(long),
        Err(ParamError::TooLong(crate::CMDLINE_MAX + 1))
    );
}

#[test]
fn help_lists_every_key_the_parser_takes() {
    for (key, ..) in HELP {
        let line = std::format!("{key}=1");
        assert!(
            !matches!(parse(&line), Err(ParamError::UnknownKey(_))),
            "{key}"
        );
    }
}

#[test]
fn sizes() {
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("64M"), Some(64 << 20));
    assert_eq!(parse_size("2GiB"), Some(2 << 30));
    assert_eq!(parse_size("1T"), Some(1 << 40));
    assert_eq!(parse_size("12X"), None);
    assert_eq!(parse_size("G"), None);
    // Any case, and fractions (a user writing 2g or 3.5G was refused without a reason).
    assert_eq!(parse_size("2g"), Some(2 << 30));
    assert_eq!(parse_size("512mib"), Some(512 << 20));
    assert_eq!(parse_size("3.5G"), Some(7 << 29));
    assert_eq!(parse_size("0.5k"), Some(512));
    assert_eq!(parse_size(".25M"), Some(1 << 18));
    assert_eq!(parse_size("1."), None);
    assert_eq!(parse_size("1.2.3G"), None);
    assert_eq!(parse_size("."), None);
    assert_eq!(parse_size("99999999999999999999"), None);
    assert_eq!(parse_size("99999999999T"), None);
}

#[test]
fn ws_is_rounded_down_to_pages() {
    assert_eq!(parse("ws=5000").unwrap().working_set, Some(4096));
}

#[test]
fn pattern_round_trips_through_u8() {
    for p in [Pattern::Sequential, Pattern::Random, Pattern::HotCold] {
        assert_eq!(Pattern::from_u8(p as u8), Some(p));
    }
    assert_eq!(Pattern::from_u8(0), None);
}
