//! Checks of a destination taking the guest over: given a paused source's memory and state, as
//! a restore gives them, it resumes and its guest runs; and a destination that postcopy gives
//! up after the resume (`abandon`) stops for good, with the reason it was given.

use std::time::{Duration, Instant};

use ferry_migrate::{DestinationVm, SourceVm};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::{check_parts, copy_ram, ok, state_bytes};

/// The reason the suite abandons a destination with, to be found in the one its VMM gives.
const WHY: &str = "the conformance suite abandons this destination";

/// A destination given a paused source's RAM and state resumes: its guest runs (as its fixture
/// sees it), `resume` returns no more time than the call took, and `state_parts` then
/// describes the load and the resume as `check_parts` says (no more time than the two calls
/// took, no more bytes than the sections hold).
pub fn destination_runs_the_sources_guest<F: Fixture>(f: &mut F) {
    let Resumed {
        source: _source,
        mut destination,
        load,
        resume,
        took,
        bytes,
    } = resumed(f);
    assert!(
        took <= resume,
        "resume() says starting took {took:?}, and the call took {resume:?}"
    );
    check_parts(
        "the destination's state_parts after load_state and resume",
        &destination.state_parts(),
        load + resume,
        bytes,
    );
    f.destination_runs(&mut destination);
}

/// A running destination that is abandoned (postcopy failed after its resume) stops for good,
/// and the reason its VMM gives says why it was abandoned.
pub fn abandoned_destination_stops_for_good<F: Fixture>(f: &mut F) {
    let Resumed {
        source: _source,
        mut destination,
        ..
    } = resumed(f);
    f.destination_runs(&mut destination);
    destination.abandon(WHY);
    let why = f
        .destination_stopped(&mut destination)
        .expect("the destination's guest still runs after abandon()");
    assert!(
        why.contains(WHY),
        "the destination stopped, for another reason than the one abandon() gave: {why}"
    );
}

/// A destination resumed by [`resumed`], with the times it took.
struct Resumed<F: Fixture> {
    /// Kept paused, and alive, while the destination runs its guest.
    source: F::Source,
    destination: F::Destination,
    /// How long `load_state` and `resume` took, measured around the calls.
    load: Duration,
    resume: Duration,
    /// What `resume` returned.
    took: Duration,
    /// Bytes of state loaded.
    bytes: u64,
}

/// A fresh destination given a paused source's RAM and state, as a restore gives them, and
/// resumed.
fn resumed<F: Fixture>(f: &mut F) -> Resumed<F> {
    let mut source = f.source();
    ok("pause", source.pause());
    let sections = ok("save_state", source.save_state());
    let mut destination = f.destination();
    copy_ram(&source, &destination);
    let t = Instant::now();
    ok("load_state", destination.load_state(&sections));
    let load = t.elapsed();
    let t = Instant::now();
    let took = ok("resume", destination.resume());
    let resume = t.elapsed();
    Resumed {
        source,
        destination,
        load,
        resume,
        took,
        bytes: state_bytes(&sections),
    }
}
