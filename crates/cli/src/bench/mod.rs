//! `ferry bench`: measurements that print a table and one JSON line per row. Every figure is
//! set against a reference measured in the same run, because absolute numbers on shared,
//! nested machines drift.

mod blocktime;
mod blocktime_qemu;
mod channels;
mod clock;
mod clones;
mod compression;
mod dirty_limit;
mod disk;
mod guest;
mod guest_log;
mod hinting;
mod hostile;
mod ingest;
mod link;
mod live_gap;
mod local;
mod net;
mod net_measure;
mod net_qemu;
mod net_segment;
mod net_trace;
mod plane;
mod postcopy;
mod precopy;
mod predict;
mod process;
mod qemu;
mod qemu_disk;
mod qmp;
mod raw_tcp;
mod scale;
mod snapshot;
mod soak;
mod state;
mod vcpus;

use std::process::ExitCode;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The built-in guest's page-write rate at CPL3, against the same loop run on the host.
    Guest(guest::GuestBenchArgs),
    /// Precopy scenarios on the built-in guest, against raw loopback TCP.
    Precopy(precopy::PrecopyBenchArgs),
    /// The prediction against what happened: a matrix of small migrations (idle, filled,
    /// dirtying, flat out, capped), with the default policy and with `--postcopy-auto`; the
    /// errors' medians and 90th percentiles, and capped time against bytes at the cap.
    Predict(predict::PredictBenchArgs),
    /// Zero scan, channel scaling and sparse memory, against memory bandwidth and raw TCP.
    Channels(channels::ChannelsBenchArgs),
    /// Destination ingest: migrations into sparse and preallocated RAM, against raw TCP and
    /// the cost of landing pages in fresh and populated memory.
    Ingest(ingest::IngestBenchArgs),
    /// Compression off, zstd and auto on a guest of mixed content, at a 1 Gbit/s bandwidth
    /// limit and unlimited on loopback, against compression off in the same run.
    Compression(compression::CompressionBenchArgs),
    /// The dirty ring and the per-vCPU dirty limit: a guest with one writing and three
    /// computing vCPUs converged by throttle and by dirty limit over a 1 GB/s limit (what the
    /// computing vCPUs keep of their work), and the ring's sync and total time against the
    /// slot bitmaps'.
    DirtyLimit(dirty_limit::DirtyLimitBenchArgs),
    /// Postcopy with and without the preempt connection, on loopback and a link capped at
    /// 1 GB/s, against the raw 4 KiB request/response round trip on the same link.
    Postcopy(postcopy::PostcopyBenchArgs),
    /// A VM with a disk migrated without the disk, on a shared image and with the disk copied
    /// (`--disk-copy`): time against raw TCP for the same bytes, downtime against no disk, and
    /// the blocks the destination's guest read back.
    Disk(disk::DiskBenchArgs),
    /// Free page hinting on and off: an 8 GiB guest that freed 6 GiB, idle and churning.
    Hinting(hinting::HintingBenchArgs),
    /// The device-state load as vCPUs grow (1, 8, 32, 64), into prepared and unprepared
    /// destinations.
    State(state::StateBenchArgs),
    /// Precopy with every vCPU writing (1, 16, 64 vCPUs in a 64 GiB guest): dirty rate,
    /// longest dirty sync, the guest's longest stall.
    Vcpus(vcpus::VcpusBenchArgs),
    /// One dirtying guest migrated back and forth between two VMM processes, N round trips:
    /// per-hop time, downtime and guest pause; each process's descriptors and memory
    /// (`--follow-events`: each hop followed on `GET /events`, as a control plane does).
    Soak(soak::SoakBenchArgs),
    /// Strangers (garbage, HTTP, TLS, trickled and silent hellos, other migrations) at a
    /// waiting destination and during a migration into it, against the migration alone.
    Hostile(hostile::HostileBenchArgs),
    /// Saves and restores (eager, lazy, with and without the hot set) of an 8 GiB guest
    /// holding 4 GiB of random data, against the file system's write rate and fresh memory's.
    Snapshot(snapshot::SnapshotBenchArgs),
    /// The local handover (`ferry migrate --local`) between two processes at 1 and 64 vCPUs
    /// and 8 and 511 GiB, against the same guest copied over the same Unix socket.
    Local(local::LocalBenchArgs),
    /// An idle guest that touched 256 MiB migrated at 8, 64, 256 and 511 GiB of RAM: what
    /// grows with configured memory (time, setup, steps, CPU, each process's peak memory).
    Scale(scale::ScaleBenchArgs),
    /// A guest answering a stream of numbered frames (10,000/s) moved across two taps on a
    /// bridge, handed over locally on one, and under QEMU across the same taps, in a network
    /// namespace of its own: frames lost (outside the pause window), duplicated, the first
    /// echo and the announce after the resume, against the echo round trip with no move.
    Net(net::NetBenchArgs),
    /// The guest's clocks across migrations, local handovers and restores, 100 of each: the
    /// clock jump against the host's clock (the goal: within 1 ms of 0) beside the pause, and
    /// the guest's own gap on kvmclock and on its TSC.
    Clock(clock::ClockBenchArgs),
}

pub fn bench(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Guest(args) => guest::run(&args),
        BenchCommand::Precopy(args) => precopy::run(&args),
        BenchCommand::Predict(args) => predict::run(&args),
        BenchCommand::Channels(args) => channels::run(&args),
        BenchCommand::Ingest(args) => ingest::run(&args),
        BenchCommand::Compression(args) => compression::run(&args),
        BenchCommand::DirtyLimit(args) => dirty_limit::run(&args),
        BenchCommand::Postcopy(args) => postcopy::run(&args),
        BenchCommand::Hinting(args) => hinting::run(&args),
        BenchCommand::Disk(args) => disk::run(&args),
        BenchCommand::State(args) => state::run(&args),
        BenchCommand::Vcpus(args) => vcpus::run(&args),
        BenchCommand::Soak(args) => soak::run(&args),
        BenchCommand::Scale(args) => scale::run(&args),
        BenchCommand::Snapshot(args) => snapshot::run(&args),
        BenchCommand::Hostile(args) => hostile::run(&args),
        BenchCommand::Local(args) => local::run(&args),
        BenchCommand::Net(args) => net::run(&args),
        BenchCommand::Clock(args) => clock::run(&args),
    }
}
