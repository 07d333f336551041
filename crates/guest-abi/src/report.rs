//! Telemetry reports: what the guest tells the VMM, one fixed-size little-endian record at a
//! time, and the pure encoding both sides use.
//!
//! The guest fills a [`Report`] in its memory and writes the report's guest-physical address
//! to [`crate::TELEMETRY_PORT`] with one 32-bit `out`. The VMM reads [`REPORT_SIZE`] bytes
//! there, checks [`MAGIC`] and [`VERSION`], and timestamps it with the host monotonic clock.
//! Counters are cumulative, so a lost report loses no count, and `seq` shows the loss.

/// "FRRY", little-endian.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FRRY");
/// Layout version; bumped when a field changes meaning. Version 2 gave one byte of version 1's
/// 16-bit version field to the sending vCPU's index.
pub const VERSION: u8 = 2;
/// Encoded size of a report.
pub const REPORT_SIZE: usize = 128;
/// Words of kind-specific detail.
pub const DETAIL_WORDS: usize = 10;
/// Bad frame numbers a verify report lists (the first ones found in the pass).
pub const LISTED_BAD_PAGES: usize = 6;

/// Declares a fieldless enum over an integer type (`pub enum Kind: u16 { .. }` becomes
/// `#[repr(u16)] pub enum Kind { .. }`) and its decoder, `TryFrom<u16>`, from the one list of
/// variants: a variant added is a value decoded. The error is the value no variant has. (The
/// engine's wire enums are declared the same way by `ferry_migrate`'s `wire_enum!`: neither crate
/// depends on the other, and a proc-macro crate such as num_enum would be built with the guest
/// kernel's flags, which a host shared object cannot link with.)
macro_rules! report_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $value:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        $vis enum $name {
            $( $(#[$variant_meta])* $variant = $value, )+
        }

        impl TryFrom<$repr> for $name {
            type Error = $repr;

            fn try_from(value: $repr) -> Result<Self, $repr> {
                match value {
                    $( $value => Ok($name::$variant), )+
                    unknown => Err(unknown),
                }
            }
        }
    };
}

report_enum! {
    /// What a report says. `Invalid = 0` so a zeroed buffer is never mistaken for a report.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind: u16 {
        Invalid = 0,
        /// Once, after the command line was parsed. Detail: [`boot`] words.
        Boot = 1,
        /// Every `heartbeat-ms`. Detail: [`heartbeat`] words.
        Heartbeat = 2,
        /// After every verify pass. Detail: [`verify`] words.
        Verify = 3,
        /// From the CPL0 exception handler, before the guest halts. Detail: [`exception`] words.
        Exception = 4,
        /// Before a deliberate halt. Detail: `[reason as u64, ..]` with a [`HaltReason`].
        Halt = 5,
        /// Once, after Boot: where the working set is. Detail: [`layout`] words.
        Layout = 6,
        /// A computing vCPU's (`compute=`) heartbeat, every `heartbeat-ms`, instead of
        /// [`Kind::Heartbeat`]. Detail: [`work`] words. A kind of its own rather than a word
        /// of the heartbeat's, so that the report's layout (and a VMM or a migration stream
        /// that holds reports of it) stays as it was.
        Work = 7,
        /// The VM generation ID the boot vCPU read (`crate::vmgenid`): once after Layout, then
        /// whenever a look (at every heartbeat) found it changed. Detail: [`vm_generation`]
        /// words. A kind of its own, as `Work`, so that the report's layout stays as it was.
        VmGeneration = 8,
        /// The disk workload's counters (`disk=`), from the boot vCPU every `heartbeat-ms`
        /// after its heartbeat, while a disk workload runs. Detail: [`disk`] words, as
        /// [`DiskCounters::to_detail`] writes them. A kind of its own, as `Work`, so that the
        /// heartbeat's layout stays as it was.
        Disk = 9,
        /// The network workload's counters (`net=`), from the boot vCPU every `heartbeat-ms`
        /// after its heartbeat (and its disk report), while a network workload runs. Detail:
        /// [`net`] words, as [`NetCounters::to_detail`] writes them. A kind of its own, as
        /// `Disk`.
        Net = 10,
        /// The boot vCPU's calibration of its TSC against PIT channel 2: once at boot, then
        /// every `calibrate-ms` when given. Detail: [`clock`] words. A kind of its own, as
        /// `Disk`.
        Clock = 11,
        /// The boot vCPU's longest gap between two looks at its clocks (kvmclock and the TSC)
        /// since the previous such report, after a heartbeat, when there was one (a pause, a
        /// move, a vCPU the host put aside). Detail: [`clock_gap`] words. A kind of its own,
        /// as `Disk`.
        ClockGap = 12,
    }
}

