//! A conformance suite for VMMs: the contracts of [`SourceVm`](ferry_migrate::SourceVm) and
//! [`DestinationVm`](ferry_migrate::DestinationVm) that the engine relies on, checked against
//! a real implementation, one check or more for every method of both traits. A VMM
//! implements [`Fixture`] (how to make its VMs, and what only it can do or see: a write by the
//! VMM, writes by the guest, whether a destination's guest runs or stopped) and instantiates
//! every check as a test with [`conformance_tests!`](crate::conformance_tests):
//!
//! ```ignore
//! // tests/conformance.rs of a VMM crate, with ferry-migrate-testkit in dev-dependencies
//! ferry_migrate_testkit::conformance_tests!(MyFixture::new());
//! ```
//!
//! The checks, by the methods they exercise, and what the engine does that needs them:
//!
//! - Guest RAM (`ram.rs`). [`ram_is_well_formed`] (`ram` of both): regions are page aligned,
//!   non-empty, non-overlapping once sorted and accepted by the engine; readable through
//!   `host_addr`; and `fd` at `file_offset` holds the same bytes (pass 1 finds populated memory
//!   with `SEEK_DATA` on that file). A destination's regions have the source's layout.
//!   [`destination_file_is_its_memory`]: a byte written to a destination region's `fd` shows
//!   through `host_addr`, whatever `page_landing` says today.
//!   [`destination_lands_pages_as_it_says`] (`page_landing`): for one channel or many, a byte
//!   landed the way it names shows in both the mapping and the file.
//!   [`destination_adopts_the_sources_ram`] (`adopt_ram`, a local handover): the destination's
//!   regions then show what the source writes; a layout not its own and a file too short are
//!   refused. [`device_descriptors_pass_or_are_refused`] (`devices.rs`: `device_fds`,
//!   `takes_device_fds`, `adopt_device_fds`, a local handover's device files): a source passes
//!   open files, each device named once; a destination that takes them takes the source's and
//!   refuses one for a device it does not have, and one that does not takes none.
//! - Dirty tracking (`dirty.rs`: `start_dirty_log`, `arm_dirty` over all of RAM as pass 1
//!   arms what it reads, `fetch_dirty`, `stop_dirty_log`).
//!   [`dirty_log_starts_empty`]: a page nobody wrote since tracking started is not reported
//!   (pass 1 sends populated memory once; a log that reported all of RAM would send it
//!   again), and [`vmm_writes_are_reported`], [`guest_writes_are_reported`]: one written
//!   afterwards by the VMM or by the guest is (a lost write is a corrupt migration).
//!   [`fetch_clears_what_it_reports`]: a second fetch without writes reports nothing (else
//!   precopy never converges). [`dirty_log_restarts`]: stopping and starting again tracks as
//!   the first time (a cancelled migration is followed by another).
//! - Slowing the guest for auto-converge (`converge.rs`).
//!   [`throttle_is_set_and_lifted_or_refused`] (`set_throttle`).
//!   [`dirty_limit_slows_a_writing_vcpu_or_is_refused`] (`set_dirty_limit`, `vcpu_dirty`): a
//!   limit makes a vCPU that writes faster sleep, which `vcpu_dirty` reports, and lifted it
//!   makes none sleep. [`vcpu_dirty_counts_since_tracking_started`] (`vcpu_dirty`): what each
//!   vCPU dirtied since tracking started, for the statistics.
//! - Free page hinting (`hints.rs`). [`free_page_hints_arrive_and_stop_or_are_refused`]
//!   (`start_hints`, `take_hints`, `stop_hints`, `finish_hints`): hints arrive as ranges of
//!   RAM, and none after the stop (a hint applied after a dirty sync could lose a write).
//! - Configuration and device state (`state.rs`). [`destination_checks_the_sources_config`]
//!   (`config`, `check_config`; a migration's hello and a snapshot's header carry the
//!   description): a destination takes its source's and refuses one cut or garbled.
//!   [`paused_source_saves_state`] (`pause`, `save_state`, `resume`) and
//!   [`destination_loads_the_sources_state`] (`load_state`): switchover.
//!   [`source_state_parts_describe_the_last_save`] (`state_parts` of the source): bounded, no
//!   more time than the save took, the last save's alone (the downtime breakdown).
//!   [`destination_refuses_bad_state`]: a section with another version, without its data, or
//!   of a kind the VMM never saved is refused with an error, not a panic and not a silent
//!   success.
//! - Iterative device state (`iterative.rs`). [`iterative_state_moves_or_is_refused`]
//!   (`start_state_iteration`, `next_state_chunk`, `pending_state_bytes`,
//!   `end_state_iteration`, `load_state_chunk`, `state_ready`): a paused source's chunks end
//!   within their bound with nothing pending after them, and a destination that took them all
//!   is ready for the switchover; or both sides refuse it all.
//! - Taking the guest over (`switchover.rs`). [`destination_runs_the_sources_guest`]
//!   (`resume` and `state_parts` of the destination): given a paused source's RAM and state,
//!   as a restore gives them, the destination resumes, says no more time than it took, and
//!   its guest runs. [`abandoned_destination_stops_for_good`] (`abandon`, postcopy's failure
//!   after the resume): the guest stops, with the reason given.
//!
//! Silent success is what the checks catch: an operation that returns `Ok` without doing its
//! work (a fetch that reports nothing, a load that accepts anything, a dirty limit that slows
//! nothing) fails the check watching its effect.
//! [`VmError::Unsupported`](ferry_migrate::VmError::Unsupported) fails the suite with that
//! name from every operation the engine needs to migrate a VM; the optional ones (those
//! whose default refuses: `config`, `set_throttle`, `set_dirty_limit`, the hinting methods,
//! `adopt_ram`) may refuse as unsupported, and must then refuse for good, or work and show it.
//! The defaults that answer (`state_parts` and `vcpu_dirty`: nothing; `check_config`: accepts)
//! pass only where the VMM claims nothing more (no description from `config`).
//!
//! The suite's own invariants: it writes guest memory only while the source is paused and only
//! with the byte already there (or puts it back), so a real guest running a workload stays
//! correct; and it treats sections and configurations as opaque (save, change the version, drop
//! the data, cut or flip the bytes, load), so a VMM's encodings are its own business.
//!
//! The files: [`Fixture`] in `fixture.rs`; what the checks share in `support.rs`, below every
//! check file; the checks by subject as above.

