//! `ferry run --restore FILE`: the VM made from a snapshot, its `--disk` checked against the
//! image the snapshot recorded (`ferry_vmm::snapshot::image`), and a lazy restore's follower;
//! `--map` maps its RAM instead (`ferry_vmm::memory::mapped`).

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use ferry_migrate::MigrateError;
use ferry_migrate::snapshot::Loading;
use ferry_vmm::snapshot::ChangedImage;
use ferry_vmm::{StopReason, Vm, VmConfig};

/// How to restore, from `ferry run`'s flags.
#[derive(Clone, Copy, Debug)]
pub struct How {
    /// Eager by default; `--lazy`: the guest runs once its state is loaded, RAM follows;
    /// `--map`: RAM is the file's, mapped copy-on-write.
    pub loading: Loading,
    /// Load the snapshot's hot set first (`--no-hot-set` turns it off).
    pub hot_first: bool,
    /// `--disk-changed-ok`.
    pub changed_image: ChangedImage,
}

/// Makes a VM of the snapshot's size and devices (the rest of `config`: serial, guest kind)
/// and restores `file` into it; a lazy restore's background load is followed by a thread that
/// says when all of RAM is in place, or stops the guest if a page could not be read.
pub fn restore(config: &VmConfig, file: &Path, how: &How) -> anyhow::Result<Vm> {
    let what = ferry_vmm::snapshot::describe(file).context("cannot restore the snapshot")?;
    what.check_net(file, config.net.is_some())
        .map_err(anyhow::Error::msg)?;
    let disk = config.disk.as_ref().map(|d| d.path.as_path());
    for note in what.check_disk(file, disk, how.changed_image)? {
        eprintln!("ferry: {note}");
    }
    let config = what.config(config);
    let loading = how.loading;
    let (vm, restored) = ferry_vmm::snapshot::restore(config, file, loading, how.hot_first)
        .context("cannot restore the snapshot")?;
    let s = &restored.stats;
    match loading {
        Loading::Eager => eprintln!(
            "ferry: restored {}: {} MiB of data read in {:.0} ms ({:.0} MB/s), state loaded in {:.1} ms; the guest runs {:.0} ms after the start",
            file.display(),
            s.bytes_read >> 20,
            s.ram_ms,
            s.bytes_read as f64 / 1e3 / s.ram_ms.max(1e-3),
            s.state_load_ms,
            s.to_running_ms
        ),
        Loading::Mapped => eprintln!(
            "ferry: restored {} mapped: {:.1} ms to map its RAM, state loaded in {:.1} ms; the guest runs {:.1} ms after the start, its pages read from the file as it touches them",
            file.display(),
            s.ram_ms,
            s.state_load_ms,
            s.to_running_ms
        ),
        Loading::Lazy => eprintln!(
            "ferry: restoring {} lazily: state loaded in {:.1} ms, the guest runs {:.1} ms after the start; its RAM loads in the background",
            file.display(),
            s.state_load_ms,
            s.to_running_ms
        ),
    }
    if let Some(load) = restored.lazy {
        let handle = vm.handle();
        std::thread::Builder::new()
            .name("restore-wait".into())
            .spawn(move || {
                let stop = |e: &MigrateError| {
                    handle.stop(StopReason::Failed(format!(
                        "the lazy restore could not read the rest of guest RAM, so its memory is incomplete: {e}"
                    )));
                    handle.wait_stopped(Some(Duration::from_secs(10)));
                };
                // On an error the guest was stopped, with the reason.
                if let Ok(l) = load.wait(stop) {
                    ferry_vmm::snapshot::loaded(&handle);
                    eprintln!(
                        "ferry: all of RAM in place {:.0} ms after the resume: {} MiB read ({:.2} GB/s), {} pages the guest touched first served on demand (mean {:.0} us), {} hot pages loaded first",
                        l.load_ms,
                        l.bytes_read >> 20,
                        l.bytes_read as f64 / 1e6 / l.load_ms.max(1e-3),
                        l.demand_faults,
                        l.fault_mean_us,
                        l.hot_pages
                    );
                }
            })
            .context("cannot start the restore's follower")?;
    }
    Ok(vm)
}