impl Kind {
    /// The kind with value `v`; [`Kind::Invalid`] for a value no kind has.
    pub fn from_u16(v: u16) -> Kind {
        Kind::try_from(v).unwrap_or(Kind::Invalid)
    }
}

report_enum! {
    /// Why the guest halted on purpose.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum HaltReason: u64 {
        Invalid = 0,
        /// `run-ms` elapsed.
        RunTimeElapsed = 1,
        /// The command line did not parse; the serial port has the message.
        BadCommandLine = 2,
        /// The working set does not fit in the RAM the memory map offers.
        NotEnoughMemory = 3,
        /// The PVH start_info was missing, malformed, or had no memory map.
        BadBootInfo = 4,
        /// A Rust panic in the guest; the serial port has the message.
        Panic = 5,
        /// `disk=` asks for more than the VM's virtio-blk disk holds, or the VM has no disk
        /// the driver could use; the serial port says which.
        DiskTooSmall = 6,
        /// `net=` asks for a network workload, and the VM has no virtio-net device the driver
        /// could use; the serial port says why.
        NoNic = 7,
    }
}

impl HaltReason {
    /// The reason with value `v`; [`HaltReason::Invalid`] for a value no reason has.
    pub fn from_u64(v: u64) -> HaltReason {
        HaltReason::try_from(v).unwrap_or(HaltReason::Invalid)
    }

    pub fn describe(self) -> &'static str {
        match self {
            HaltReason::Invalid => "unknown reason",
            HaltReason::RunTimeElapsed => "run-ms elapsed",
            HaltReason::BadCommandLine => "bad command line",
            HaltReason::NotEnoughMemory => "working set does not fit in guest RAM",
            HaltReason::BadBootInfo => "bad PVH boot information",
            HaltReason::Panic => "guest panic",
            HaltReason::DiskTooSmall => {
                "disk= is larger than the VM's virtio-blk disk, or it has none"
            }
            HaltReason::NoNic => "net= is given but the VM has no usable virtio-net device",
        }
    }
}

/// Indices into `detail` for each kind.
pub mod boot {
    pub const RAM_BYTES: usize = 0;
    pub const WS_PAGES: usize = 1;
    /// MB/s, 0 = flat out, [`RATE_IDLE`] = idle.
    pub const RATE: usize = 2;
    /// The rate word of an idle guest (`rate=idle`).
    pub const RATE_IDLE: u64 = u64::MAX;
    pub const PATTERN: usize = 3;
    pub const ZERO_PERCENT: usize = 4;
    pub const VERIFY_MS: usize = 5;
    pub const HEARTBEAT_MS: usize = 6;
    /// 1 = kvmclock, 2 = TSC with a frequency from CPUID, 3 = TSC with a guessed frequency.
    pub const CLOCK: usize = 7;
    pub const HOT_PERCENT: usize = 8;
    /// vCPUs the guest runs its workload on.
    pub const VCPUS: usize = 9;
}

