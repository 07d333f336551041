//! The guest's command line: space-separated `key=value` pairs, every key optional.
//!
//! | key | value | default | meaning |
//! | --- | --- | --- | --- |
//! | `ws` | size (`256M`, `1G`, …) | 256M, or half the free RAM if less | working-set size |
//! | `rate` | `max` or MB/s (10^6 bytes) | `max` | how fast the working set is dirtied |
//! | `pattern` | `seq`, `random`, `hotcold` | `seq` | which page each write goes to |
//! | `hot` | percent of the working set, 1–100 | 10 | the hot share for `hotcold` ([`HOT_WRITE_PERCENT`]% of writes go there) |
//! | `zero` | percent, 0–100 | 0 | share of writes that leave the page all zeros |
//! | `read` | percent, 0–100 | 0 | share of accesses that read a page and check it against its last write instead of writing it (`rate` paces all accesses) |
//! | `verify-ms` | ms, 0 = never | 1000 | interval between verify passes |
//! | `heartbeat-ms` | ms, ≥ 1 | 10 | interval between telemetry heartbeats |
//! | `log-ms` | ms, 0 = never | 1000 | interval between human lines on the serial port |
//! | `run-ms` | ms, 0 = forever | 0 | halt the guest after this long |
//! | `fault-after-ms` | ms, 0 = never | 0 | raise #UD at CPL3 after this long (tests the exception path) |
//! | `seed` | integer | 1 | seed of the random and hot/cold patterns |
//! | `fill` | `stamp`, `random`, `mixed` | `stamp` | page content: a stamp word and zeros, every word derived from the stamp, or text-like, code-like and random pages in known shares ([`crate::stamp::mixed_word`]) |
//! | `prefill` | `0`, `1` | `0` | write every working-set page once before the workload starts |
//! | `free` | size | 0 | fill this much RAM beyond the working set with data, then free it (2 MiB blocks), as a guest that used memory once leaves it: stale, free, hintable |
//! | `churn` | MB/s, 0 = none | 0 | keep allocating blocks from the free memory, writing, verifying and freeing them at this rate |
//! | `hint-batch` | blocks, 0 = all | 0 | hint at most this many free blocks per heartbeat, so a round of hints spans many (a slow driver) |
//! | `compute` | vCPU count | 0 | the last N vCPUs compute instead of writing and report work units in their heartbeats (what a vCPU that does not write loses to a migration) |
//! | `virtio_mmio.device` | `<size>@<addr>:<irq>` | none | a virtio-mmio device, as Linux takes it; the key repeats, once per device (at most [`MAX_MMIO_DEVICES`]); the guest reads each one's device ID at boot and drives a balloon (5), a block device (2) and a network device (1) found there |
//! | `disk` | size, a multiple of 4K | 0 | the part of the virtio-blk disk, from sector 0, that the disk workload writes and verifies in 4 KiB blocks; 0 = no disk workload. Larger than the disk (or no disk): the guest says so on its serial port and halts ([`crate::report::HaltReason::DiskTooSmall`]) |
//! | `disk-rate` | `max` or MB/s (10^6 bytes) | 10 | how fast the disk workload accesses blocks ([`DEFAULT_DISK_RATE_MB_S`]) |
//! | `disk-pattern` | `seq`, `random` | `random` | which block each disk write goes to |
//! | `disk-read` | percent, 0–100 | 20 | share of disk accesses that read a written block back and check it instead of writing |
//! | `net` | IPv4 address `A.B.C.D` | none | the guest's address on the virtio-net NIC: it answers ARP for it and echoes the numbered UDP requests sent to it ([`crate::net`]); none = no network workload. No NIC: the guest says so on its serial port and halts ([`crate::report::HaltReason::NoNic`]) |
//! | `net-port` | UDP port, 1–65535 | 7 | the port the guest echoes requests on ([`crate::net::DEFAULT_PORT`]) |
//!
//! The parser is pure and allocation-free: the guest runs it at CPL3 and the host runs it
//! before boot so that a bad command line is refused with a message instead of a halted guest.

