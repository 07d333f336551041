//! Iterative device state: the state of devices too large for the pause, sent in chunks while
//! the guest runs, loaded on the destination as it comes, and a destination that says when its
//! devices are ready for the switchover.

use ferry_migrate::wire::MAX_SECTION_BYTES;
use ferry_migrate::{DestinationVm, SourceVm, VmError};

use crate::conformance::fixture::Fixture;
use crate::conformance::support::ok;

/// Chunks one check takes at most: a VMM whose chunks never end would hold a paused guest's
/// switchover for ever.
const MOST_CHUNKS: usize = 1 << 16;

/// `start_state_iteration`, `next_state_chunk`, `pending_state_bytes`,
/// `end_state_iteration`, and the destination's `load_state_chunk` and `state_ready`: a VM
/// with iterative state has something to send when it starts; with the guest paused its chunks
/// end, each within a section's bound, and nothing is pending after them; a destination takes
/// every chunk and is then ready, and refuses a chunk of a layout it does not know. A VM
/// without such state refuses all of it, on both sides, as `Unsupported`.
pub fn iterative_state_moves_or_is_refused<F: Fixture>(f: &mut F) {
    let mut src = f.source();
    let mut dst = f.destination();
    let ready = dst.state_ready();
    let pending = match src.start_state_iteration() {
        Err(VmError::Unsupported { .. }) => {
            let unsupported =
                |r: Result<(), VmError>| matches!(r, Err(VmError::Unsupported { .. }));
            assert!(
                unsupported(src.next_state_chunk(MAX_SECTION_BYTES as usize).map(drop)),
                "start_state_iteration is unsupported but next_state_chunk is not"
            );
            assert!(
                unsupported(src.pending_state_bytes().map(drop)),
                "start_state_iteration is unsupported but pending_state_bytes is not"
            );
            return;
        }
        r => ok("start_state_iteration", r),
    };
    assert!(
        pending > 0,
        "start_state_iteration said nothing is to send: a VM without iterative state refuses it"
    );
    ok("pause", src.pause());
    let mut chunks = Vec::new();
    while let Some(c) = ok(
        "next_state_chunk",
        src.next_state_chunk(MAX_SECTION_BYTES as usize),
    ) {
        assert!(
            c.data.len() as u64 <= MAX_SECTION_BYTES,
            "a chunk of {} bytes, over the {MAX_SECTION_BYTES} asked for",
            c.data.len()
        );
        chunks.push(c);
        assert!(
            chunks.len() < MOST_CHUNKS,
            "the chunks of a paused VM never end"
        );
    }
    assert!(
        !chunks.is_empty(),
        "{pending} bytes pending, and no chunk came"
    );
    assert_eq!(
        ok("pending_state_bytes", src.pending_state_bytes()),
        0,
        "a paused VM gave every chunk, and still has some pending"
    );
    match ready {
        Err(VmError::Unsupported { .. }) => {
            panic!("the source has iterative state and its destination takes none")
        }
        r => drop(ok("state_ready", r)),
    }
    for c in &chunks {
        ok("load_state_chunk", dst.load_state_chunk(c));
    }
    assert!(
        ok("state_ready", dst.state_ready()),
        "the destination took every chunk of a paused source, and is not ready"
    );
    let mut unknown = chunks[0].clone();
    unknown.version = unknown.version.wrapping_add(0x8000);
    assert!(
        dst.load_state_chunk(&unknown).is_err(),
        "a chunk of a layout version the VMM never wrote was taken"
    );
    src.end_state_iteration();
    ok("resume", src.resume());
}