pub mod heartbeat {
    /// Bad pages found by all verify passes so far.
    pub const BAD_PAGES_TOTAL: usize = 0;
    /// The longest batch of page accesses since the previous heartbeat (ns): a guest that waits
    /// for memory (postcopy, a pause) sees it here, measured inside the guest.
    pub const MAX_BATCH_NS: usize = 1;
    /// Batches of page writes that took longer than [`SLOW_BATCH_NS`] so far.
    pub const SLOW_BATCHES: usize = 2;
    /// Their total time (ns) so far.
    pub const SLOW_BATCH_TIME_NS: usize = 3;
    /// Pages read and checked so far (`read=`).
    pub const PAGES_READ: usize = 4;
    /// Reads that found a page not holding its last write, so far.
    pub const BAD_READS: usize = 5;
    /// Free memory (`free=`) and the balloon: hint rounds answered (high 32 bits) and 2 MiB
    /// blocks hinted over all of them (low 32).
    pub const HINTS: usize = 6;
    /// Blocks held after hinting until the host's `DONE` (low 32 bits) and blocks given to the
    /// host by inflating (high 32).
    pub const HELD_BALLOONED: usize = 7;
    /// Blocks free now (low 32 bits) and in use by the churn workload (high 32).
    pub const FREE_USED: usize = 8;
    /// Blocks the churn workload wrote, verified and freed so far.
    pub const CHURNED: usize = 9;
    /// What makes a batch slow: a batch of writes takes ~0.1–0.3 ms when memory is there.
    pub const SLOW_BATCH_NS: u64 = 1_000_000;
}

pub mod work {
    /// Work units so far: each is the same fixed run of arithmetic in registers, so units per
    /// second are what the vCPU got of a CPU.
    pub const UNITS: usize = 0;
}

pub mod vm_generation {
    /// The ID's bytes 0..8 and 8..16, each little-endian (`GenerationId::to_detail`); all
    /// ones when the VM has no such device.
    pub const ID_LOW: usize = 0;
    pub const ID_HIGH: usize = 1;
    /// Changes the guest has seen since it booted: 0 in the first report, one more in each
    /// that follows (a look that found the ID different from the look before).
    pub const CHANGES: usize = 2;
}

pub mod disk {
    /// Blocks written so far.
    pub const BLOCKS_WRITTEN: usize = 0;
    /// Blocks read back and checked so far (`disk-read=` reads and verify sweeps).
    pub const BLOCKS_READ: usize = 1;
    /// Blocks read back that did not hold their last write (stale, misplaced, zero or
    /// corrupt), so far.
    pub const VERIFY_FAILURES: usize = 2;
    /// Requests the device answered with a status other than OK, or did not answer, so far.
    pub const REQUEST_ERRORS: usize = 3;
    /// Flush requests completed so far.
    pub const FLUSHES: usize = 4;
    /// The first block found bad; [`NO_BAD_BLOCK`] while there is none.
    pub const FIRST_BAD: usize = 5;
    /// Blocks the workload uses (`disk=` / 4 KiB).
    pub const BLOCKS: usize = 6;
    /// Verify sweeps completed: each re-read every block written before it reached it.
    pub const SWEEPS: usize = 7;
    /// The [`FIRST_BAD`] word of a disk with no bad block.
    pub const NO_BAD_BLOCK: u64 = u64::MAX;
}

/// The disk workload's cumulative counters, as a [`Kind::Disk`] report carries them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounters {
    pub blocks_written: u64,
    pub blocks_read: u64,
    pub verify_failures: u64,
    pub request_errors: u64,
    pub flushes: u64,
    pub first_bad_block: Option<u64>,
    pub blocks: u64,
    pub sweeps: u64,
}

impl DiskCounters {
    /// The report's detail words ([`disk`]).
    pub fn to_detail(&self) -> [u64; DETAIL_WORDS] {
        let mut d = [0; DETAIL_WORDS];
        d[disk::BLOCKS_WRITTEN] = self.blocks_written;
        d[disk::BLOCKS_READ] = self.blocks_read;
        d[disk::VERIFY_FAILURES] = self.verify_failures;
        d[disk::REQUEST_ERRORS] = self.request_errors;
        d[disk::FLUSHES] = self.flushes;
        d[disk::FIRST_BAD] = self.first_bad_block.unwrap_or(disk::NO_BAD_BLOCK);
        d[disk::BLOCKS] = self.blocks;
        d[disk::SWEEPS] = self.sweeps;
        d
    }