use core::fmt;

use crate::net::Ipv4;

/// Share of writes that go to the hot part of the working set under `pattern=hotcold`: the
/// classic 90/10 skew of a database buffer pool, hot enough that precopy must iterate on it.
pub const HOT_WRITE_PERCENT: u64 = 90;

/// Working set when `ws=` is not given: big enough to make a migration iterate, small enough
/// that `ferry run` on the minimum 64 MiB guest still fits (see [`crate::layout`]).
pub const DEFAULT_WORKING_SET: u64 = 256 << 20;

pub use crate::help::HELP;

/// Granule of the guest's free memory: blocks of 2 MiB, the large page it maps RAM with (and
/// what it hints, as Linux hints its largest free blocks).
pub const FREE_BLOCK: u64 = 2 << 20;

/// Most 4 KiB blocks `disk=` may name: a disk block's stamp holds its number in 32 bits
/// ([`crate::disk`]), so 16 TiB.
pub const MAX_DISK_BLOCKS: u64 = 1 << 32;

/// Most `virtio_mmio.device=` keys a command line may hold: a balloon, a disk, and room for a
/// NIC and one more, as the VMM's device plan has them.
pub const MAX_MMIO_DEVICES: usize = 4;

/// `disk-rate=` when not given: 10 MB/s, 2441 requests a second, each a trip to the VMM while
/// the vCPU waits; slow enough that a disk no host shares converges beside a flat-out working
/// set, fast enough that a migration always finds blocks written since they were sent.
pub const DEFAULT_DISK_RATE_MB_S: u32 = 10;

/// A virtio-mmio device as the command line announces it (`virtio_mmio.device=4K@0xd0000000:5`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmioDevice {
    pub size: u64,
    pub addr: u64,
    pub irq: u32,
}

/// Which page each write of the workload goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Pattern {
    /// Page after page, wrapping at the end of the working set.
    Sequential = 1,
    /// Uniformly random pages.
    Random = 2,
    /// [`HOT_WRITE_PERCENT`]% of writes to the first `hot`% of pages, the rest anywhere.
    HotCold = 3,
}

impl Pattern {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Sequential => "seq",
            Pattern::Random => "random",
            Pattern::HotCold => "hotcold",
        }
    }

    /// Inverse of `self as u8`, for decoding telemetry.
    pub fn from_u8(v: u8) -> Option<Pattern> {
        [Pattern::Sequential, Pattern::Random, Pattern::HotCold]
            .into_iter()
            .find(|p| *p as u8 == v)
    }
}

/// How fast the working set is dirtied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rate {
    /// As fast as the vCPU can write.
    FlatOut,
    /// Not at all: the vCPU only reports (and verifies, with `verify-ms`), asleep between.
    Idle,
    /// At most this many megabytes (10^6 bytes) of pages per second.
    MegabytesPerSecond(u32),
}

/// What a written page holds besides its stamp word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Zeros: a page compresses to its stamp.
    Stamp,
    /// Every word derived from the stamp ([`crate::stamp::fill_word`]): incompressible data.
    Random,
    /// Every word derived from the stamp as text-like, code-like or random data, by the page's
    /// frame ([`crate::stamp::mixed_word`]): what compression meets in a real guest.
    Mixed,
}

