//! The host's hugetlbfs pool, raised for a while: what tests and benchmarks of huge-page
//! guests reserve before they boot one.

#![forbid(unsafe_code)]

/// The host's hugetlbfs pool raised by some 2 MiB pages for as long as this lives (tests and
/// benchmarks that run huge-page guests; needs root). Dropping it puts the pool back.
#[derive(Debug)]
pub struct HugePagePool {
    before: u64,
}

impl HugePagePool {
    const POOL: &str = "/proc/sys/vm/nr_hugepages";
    /// Writing 1 here compacts all of the host's memory, making 2 MiB blocks of free pages.
    const COMPACT: &str = "/proc/sys/vm/compact_memory";

    /// Raises the pool by `pages`, compacting the host's memory when it is too fragmented to
    /// give them at once; fails, with the pool as it was, if the host still cannot.
    pub fn reserve_more(pages: u64) -> std::io::Result<HugePagePool> {
        let read = || -> std::io::Result<u64> {
            std::fs::read_to_string(Self::POOL)?
                .trim()
                .parse()
                .map_err(std::io::Error::other)
        };
        let before = read()?;
        std::fs::write(Self::POOL, (before + pages).to_string()).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("raising {} by {pages} (run as root): {e}", Self::POOL),
            )
        })?;
        let pool = HugePagePool { before };
        let mut got = read()?;
        // A host whose free memory is fragmented finds fewer 2 MiB blocks than it has free
        // memory: compact it and ask again (the kernel keeps what it found).
        for _ in 0..3 {
            if got >= before + pages {
                break;
            }
            let _ = std::fs::write(Self::COMPACT, "1");
            std::fs::write(Self::POOL, (before + pages).to_string())?;
            got = read()?;
        }
        if got < before + pages {
            return Err(std::io::Error::other(format!(
                "the host gave {} of the {pages} huge pages asked for (memory too fragmented?)",
                got - before
            )));
        }
        Ok(pool)
    }
}

impl Drop for HugePagePool {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::POOL, self.before.to_string());
    }
}