    pub fn from_detail(d: &[u64; DETAIL_WORDS]) -> DiskCounters {
        DiskCounters {
            blocks_written: d[disk::BLOCKS_WRITTEN],
            blocks_read: d[disk::BLOCKS_READ],
            verify_failures: d[disk::VERIFY_FAILURES],
            request_errors: d[disk::REQUEST_ERRORS],
            flushes: d[disk::FLUSHES],
            first_bad_block: Some(d[disk::FIRST_BAD]).filter(|b| *b != disk::NO_BAD_BLOCK),
            blocks: d[disk::BLOCKS],
            sweeps: d[disk::SWEEPS],
        }
    }
}

pub mod clock {
    /// The TSC's frequency measured against the PIT (Hz); 0 when the calibration failed.
    pub const TSC_CALIBRATED_HZ: usize = 0;
    /// The PIT ticks the window lasted (the count loaded on channel 2).
    pub const PIT_TICKS: usize = 1;
    /// The TSC ticks counted over the window.
    pub const TSC_TICKS: usize = 2;
    /// How the calibration ended: one of [`OUTCOME_OK`] and the failures below.
    pub const OUTCOME: usize = 3;
    /// Calibrations the guest made so far, this one included.
    pub const CALIBRATIONS: usize = 4;
    /// How far the TSC ticks may be off, in parts per million: half the spans of TSC readings
    /// the window's two edges fell in.
    pub const UNCERTAINTY_PPM: usize = 5;
    /// Windows timed for this calibration (the best one reported).
    pub const WINDOWS: usize = 6;
    /// Channel 2's output rose when the count had elapsed: the figure is good.
    pub const OUTCOME_OK: u64 = 1;
    /// The output was already high right after the count was loaded: no PIT or no port 0x61
    /// (an unassigned port reads all-ones).
    pub const OUTCOME_HIGH_AT_LOAD: u64 = 2;
    /// The output never rose within the bound: a port 0x61 without a PIT behind it.
    pub const OUTCOME_NEVER_ROSE: u64 = 3;
    /// The RTC's register B as the guest read it with the time (its format: BCD or binary,
    /// 12- or 24-hour); 0 with [`RTC_UNIX_SECONDS`] 0.
    pub const RTC_REGISTER_B: usize = 8;
    /// The RTC's time of day as the guest read it (ports 0x70-0x71, `crate::rtc`) just before
    /// sending the report, as seconds since the Unix epoch; 0 when no RTC answered (its
    /// update-in-progress bit never cleared, or its time kept changing under the reads).
    pub const RTC_UNIX_SECONDS: usize = 9;
}

pub mod clock_gap {
    /// The gap on kvmclock (ns): its length as the guest's clock saw it; across a move, the
    /// pause (the clocks advance by it) plus the loop's turn it fell in.
    pub const KVMCLOCK_NS: usize = 0;
    /// The same gap on the TSC, made ns with the guest's calibration against the PIT; 0 when
    /// the guest has none. Within the calibration's error of `KVMCLOCK_NS`: the TSC agrees.
    pub const TSC_NS: usize = 1;
    /// The TSC ticks it lasted.
    pub const TSC_TICKS: usize = 2;
    /// kvmclock when it ended.
    pub const ENDED_NS: usize = 3;
    /// Gaps past the threshold seen so far.
    pub const GAPS: usize = 4;
    /// Looks that found kvmclock or the TSC behind the look before, so far (each also a verify
    /// failure): a clock that went back.
    pub const BACKWARDS: usize = 5;
    /// What makes a gap (ns): longer than the workload loop leaves between two looks.
    pub const THRESHOLD_NS: usize = 6;
}