/// A parsed command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Working-set size in bytes; `None` picks [`crate::layout::default_working_set`].
    pub working_set: Option<u64>,
    pub rate: Rate,
    pub pattern: Pattern,
    pub hot_percent: u8,
    pub zero_percent: u8,
    pub read_percent: u8,
    pub verify_ms: u32,
    pub heartbeat_ms: u32,
    pub log_ms: u32,
    pub run_ms: u32,
    /// The boot vCPU calibrates its TSC against the PIT at boot, then every this many ms
    /// (0 = at boot only).
    pub calibrate_ms: u32,
    /// The boot vCPU sets the RTC to this many seconds since the Unix epoch at boot, before
    /// its first calibration reads it back (0 = leaves it as the VMM gave it).
    pub rtc_set: u64,
    pub fault_after_ms: u32,
    pub seed: u64,
    pub fill: Fill,
    pub prefill: bool,
    /// Bytes of RAM beyond the working set filled and then freed, a multiple of [`FREE_BLOCK`].
    pub free: u64,
    /// Rate of allocate-write-verify-free of free blocks, MB/s (10^6 bytes); 0 = none.
    pub churn_mb_s: u32,
    /// Free blocks the balloon driver hints per heartbeat at most; 0 = a whole round at once.
    pub hint_batch: u32,
    /// The virtio-mmio devices the VMM announced, in command-line order, a device given
    /// twice (the same address) listed once; what each is, the guest learns from its
    /// registers ([`Params::mmio_devices`]).
    pub mmio: [Option<MmioDevice>; MAX_MMIO_DEVICES],
    /// Bytes of the disk the disk workload uses from sector 0, a multiple of
    /// [`crate::PAGE_SIZE`]; 0 = no disk workload.
    pub disk: u64,
    /// How fast the disk workload accesses blocks: flat out or MB/s (never idle).
    pub disk_rate: Rate,
    /// Which block a disk write goes to: `Sequential` or `Random`.
    pub disk_pattern: Pattern,
    /// Share of disk accesses that read a written block back and check it.
    pub disk_read_percent: u8,
    /// The guest's IPv4 address for the network workload (`net=`); `None` = no network workload.
    pub net: Option<Ipv4>,
    /// The UDP port it answers echo requests on.
    pub net_port: u16,
    /// vCPUs the guest starts and runs its workload on.
    pub vcpus: u8,
    /// Every vCPU writes every page of the working set, each its own word (lane) of it, with a
    /// generation record of its own; else each writes whole pages of its own share.
    pub shared: bool,
    /// The vCPU that raises #UD after `fault_after_ms`.
    pub fault_vcpu: u8,
    /// The last this many vCPUs compute instead of writing (`compute=`); the working set is
    /// shared among the others.
    pub compute: u8,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            working_set: None,
            rate: Rate::FlatOut,
            pattern: Pattern::Sequential,
            hot_percent: 10,
            zero_percent: 0,
            read_percent: 0,
            verify_ms: 1000,
            heartbeat_ms: 10,
            log_ms: 1000,
            run_ms: 0,
            calibrate_ms: 0,
            rtc_set: 0,
            fault_after_ms: 0,
            seed: 1,
            fill: Fill::Stamp,
            prefill: false,
            free: 0,
            churn_mb_s: 0,
            hint_batch: 0,
            mmio: [None; MAX_MMIO_DEVICES],
            disk: 0,
            disk_rate: Rate::MegabytesPerSecond(DEFAULT_DISK_RATE_MB_S),
            disk_pattern: Pattern::Random,
            disk_read_percent: 20,
            net: None,
            net_port: crate::net::DEFAULT_PORT,
            vcpus: 1,
            shared: false,
            fault_vcpu: 0,
            compute: 0,
        }
    }
}

/// Why a command line was refused. Every message names the key and what would be accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamError<'a> {
    /// A word that is not `key=value`.
    NotKeyValue(&'a str),
    /// A key the guest does not know.
    UnknownKey(&'a str),
    /// A value that does not parse or is out of range; `expected` says what would.
    BadValue {
        key: &'a str,
        value: &'a str,
        expected: &'static str,
    },
    /// The command line is longer than [`crate::CMDLINE_MAX`].
    TooLong(usize),
}

impl fmt::Display for ParamError<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamError::NotKeyValue(word) => write!(
                f,
                "guest parameter '{word}' is not key=value; write e.g. 'ws=256M rate=max'"
            ),
            ParamError::UnknownKey(key) => {
                write!(f, "unknown guest parameter '{key}'; known keys are:")?;
                for (k, ..) in HELP {
                    write!(f, " {k}")?;
                }
                write!(f, " (see `ferry guest --params`)")
            }
            ParamError::BadValue {
                key,
                value,
                expected,
            } => write!(
                f,
                "bad value '{value}' for guest parameter '{key}': expected {expected}"
            ),
            ParamError::TooLong(len) => write!(
                f,
                "guest command line is {len} bytes, longer than the {} the guest accepts",
                crate::CMDLINE_MAX
            ),
        }
    }
}

