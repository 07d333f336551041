//! Snapshots over the fake VMM, without /dev/kvm: a live save while the fake guest writes, then
//! eager and lazy restores (real files, real userfaultfd) that must hold exactly what the
//! source held when it paused; and every kind of bad file refused before anything is used.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_migrate::snapshot::{self, AfterSave, Loading, RestoreParams, SaveParams};
use ferry_migrate::{Control, MigrateError, Phase, Policy, TimeoutAction};
use ferry_migrate_testkit::{FakeVm, Writers};

const MIB: u64 = 1 << 20;

fn save_params(after: AfterSave) -> SaveParams {
    SaveParams {
        writers: 2,
        policy: Policy {
            downtime_limit: Duration::from_millis(50),
            timeout: Some(Duration::from_secs(1)),
            timeout_action: TimeoutAction::Switchover,
            ..Policy::default()
        },
        vcpus: 2,
        uuid: [7; 16],
        after,
        file: Default::default(),
        staging_limit: snapshot::DEFAULT_STAGING_LIMIT,
    }
}

fn restore_params(loading: Loading) -> RestoreParams {
    RestoreParams {
        loading,
        readers: 2,
        vcpus: 2,
        hot_first: true,
        read_deadline: snapshot::DEFAULT_READ_DEADLINE,
        read_delay: None,
    }
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("ferry-snapshot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn file(&self) -> PathBuf {
        self.0.join("vm.snap")
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A source with a third of its pages filled (some zero), saved with `--stop` while writers
/// ran: returns it, paused, and the file.
fn saved(dir: &Dir, size: u64, regions: usize) -> FakeVm {
    saved_with(dir, size, regions, &save_params(AfterSave::Stop)).0
}

/// [`saved`] with `params`; the save's statistics too.
fn saved_with(
    dir: &Dir,
    size: u64,
    regions: usize,
    params: &SaveParams,
) -> (FakeVm, ferry_migrate::MigrationStats) {
    let mut src = FakeVm::new(size, regions);
    src.fill(3);
    src.start_writers(Writers {
        threads: 2,
        seed: 11,
        zero_percent: 20,
        interval: Duration::from_micros(20),
    });
    let control = Control::default();
    let stats = snapshot::save(&mut src, &dir.file(), params, &control).unwrap();
    assert!(src.is_paused(), "--stop leaves the guest paused");
    assert!(!src.is_logging(), "dirty logging is off afterwards");
    assert!(
        stats.passes.len() >= 2,
        "pass 1 and the final pass at least"
    );
    assert!(stats.passes.last().unwrap().paused);
    assert_eq!(control.progress().phase, Phase::Completed);
    src.stop_writers();
    (src, stats)
}

/// Issue 48: a snapshot staged its whole final pass in memory (buffers for twice the dirty
/// pages, unbounded). With a limit of one batch it stages at most that and writes the rest of
/// the final pass during the pause, and the restore holds what the source held.
#[test]
fn regression_a_snapshot_stages_at_most_its_limit_and_writes_the_rest_in_the_pause() {
    let dir = Dir::new("staging");
    let limit = 2 * MIB;
    let params = SaveParams {
        staging_limit: limit,
        // Pauses at the timeout whatever the writers dirtied: a final pass of many batches.
        policy: Policy {
            downtime_limit: Duration::from_micros(1),
            timeout: Some(Duration::from_millis(300)),
            timeout_action: TimeoutAction::Switchover,
            ..Policy::default()
        },
        ..save_params(AfterSave::Stop)
    };
    let (src, stats) = saved_with(&dir, 64 * MIB, 2, &params);
    let last = stats.passes.last().unwrap();
    assert!(stats.staged_bytes <= limit, "{} staged", stats.staged_bytes);
    assert!(last.pages > 2 * 512, "a final pass of {} pages", last.pages);
    assert!(
        stats.final_pages_written_in_pause >= last.pages - 512,
        "{} of the final pass's {} pages written in the pause",
        stats.final_pages_written_in_pause,
        last.pages
    );
    let mut dst = FakeVm::new(64 * MIB, 2);
    snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Eager)).unwrap();
    assert!(src.contents() == dst.contents(), "memory differs");
}

#[test]
fn an_eager_restore_holds_what_the_source_held_when_it_paused() {
    let dir = Dir::new("eager");
    let src = saved(&dir, 24 * MIB, 2);
    let mut dst = FakeVm::new(24 * MIB, 2);
    let restored =
        snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Eager)).unwrap();
    assert!(restored.lazy.is_none());
    assert!(dst.resumed);
    assert_eq!(dst.state, src.state);
    assert!(src.contents() == dst.contents(), "memory differs");
    assert!(restored.stats.bytes_read > 0);
}