pub mod net {
    /// Frames taken from the receive queue so far, whatever they held.
    pub const FRAMES_RECEIVED: usize = 0;
    /// Echoes sent so far, one per echo request ([`crate::net`]).
    pub const ECHOES_SENT: usize = 1;
    /// ARP replies sent so far, one per request for the guest's address.
    pub const ARP_REPLIES: usize = 2;
    /// Sequence numbers skipped so far: a request whose number is past the last one seen + 1
    /// adds the numbers in between (frames lost before the guest, or still to come reordered).
    pub const SEQ_GAPS: usize = 3;
    /// Requests whose number was at or below the last one seen (a frame given twice, or late),
    /// so far; each is still answered.
    pub const DUPLICATES: usize = 4;
    /// Frames that were not for the guest (another MAC, address or port; another protocol) or
    /// were malformed (a bad checksum, a short frame), so far.
    pub const IGNORED: usize = 5;
    /// Frames the guest could not send because the device held every transmit buffer (it had
    /// not returned them), so far.
    pub const TX_ERRORS: usize = 6;
    /// The highest request number seen; 0 before the first request.
    pub const LAST_SEQ: usize = 7;
}

/// The network workload's cumulative counters, as a [`Kind::Net`] report carries them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub frames_received: u64,
    pub echoes_sent: u64,
    pub arp_replies: u64,
    pub seq_gaps: u64,
    pub duplicates: u64,
    pub ignored: u64,
    pub tx_errors: u64,
    pub last_seq: u64,
}

impl NetCounters {
    /// The report's detail words ([`net`]).
    pub fn to_detail(&self) -> [u64; DETAIL_WORDS] {
        let mut d = [0; DETAIL_WORDS];
        d[net::FRAMES_RECEIVED] = self.frames_received;
        d[net::ECHOES_SENT] = self.echoes_sent;
        d[net::ARP_REPLIES] = self.arp_replies;
        d[net::SEQ_GAPS] = self.seq_gaps;
        d[net::DUPLICATES] = self.duplicates;
        d[net::IGNORED] = self.ignored;
        d[net::TX_ERRORS] = self.tx_errors;
        d[net::LAST_SEQ] = self.last_seq;
        d
    }

    pub fn from_detail(d: &[u64; DETAIL_WORDS]) -> NetCounters {
        NetCounters {
            frames_received: d[net::FRAMES_RECEIVED],
            echoes_sent: d[net::ECHOES_SENT],
            arp_replies: d[net::ARP_REPLIES],
            seq_gaps: d[net::SEQ_GAPS],
            duplicates: d[net::DUPLICATES],
            ignored: d[net::IGNORED],
            tx_errors: d[net::TX_ERRORS],
            last_seq: d[net::LAST_SEQ],
        }
    }

    /// Counts request `seq` against the last one seen: a jump past the next number adds the
    /// numbers skipped to the gaps, a number at or below the last is a duplicate (the last
    /// stays). The caller answers every request either way.
    pub fn count_request(&mut self, seq: u64) {
        match seq.checked_sub(self.last_seq) {
            Some(0) | None => self.duplicates += 1,
            Some(ahead) => {
                self.seq_gaps += ahead - 1;
                self.last_seq = seq;
            }
        }
    }
}

pub mod verify {
    pub const PASS: usize = 0;
    pub const BAD_PAGES: usize = 1;
    pub const DURATION_NS: usize = 2;
    pub const LISTED: usize = 3;
    /// First of [`super::LISTED_BAD_PAGES`] frame numbers.
    pub const FIRST_BAD: usize = 4;
}

pub mod exception {
    pub const VECTOR: usize = 0;
    pub const ERROR_CODE: usize = 1;
    pub const RIP: usize = 2;
    pub const CR2: usize = 3;
    pub const CS: usize = 4;
}

pub mod layout {
    /// Number of extents that follow, at most [`crate::layout::MAX_EXTENTS`].
    pub const EXTENTS: usize = 0;
    /// Extent i is `(detail[FIRST + 2i], detail[FIRST + 2i + 1])` = (first frame, pages).
    pub const FIRST: usize = 1;
    /// Guest-physical address of the generation record.
    pub const RECORD: usize = 9;
}