/// Parses a command line. Later keys override earlier ones, as on a kernel command line.
pub fn parse(cmdline: &str) -> Result<Params, ParamError<'_>> {
    if cmdline.len() > crate::CMDLINE_MAX {
        return Err(ParamError::TooLong(cmdline.len()));
    }
    let mut p = Params::default();
    for word in cmdline.split_ascii_whitespace() {
        let (key, value) = word.split_once('=').ok_or(ParamError::NotKeyValue(word))?;
        let bad = |expected| ParamError::BadValue {
            key,
            value,
            expected,
        };
        match key {
            "ws" => {
                let size = parse_size(value).filter(|s| *s >= crate::PAGE_SIZE);
                let size = size.ok_or(bad("a size of at least 4K such as 64M or 2G"))?;
                p.working_set = Some(size & !(crate::PAGE_SIZE - 1));
            }
            "rate" => {
                p.rate = match value {
                    "max" => Rate::FlatOut,
                    "idle" => Rate::Idle,
                    v => Rate::MegabytesPerSecond(
                        parse_u32(v)
                            .filter(|r| *r > 0)
                            .ok_or(bad("'max', 'idle' or megabytes per second, at least 1"))?,
                    ),
                }
            }
            "pattern" => {
                p.pattern = match value {
                    "seq" => Pattern::Sequential,
                    "random" => Pattern::Random,
                    "hotcold" => Pattern::HotCold,
                    _ => return Err(bad("seq, random or hotcold")),
                }
            }
            "hot" => p.hot_percent = parse_percent(value, 1).ok_or(bad("a percentage 1-100"))?,
            "zero" => p.zero_percent = parse_percent(value, 0).ok_or(bad("a percentage 0-100"))?,
            "read" => p.read_percent = parse_percent(value, 0).ok_or(bad("a percentage 0-100"))?,
            "verify-ms" => p.verify_ms = parse_u32(value).ok_or(bad("milliseconds, 0 = never"))?,
            "heartbeat-ms" => {
                p.heartbeat_ms = parse_u32(value)
                    .filter(|v| *v > 0)
                    .ok_or(bad("milliseconds, at least 1"))?
            }
            "log-ms" => p.log_ms = parse_u32(value).ok_or(bad("milliseconds, 0 = never"))?,
            "run-ms" => p.run_ms = parse_u32(value).ok_or(bad("milliseconds, 0 = forever"))?,
            "calibrate-ms" => {
                p.calibrate_ms = parse_u32(value).ok_or(bad("milliseconds, 0 = at boot only"))?
            }
            "rtc-set" => {
                p.rtc_set = parse_u64(value).ok_or(bad("seconds since 1970, 0 = leave it"))?
            }
            "fault-after-ms" => {
                p.fault_after_ms = parse_u32(value).ok_or(bad("milliseconds, 0 = never"))?
            }
            "seed" => p.seed = parse_u64(value).ok_or(bad("a non-negative integer"))?,
            "fill" => {
                p.fill = match value {
                    "stamp" => Fill::Stamp,
                    "random" => Fill::Random,
                    "mixed" => Fill::Mixed,
                    _ => return Err(bad("stamp, random or mixed")),
                }
            }
            "prefill" => {
                p.prefill = match value {
                    "0" => false,
                    "1" => true,
                    _ => return Err(bad("0 or 1")),
                }
            }
            "free" => {
                let size = parse_size(value).ok_or(bad("a size such as 6G, 0 = none"))?;
                p.free = size / FREE_BLOCK * FREE_BLOCK;
            }
            "hint-batch" => p.hint_batch = parse_u32(value).ok_or(bad("blocks, 0 = all"))?,
            "churn" => {
                p.churn_mb_s = parse_u32(value).ok_or(bad("megabytes per second, 0 = none"))?
            }
            "vcpus" => {
                p.vcpus = parse_u32(value)
                    .filter(|v| (1..=crate::smp::MAX_VCPUS as u32).contains(v))
                    .ok_or(bad("a vCPU count from 1 to 64"))? as u8
            }
            "shared" => {
                p.shared = match value {
                    "0" => false,
                    "1" => true,
                    _ => return Err(bad("0 or 1")),
                }
            }
            "compute" => {
                p.compute = parse_u32(value)
                    .filter(|v| *v < crate::smp::MAX_VCPUS as u32)
                    .ok_or(bad("a vCPU count from 0 to 63"))? as u8
            }
            "fault-vcpu" => {
                p.fault_vcpu = parse_u32(value)
                    .filter(|v| *v < crate::smp::MAX_VCPUS as u32)
                    .ok_or(bad("a vCPU index from 0 to 63"))? as u8
            }
            "virtio_mmio.device" => {
                let dev = parse_mmio_device(value)
                    .ok_or(bad("<size>@<address>:<irq> such as 4K@0xd0000000:5"))?;
                // The same address again is the same device, given again (later keys win).
                let slot = p
                    .mmio
                    .iter()
                    .position(|d| d.is_none_or(|d| d.addr == dev.addr))
                    .ok_or(bad("at most 4 virtio-mmio devices on one command line"))?;
                p.mmio[slot] = Some(dev);
            }
            "disk" => {
                p.disk = parse_size(value)
                    .filter(|s| {
                        s.is_multiple_of(crate::PAGE_SIZE)
                            && s / crate::PAGE_SIZE <= MAX_DISK_BLOCKS
                    })
                    .ok_or(bad(
                        "a size that is a multiple of 4K, at most 16T, such as 64M or 2G; 0 = none",
                    ))?
            }
            "disk-rate" => {
                p.disk_rate = match value {
                    "max" => Rate::FlatOut,
                    v => Rate::MegabytesPerSecond(
                        parse_u32(v)
                            .filter(|r| *r > 0)
                            .ok_or(bad("'max' or megabytes per second, at least 1"))?,
                    ),
                }
            }
            "disk-pattern" => {
                p.disk_pattern = match value {
                    "seq" => Pattern::Sequential,
                    "random" => Pattern::Random,
                    _ => return Err(bad("seq or random")),
                }
            }
            "disk-read" => {
                p.disk_read_percent = parse_percent(value, 0).ok_or(bad("a percentage 0-100"))?
            }
            "net" => {
                p.net = Some(
                    Ipv4::parse(value)
                        .filter(|ip| ip.is_unicast())
                        .ok_or(bad("a unicast IPv4 address such as 10.0.0.2"))?,
                )
            }
            "net-port" => {
                p.net_port = parse_u32(value)
                    .and_then(|v| u16::try_from(v).ok())
                    .filter(|v| *v > 0)
                    .ok_or(bad("a UDP port from 1 to 65535"))?
            }
            _ => return Err(ParamError::UnknownKey(key)),
        }
    }
    if p.fault_vcpu >= p.vcpus {
        return Err(ParamError::BadValue {
            key: "fault-vcpu",
            value: "(above vcpus)",
            expected: "the index of one of the guest's vCPUs, below vcpus=",
        });
    }
    if p.compute >= p.vcpus {
        return Err(ParamError::BadValue {
            key: "compute",
            value: "(vcpus or more)",
            expected: "fewer than vcpus= (vCPU 0 always writes)",
        });
    }
    if p.shared && p.compute > 0 {
        return Err(ParamError::BadValue {
            key: "compute",
            value: "(with shared=1)",
            expected: "0 with shared=1 (every vCPU writes every page)",
        });
    }
    if p.shared && p.fill != Fill::Stamp {
        return Err(ParamError::BadValue {
            key: "shared",
            value: "1",
            expected: "0 with fill=random or mixed (a shared page holds one word per vCPU)",
        });
    }
    Ok(p)
}

