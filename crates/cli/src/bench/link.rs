//! A link capped at 1 GB/s for the benchmarks: a veth pair into a network namespace of its own,
//! with `tc tbf` on both ends; a listener made inside the namespace makes every connection to
//! it cross the link while both VMs stay in the bench's process. Needs root (`ip netns`, `tc`).

use std::net::TcpListener;
use std::process::Command;

use anyhow::{Context, bail};

/// The capped link's usual rate: 1 GB/s.
pub(super) const LINK_RATE: &str = "8gbit";
/// [`LINK_RATE`] in bytes per second.
pub(super) const LINK_BYTES_PER_S: f64 = 1e9;

/// A veth pair into a network namespace of its own, both ends shaped to a rate (usually
/// [`LINK_RATE`]) with `tc tbf`. Removed on drop.
pub(super) struct CappedLink {
    netns: String,
    /// The address of the namespace's end.
    remote: String,
}

/// The queue under a link's cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Queue {
    /// One queue: packets leave in the order they came.
    Fifo,
    /// Priority bands (under the `tbf`, as deep in all as the plain link's queue), so that
    /// urgent packets (`SO_PRIORITY` 6) leave before the bulk ones queued earlier.
    Bands,
}

impl CappedLink {
    /// A link capped at [`LINK_RATE`] over `queue`.
    pub(super) fn new(queue: Queue) -> anyhow::Result<CappedLink> {
        Self::with_rate(LINK_RATE, queue)
    }

    /// A link capped at `rate` (tc's notation: `8gbit`, `2gbit`) over `queue`.
    pub(super) fn with_rate(rate: &str, queue: Queue) -> anyhow::Result<CappedLink> {
        // Distinct per link made by this process: a deleted namespace's veth goes away
        // asynchronously, so a new link must not reuse the last one's names.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
        let id = std::process::id() % 10_000 * 10 + made;
        let netns = format!("ferry-bench-{id}");
        let (here, there) = (format!("fbh{id}"), format!("fbt{id}"));
        let net = format!("10.253.{}", 70 + made);
        // A namespace of this name left by a run that was killed goes first.
        let _ = sh(&["ip", "netns", "del", &netns]);
        let link = CappedLink {
            netns: netns.clone(),
            remote: format!("{net}.2"),
        };
        // A half-made link is removed by `link`'s drop if a step fails.
        sh(&["ip", "netns", "add", &netns])?;
        sh(&[
            "ip", "link", "add", &here, "type", "veth", "peer", "name", &there, "netns", &netns,
        ])?;
        sh(&["ip", "addr", "add", &format!("{net}.1/30"), "dev", &here])?;
        sh(&["ip", "link", "set", &here, "up"])?;
        let inside = |args: &[&str]| {
            let mut v = vec!["ip", "netns", "exec", netns.as_str()];
            v.extend_from_slice(args);
            sh(&v)
        };
        inside(&["ip", "addr", "add", &format!("{net}.2/30"), "dev", &there])?;
        inside(&["ip", "link", "set", &there, "up"])?;
        inside(&["ip", "link", "set", "lo", "up"])?;
        // burst: at least a timer tick of the fastest rate (1 GB/s / 1000 Hz = 1 MB); latency
        // bounds the queue to 2 ms of the rate.
        let tbf = [
            "root", "handle", "1:", "tbf", "rate", rate, "burst", "2mb", "latency", "2ms",
        ];
        // The bands: pfifo_fast (the `prio` qdisc is not in every kernel; pfifo_fast is, and its
        // priomap sends priority 6 to band 0, priority 0 to band 1). It holds the device's
        // txqueuelen in packets: 64 of up to 64 KiB (GSO) is the 4 MB tbf's own queue holds
        // (rate × latency + burst).
        let bands = ["parent", "1:1", "handle", "10:", "pfifo_fast"];
        for (dev, ns) in [(&here, false), (&there, true)] {
            let mut cmds: Vec<Vec<&str>> =
                vec![[&["tc", "qdisc", "add", "dev", dev], &tbf[..]].concat()];
            if queue == Queue::Bands {
                cmds.push([&["tc", "qdisc", "add", "dev", dev], &bands[..]].concat());
                cmds.push(vec!["ip", "link", "set", "dev", dev, "txqueuelen", "64"]);
            }
            for c in cmds {
                if ns { inside(&c)? } else { sh(&c)? }
            }
        }
        Ok(link)
    }

    /// A listener on the namespace's end of the link: made by a thread that entered the
    /// namespace (a socket stays in the namespace it was made in, whichever thread uses it).
    pub(super) fn listener(&self) -> anyhow::Result<TcpListener> {
        let path = format!("/var/run/netns/{}", self.netns);
        let addr = format!("{}:0", self.remote);
        std::thread::spawn(move || -> anyhow::Result<TcpListener> {
            let ns = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
            // This thread only, and it ends right after making the socket.
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering {path}"))?;
            Ok(TcpListener::bind(&addr)?)
        })
        .join()
        .expect("the namespace thread")
    }
}

impl Drop for CappedLink {
    fn drop(&mut self) {
        // Deleting the namespace removes its veth end, and with it the pair.
        let _ = sh(&["ip", "netns", "del", &self.netns]);
    }
}

/// Runs a command; fails with its stderr.
fn sh(argv: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .with_context(|| format!("running {}", argv[0]))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
