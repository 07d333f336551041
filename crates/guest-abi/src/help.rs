//! `ferry guest --params`' table: every key of the guest's command line (`params.rs`).

/// Every key the guest understands with its value, default and meaning, in the order the
/// table above lists them (what `ferry guest --params` prints).
pub const HELP: &[(&str, &str, &str, &str)] = &[
    (
        "ws",
        "size (64M, 1G, ...)",
        "256M or half the free RAM",
        "working-set size",
    ),
    (
        "rate",
        "max | idle | MB/s",
        "max",
        "how fast each vCPU dirties the working set, verify passes included (idle: not at all, after prefill=)",
    ),
    (
        "pattern",
        "seq | random | hotcold",
        "seq",
        "which page each write goes to",
    ),
    (
        "hot",
        "percent 1-100",
        "10",
        "hot share of the working set for hotcold (90% of writes)",
    ),
    (
        "zero",
        "percent 0-100",
        "0",
        "share of writes that leave the page all zeros",
    ),
    (
        "read",
        "percent 0-100",
        "0",
        "share of accesses that read and check a page instead of writing it",
    ),
    (
        "verify-ms",
        "ms, 0 = never",
        "1000",
        "interval between verify passes",
    ),
    (
        "heartbeat-ms",
        "ms, >= 1",
        "10",
        "interval between telemetry heartbeats",
    ),
    (
        "log-ms",
        "ms, 0 = never",
        "1000",
        "interval between human lines on the serial port",
    ),
    (
        "run-ms",
        "ms, 0 = forever",
        "0",
        "halt the guest after this long",
    ),
    (
        "fault-after-ms",
        "ms, 0 = never",
        "0",
        "raise #UD after this long (tests the exception path)",
    ),
    (
        "seed",
        "integer",
        "1",
        "seed of the random and hotcold patterns",
    ),
    (
        "fill",
        "stamp | random | mixed",
        "stamp",
        "page content: stamp word + zeros, all words derived from the stamp, or 50% text-like, 30% code-like and 20% random pages",
    ),
    (
        "prefill",
        "0 | 1",
        "0",
        "write every working-set page once before the workload starts",
    ),
    (
        "free",
        "size (6G, ...)",
        "0",
        "fill this much more RAM with data, then free it (stale, free, hintable)",
    ),
    (
        "churn",
        "MB/s, 0 = none",
        "0",
        "allocate, write, verify and free blocks of the free memory at this rate",
    ),
    (
        "hint-batch",
        "blocks, 0 = all",
        "0",
        "hint at most this many free blocks per heartbeat (a slow driver)",
    ),
    (
        "vcpus",
        "1-64",
        "1",
        "vCPUs to start, each dirtying its own share of the working set (the VMM sets it)",
    ),
    (
        "shared",
        "0 | 1",
        "0",
        "every vCPU writes the whole working set, each its own word of a page (not with fill=random or mixed)",
    ),
    (
        "compute",
        "vCPU count",
        "0",
        "the last N vCPUs compute instead of writing (registers only) and report work units per heartbeat",
    ),
    (
        "fault-vcpu",
        "vCPU index",
        "0",
        "the vCPU that raises #UD for fault-after-ms",
    ),
    (
        "virtio_mmio.device",
        "<size>@<addr>:<irq>",
        "none",
        "a virtio-mmio device (the VMM sets it), repeated per device, at most 4; the guest drives a balloon, a virtio-blk disk and a virtio-net NIC found there",
    ),
    (
        "disk",
        "size, multiple of 4K",
        "0",
        "the part of the virtio-blk disk (from sector 0) the disk workload writes and verifies, 0 = none; larger than the disk halts the guest",
    ),
    (
        "disk-rate",
        "max | MB/s",
        "10",
        "how fast the disk workload accesses 4 KiB blocks",
    ),
    (
        "disk-pattern",
        "seq | random",
        "random",
        "which block each disk write goes to",
    ),
    (
        "disk-read",
        "percent 0-100",
        "20",
        "share of disk accesses that read a written block back and check it instead of writing",
    ),
    (
        "net",
        "IPv4 address A.B.C.D",
        "none",
        "the guest's address on its virtio-net NIC: it answers ARP and echoes numbered UDP requests; none = no network workload; no NIC halts the guest",
    ),
    (
        "net-port",
        "UDP port 1-65535",
        "7",
        "the UDP port the network workload echoes requests on",
    ),
];