impl Params {
    /// The virtio-mmio devices the command line announced, in its order.
    pub fn mmio_devices(&self) -> impl Iterator<Item = MmioDevice> + '_ {
        self.mmio.iter().flatten().copied()
    }

    /// 4 KiB blocks of the disk workload (`disk=`).
    pub fn disk_blocks(&self) -> u64 {
        self.disk / crate::PAGE_SIZE
    }

    /// vCPUs that write (the rest compute).
    pub fn writers(&self) -> u8 {
        self.vcpus - self.compute
    }

    /// Generation records the guest keeps: one per vCPU when they share pages, else one.
    pub fn records(&self) -> u64 {
        match self.shared {
            true => u64::from(self.vcpus),
            false => 1,
        }
    }
}

/// Parses `<size>@<addr>:<irq>`, the address in hex (`0x...`) or decimal.
pub fn parse_mmio_device(s: &str) -> Option<MmioDevice> {
    let (size, rest) = s.split_once('@')?;
    let (addr, irq) = rest.split_once(':')?;
    let addr = match addr.strip_prefix("0x") {
        Some(hex) if !hex.is_empty() => u64::from_str_radix(hex, 16).ok()?,
        Some(_) => return None,
        None => parse_u64(addr)?,
    };
    Some(MmioDevice {
        size: parse_size(size).filter(|s| *s > 0)?,
        addr,
        irq: parse_u32(irq)?,
    })
}