/// One telemetry record. Counters are the sending vCPU's totals since boot: each vCPU reports
/// on its own share of the working set, numbering its reports in a sequence of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub kind: u16,
    /// The vCPU that sent it (its local APIC id, 0 = the boot vCPU).
    pub vcpu: u8,
    pub seq: u64,
    /// The guest's own clock (kvmclock), ns since its boot.
    pub guest_ns: u64,
    pub pages_written: u64,
    pub verify_passes: u64,
    /// Verify passes that found at least one bad page.
    pub verify_failures: u64,
    pub detail: [u64; DETAIL_WORDS],
}

/// Why bytes are not a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    BadMagic(u32),
    UnsupportedVersion(u8),
    UnknownKind(u16),
    /// A vCPU index no VM has (at least `smp::MAX_VCPUS`).
    BadVcpu(u8),
}

impl Report {
    /// Encodes as `magic:u32 version:u8 vcpu:u8 kind:u16 seq guest_ns pages_written
    /// verify_passes verify_failures detail[10]`, all little-endian, 128 bytes.
    pub fn to_bytes(&self) -> [u8; REPORT_SIZE] {
        let mut b = [0u8; REPORT_SIZE];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.vcpu;
        b[6..8].copy_from_slice(&self.kind.to_le_bytes());
        let words = [
            self.seq,
            self.guest_ns,
            self.pages_written,
            self.verify_passes,
            self.verify_failures,
        ];
        for (i, w) in words.iter().chain(self.detail.iter()).enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// Decodes and checks magic, version and kind.
    pub fn from_bytes(b: &[u8; REPORT_SIZE]) -> Result<Report, DecodeError> {
        let word = |i: usize| u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().unwrap());
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        let version = b[4];
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let kind = u16::from_le_bytes([b[6], b[7]]);
        if Kind::from_u16(kind) == Kind::Invalid {
            return Err(DecodeError::UnknownKind(kind));
        }
        let mut detail = [0u64; DETAIL_WORDS];
        for (i, d) in detail.iter_mut().enumerate() {
            *d = word(5 + i);
        }
        Ok(Report {
            kind,
            vcpu: b[5],
            seq: word(0),
            guest_ns: word(1),
            pages_written: word(2),
            verify_passes: word(3),
            verify_failures: word(4),
            detail,
        })
    }