#[test]
fn a_save_with_direct_io_restores_the_same() {
    let dir = Dir::new("direct");
    let mut src = FakeVm::new(16 * MIB, 2);
    src.fill(3);
    let params = SaveParams {
        file: snapshot::FileOptions {
            direct_io: true,
            ..Default::default()
        },
        ..save_params(AfterSave::Stop)
    };
    snapshot::save(&mut src, &dir.file(), &params, &Control::default()).unwrap();
    let mut dst = FakeVm::new(16 * MIB, 2);
    snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Eager)).unwrap();
    assert!(src.contents() == dst.contents(), "memory differs");
}

#[test]
fn a_lazy_restore_serves_what_the_guest_touches_first_and_loads_the_rest() {
    let dir = Dir::new("lazy");
    let src = saved(&dir, 32 * MIB, 1);
    let mut dst = FakeVm::new(32 * MIB, 1);
    let restored =
        snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Lazy)).unwrap();
    assert!(dst.resumed);
    // Read all of RAM at once, as a guest would touch it: pages the loader has not placed
    // yet fault and are served from the file.
    let seen = dst.contents();
    let lazy = restored
        .lazy
        .expect("a lazy restore loads in the background");
    let stats = lazy.wait(|e| panic!("the load failed: {e}")).unwrap();
    assert!(
        seen == src.contents(),
        "memory read during the load differs"
    );
    assert!(
        dst.contents() == src.contents(),
        "memory differs after the load"
    );
    assert!(stats.bytes_read > 0);
    println!(
        "lazy: {} demand faults, {} hot pages, loaded in {:.1} ms",
        stats.demand_faults, stats.hot_pages, stats.load_ms
    );
}

#[test]
fn a_live_save_resumes_the_guest_and_the_file_holds_the_paused_moment() {
    let dir = Dir::new("live");
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(2);
    src.start_writers(Writers {
        threads: 1,
        seed: 5,
        zero_percent: 0,
        interval: Duration::from_micros(50),
    });
    let before = src.writes();
    snapshot::save(
        &mut src,
        &dir.file(),
        &save_params(AfterSave::Resume),
        &Control::default(),
    )
    .unwrap();
    assert!(!src.is_paused(), "the guest runs on after a live snapshot");
    std::thread::sleep(Duration::from_millis(20));
    assert!(src.writes() > before, "the guest kept writing");
    src.stop_writers();
    assert!(!dir.0.join("vm.snap.partial").exists());
    let mut dst = FakeVm::new(16 * MIB, 1);
    snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Eager)).unwrap();
    assert_eq!(dst.state, src.state);
}

#[test]
fn a_cancelled_save_leaves_the_guest_running_and_no_file() {
    let dir = Dir::new("cancel");
    let mut src = FakeVm::new(16 * MIB, 1);
    src.fill(1);
    let control = Control::default();
    control.cancel();
    let e = snapshot::save(
        &mut src,
        &dir.file(),
        &save_params(AfterSave::Stop),
        &control,
    )
    .unwrap_err();
    assert!(matches!(e, MigrateError::Cancelled), "{e}");
    assert!(!src.is_paused());
    assert_eq!(control.progress().phase, Phase::Cancelled);
    assert!(!dir.file().exists());
    assert!(
        !dir.0.join("vm.snap.partial").exists(),
        "a failed save removes its partial file"
    );
}

#[test]
fn a_save_that_cannot_create_its_file_fails_at_once_and_says_so() {
    let dir = Dir::new("nowhere");
    let mut src = FakeVm::new(8 * MIB, 1);
    let control = Control::default();
    let path = dir.0.join("missing/vm.snap");
    let e = snapshot::save(&mut src, &path, &save_params(AfterSave::Resume), &control).unwrap_err();
    assert!(e.to_string().contains("creating"), "{e}");
    assert!(!src.is_paused() && !src.is_logging());
    let p = control.progress();
    assert_eq!(
        p.phase,
        Phase::Failed,
        "a follower of the progress sees the end"
    );
    assert_eq!(p.error, Some(e.to_string()));
}

/// Restores `path` into a fresh fake VM of `size`; the error's text.
fn refusal(path: &Path, size: u64, vcpus: u32) -> String {
    let mut dst = FakeVm::new(size, 1);
    let params = RestoreParams {
        vcpus,
        ..restore_params(Loading::Eager)
    };
    let e = snapshot::restore(&mut dst, path, &params).unwrap_err();
    assert!(!dst.resumed, "nothing runs after a refused restore");
    e.to_string()
}

/// What a case does to a good file's bytes.
type Damage = Box<dyn Fn(&mut Vec<u8>)>;