/// Parses a byte size: a decimal number, whole or with a fraction (`3.5G`), with an optional
/// binary suffix `K`, `M`, `G` or `T` in either case (also written `KiB`, `MiB`, … or `KB`,
/// `MB`, …, all meaning powers of 1024). A fraction of a byte is dropped.
pub fn parse_size(s: &str) -> Option<u64> {
    let digits = s
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    let (number, suffix) = s.split_at(digits);
    let shift = [
        (0, ["", "B", "B"]),
        (10, ["K", "KB", "KiB"]),
        (20, ["M", "MB", "MiB"]),
        (30, ["G", "GB", "GiB"]),
        (40, ["T", "TB", "TiB"]),
    ]
    .iter()
    .find(|(_, names)| names.iter().any(|n| n.eq_ignore_ascii_case(suffix)))?
    .0;
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) if !f.is_empty() && f.len() <= 9 => (w, f),
        Some(_) => return None,
        None => (number, ""),
    };
    let whole = if whole.is_empty() && !fraction.is_empty() {
        0
    } else {
        parse_u64(whole)?
    };
    let bytes = whole.checked_mul(1u64 << shift)?;
    if fraction.is_empty() {
        return Some(bytes);
    }
    let scale = 10u128.pow(fraction.len() as u32);
    let part = u128::from(parse_u64(fraction)?) * (1u128 << shift) / scale;
    bytes.checked_add(u64::try_from(part).ok()?)
}

fn parse_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.bytes().try_fold(0u64, |acc, b| {
        acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

fn parse_u32(s: &str) -> Option<u32> {
    parse_u64(s).and_then(|v| u32::try_from(v).ok())
}

fn parse_percent(s: &str, min: u8) -> Option<u8> {
    parse_u64(s)
        .filter(|v| (u64::from(min)..=100).contains(v))
        .map(|v| v as u8)
}

#[cfg(test)]
mod tests;