mod converge;
mod devices;
mod dirty;
mod fixture;
mod hints;
mod iterative;
mod ram;
mod state;
mod support;
mod switchover;

pub use converge::{
    dirty_limit_slows_a_writing_vcpu_or_is_refused, throttle_is_set_and_lifted_or_refused,
    vcpu_dirty_counts_since_tracking_started,
};
pub use devices::device_descriptors_pass_or_are_refused;
pub use dirty::{
    dirty_log_restarts, dirty_log_starts_empty, fetch_clears_what_it_reports,
    guest_writes_are_reported, vmm_writes_are_reported,
};
pub use fixture::Fixture;
pub use hints::free_page_hints_arrive_and_stop_or_are_refused;
pub use iterative::iterative_state_moves_or_is_refused;
pub use ram::{
    destination_adopts_the_sources_ram, destination_file_is_its_memory,
    destination_lands_pages_as_it_says, ram_is_well_formed,
};
pub use state::{
    destination_checks_the_sources_config, destination_loads_the_sources_state,
    destination_refuses_bad_state, paused_source_saves_state,
    source_state_parts_describe_the_last_save,
};
pub use switchover::{abandoned_destination_stops_for_good, destination_runs_the_sources_guest};

/// Instantiates every check of [`crate::conformance`] as a `#[test]` in the calling module,
/// each with a fixture made by `$fixture` (an expression evaluated once per test).
#[macro_export]
macro_rules! conformance_tests {
    ($fixture:expr) => {
        $crate::conformance_tests!(@each $fixture;
            ram_is_well_formed,
            destination_file_is_its_memory,
            destination_lands_pages_as_it_says,
            destination_adopts_the_sources_ram,
            device_descriptors_pass_or_are_refused,
            dirty_log_starts_empty,
            vmm_writes_are_reported,
            guest_writes_are_reported,
            fetch_clears_what_it_reports,
            dirty_log_restarts,
            throttle_is_set_and_lifted_or_refused,
            dirty_limit_slows_a_writing_vcpu_or_is_refused,
            vcpu_dirty_counts_since_tracking_started,
            free_page_hints_arrive_and_stop_or_are_refused,
            destination_checks_the_sources_config,
            paused_source_saves_state,
            source_state_parts_describe_the_last_save,
            destination_loads_the_sources_state,
            destination_refuses_bad_state,
            destination_runs_the_sources_guest,
            abandoned_destination_stops_for_good,
            iterative_state_moves_or_is_refused,
        );
    };
    (@each $fixture:expr; $($check:ident,)*) => {
        $(
            #[test]
            fn $check() {
                let mut fixture = $fixture;
                $crate::conformance::$check(&mut fixture);
            }
        )*
    };
}