#[test]
fn bad_files_are_refused_with_the_cause() {
    let dir = Dir::new("bad");
    saved(&dir, 8 * MIB, 1);
    let good = std::fs::read(dir.file()).unwrap();
    let reader = snapshot::Reader::open(&dir.file()).unwrap();
    let h = reader.header().clone();
    let bad = dir.0.join("bad.snap");
    let with = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        std::fs::write(&bad, &b).unwrap();
    };
    // A page with data, found through the file's own data runs.
    let (gpa, _) = reader.data_runs(1).unwrap()[0];
    let (page_at, _) = h.locate(gpa).unwrap();
    // The header as a writer leaves it until the end: valid, and not complete.
    let mut incomplete = h.clone();
    incomplete.complete = false;
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "truncated",
            Box::new(|b| b.truncate(b.len() - 4096)),
            "cut short",
        ),
        (
            "header byte",
            Box::new(|b| b[200] ^= 1),
            "header is damaged",
        ),
        (
            "state byte",
            Box::new(move |b| b[h.state.offset as usize] ^= 1),
            "device state is damaged",
        ),
        (
            "page byte",
            Box::new(move |b| b[page_at as usize + 9] ^= 0x40),
            "is damaged",
        ),
        (
            "not a snapshot",
            Box::new(|b| b[0] = b'X'),
            "not a ferry snapshot",
        ),
        (
            "incomplete",
            Box::new(move |b| b[..4096].copy_from_slice(&incomplete.encode())),
            "incomplete",
        ),
    ];
    for (what, damage, expected) in cases {
        with(&*damage);
        let e = refusal(&bad, 8 * MIB, 2);
        assert!(e.contains(expected), "{what}: {e}");
    }
    let e = refusal(&dir.file(), 16 * MIB, 2);
    assert!(
        e.contains("holds 8M of guest RAM") || e.contains("8 MiB"),
        "{e}"
    );
    let e = refusal(&dir.file(), 8 * MIB, 4);
    assert!(e.contains("has 2 vCPUs and this one 4"), "{e}");
}

#[test]
fn a_damaged_page_found_after_a_lazy_resume_abandons_the_guest_before_it_sees_the_page() {
    let dir = Dir::new("lazy-damage");
    saved(&dir, 8 * MIB, 1);
    let reader = snapshot::Reader::open(&dir.file()).unwrap();
    // The last data run's last page: the loader reaches it last, the guest never touches it.
    let &(gpa, pages) = reader.data_runs(1).unwrap().last().unwrap();
    let (at, _) = reader.header().locate(gpa + (pages - 1) * 4096).unwrap();
    drop(reader);
    let mut bytes = std::fs::read(dir.file()).unwrap();
    bytes[at as usize + 100] ^= 0x10;
    std::fs::write(dir.file(), &bytes).unwrap();
    let mut dst = FakeVm::new(8 * MIB, 1);
    let restored =
        snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Lazy)).unwrap();
    assert!(
        dst.resumed,
        "the file's metadata is sound: the guest resumes"
    );
    let abandoned = std::cell::Cell::new(None);
    let e = restored
        .lazy
        .unwrap()
        .wait(|e| abandoned.set(Some(e.to_string())))
        .unwrap_err();
    assert!(e.to_string().contains("is damaged"), "{e}");
    assert_eq!(
        abandoned.take(),
        Some(e.to_string()),
        "the guest was abandoned with the cause"
    );
}

/// Issue 48: a lazy restore's page reads had no deadline, so vCPUs hung with the storage,
/// silently. Here every read stands still for 2 s (no file's reads can be made to hang for
/// real in a test) and the deadline is 200 ms: the wait abandons the guest with the cause,
/// naming the file and a page, long before the reads return.
#[test]
fn regression_a_lazy_restore_whose_reads_hang_abandons_the_guest_with_the_cause() {
    let dir = Dir::new("lazy-hang");
    saved(&dir, 8 * MIB, 1);
    let mut dst = FakeVm::new(8 * MIB, 1);
    let params = RestoreParams {
        read_deadline: Duration::from_millis(200),
        read_delay: Some(Duration::from_secs(2)),
        ..restore_params(Loading::Lazy)
    };
    let restored = snapshot::restore(&mut dst, &dir.file(), &params).unwrap();
    assert!(dst.resumed);
    let started = std::time::Instant::now();
    let abandoned = std::cell::Cell::new(None);
    let e = restored
        .lazy
        .unwrap()
        .wait(|e| abandoned.set(Some(e.to_string())))
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        e.to_string().contains("has not returned after") && e.to_string().contains("vm.snap"),
        "{e}"
    );
    assert_eq!(abandoned.take(), Some(e.to_string()));
    assert!(took < Duration::from_millis(1500), "{took:?}");
}

/// A VMM that keeps `DestinationVm::map_file`'s default cannot take a mapped restore: it is
/// refused before any state loads or the guest runs, naming what is unsupported.
#[test]
fn a_mapped_restore_into_a_vmm_that_cannot_map_is_refused_before_the_guest_runs() {
    let dir = Dir::new("mapped");
    saved(&dir, 16 * MIB, 2);
    let mut dst = FakeVm::new(16 * MIB, 2);
    let e = snapshot::restore(&mut dst, &dir.file(), &restore_params(Loading::Mapped))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mapped restore") && e.contains("not supported"),
        "{e}"
    );
    assert!(!dst.resumed);
}