    pub fn kind(&self) -> Kind {
        Kind::from_u16(self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let r = Report {
            kind: Kind::Verify as u16,
            vcpu: 7,
            seq: 9,
            guest_ns: 123_456_789,
            pages_written: u64::MAX,
            verify_passes: 3,
            verify_failures: 1,
            detail: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        };
        assert_eq!(Report::from_bytes(&r.to_bytes()), Ok(r));
    }

    #[test]
    fn layout_is_fixed() {
        let r = Report {
            kind: Kind::Heartbeat as u16,
            vcpu: 3,
            seq: 0x0102,
            ..Report::default()
        };
        let b = r.to_bytes();
        assert_eq!(&b[0..4], b"FRRY");
        assert_eq!(&b[4..8], &[2, 3, 2, 0]);
        assert_eq!(&b[8..10], &[2, 1]);
        assert_eq!(b.len(), 8 + 8 * (5 + DETAIL_WORDS));
    }

    #[test]
    fn a_vm_generation_report_round_trips_and_its_kind_is_its_own() {
        let id = crate::vmgenid::GenerationId([7; crate::vmgenid::SIZE]);
        let mut detail = [0; DETAIL_WORDS];
        [
            detail[vm_generation::ID_LOW],
            detail[vm_generation::ID_HIGH],
        ] = id.to_detail();
        detail[vm_generation::CHANGES] = 2;
        let r = Report {
            kind: Kind::VmGeneration as u16,
            detail,
            ..Report::default()
        };
        let b = r.to_bytes();
        assert_eq!(&b[6..8], &[8, 0], "kind 8");
        let back = Report::from_bytes(&b).unwrap();
        assert_eq!(back.kind(), Kind::VmGeneration);
        let d = back.detail;
        assert_eq!(
            crate::vmgenid::GenerationId::from_detail([
                d[vm_generation::ID_LOW],
                d[vm_generation::ID_HIGH]
            ]),
            id
        );
        assert_eq!(d[vm_generation::CHANGES], 2);
        assert_eq!(Kind::from_u16(11), Kind::Clock);
        assert_eq!(Kind::from_u16(12), Kind::ClockGap);
        assert_eq!(Kind::from_u16(13), Kind::Invalid, "no kind past the last");
    }

    #[test]
    fn a_disk_report_round_trips_its_counters() {
        for first_bad_block in [None, Some(0), Some(12_345)] {
            let c = DiskCounters {
                blocks_written: 1000,
                blocks_read: 200,
                verify_failures: 3,
                request_errors: 1,
                flushes: 17,
                first_bad_block,
                blocks: 16_384,
                sweeps: 2,
            };
            let r = Report {
                kind: Kind::Disk as u16,
                detail: c.to_detail(),
                ..Report::default()
            };
            let b = r.to_bytes();
            assert_eq!(&b[6..8], &[9, 0], "kind 9");
            let back = Report::from_bytes(&b).unwrap();
            assert_eq!(back.kind(), Kind::Disk);
            assert_eq!(DiskCounters::from_detail(&back.detail), c);
        }
        let d = DiskCounters::default().to_detail();
        assert_eq!(d[disk::FIRST_BAD], u64::MAX, "no bad block");
        assert_eq!(HaltReason::from_u64(6), HaltReason::DiskTooSmall);
    }

    #[test]
    fn a_net_report_round_trips_its_counters() {
        let c = NetCounters {
            frames_received: 10_005,
            echoes_sent: 10_000,
            arp_replies: 3,
            seq_gaps: 7,
            duplicates: 1,
            ignored: 2,
            tx_errors: 4,
            last_seq: 10_007,
        };
        let r = Report {
            kind: Kind::Net as u16,
            detail: c.to_detail(),
            ..Report::default()
        };
        let b = r.to_bytes();
        assert_eq!(&b[6..8], &[10, 0], "kind 10");
        let back = Report::from_bytes(&b).unwrap();
        assert_eq!(back.kind(), Kind::Net);
        assert_eq!(NetCounters::from_detail(&back.detail), c);
        assert_eq!(back.detail[net::LAST_SEQ], 10_007);
        assert_eq!(HaltReason::from_u64(7), HaltReason::NoNic);
    }

    #[test]
    fn requests_count_gaps_and_duplicates_against_the_last_seen() {
        // (seq, gaps, duplicates, last) after each request, from a fresh count.
        let table = [
            (1, 0, 0, 1),
            (2, 0, 0, 2),
            (5, 2, 0, 5),
            (5, 2, 1, 5),
            (3, 2, 2, 5),
            (6, 2, 2, 6),
            (0, 2, 3, 6),
            (106, 101, 3, 106),
        ];
        let mut c = NetCounters::default();
        for (seq, gaps, dups, last) in table {
            c.count_request(seq);
            assert_eq!(
                (c.seq_gaps, c.duplicates, c.last_seq),
                (gaps, dups, last),
                "{seq}"
            );
        }
        let mut late_start = NetCounters::default();
        late_start.count_request(4);
        assert_eq!(late_start.seq_gaps, 3, "1 to 3 were never seen");
    }

    #[test]
    fn zeroed_and_foreign_buffers_are_refused() {
        assert_eq!(
            Report::from_bytes(&[0; REPORT_SIZE]),
            Err(DecodeError::BadMagic(0))
        );
        let mut b = Report::default().to_bytes();
        assert_eq!(Report::from_bytes(&b), Err(DecodeError::UnknownKind(0)));
        b[4] = 1;
        assert_eq!(
            Report::from_bytes(&b),
            Err(DecodeError::UnsupportedVersion(1))
        );
    }
}
