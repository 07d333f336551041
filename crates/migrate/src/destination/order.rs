//! The record order of the destination's connections (docs/protocol.md), as pure state
//! machines: [`next`] for the main channel and [`next_data`] for a data channel or the preempt
//! connection take where the stream is and the header that came, and say what the session or
//! the receiver does with the record, or which rule it broke. No I/O: the session reads, applies and
//! waits; the table below tests every rule, as `policy.rs`'s tables test the policy.
//!
//! The main channel carries pass ends while the data channels carry pages; once postcopy is
//! decided, discard lists (no pass ends any more); then the device state, ended by Complete
//! (precopy) or Postcopy. An Error record may come anywhere.

#![forbid(unsafe_code)]

use crate::error::{ProtocolError, Rule};
use crate::wire::{Capabilities, Kind};

/// Where the main channel's stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Main {
    /// Memory passes run; `passes` have ended.
    Passes { passes: u32 },
    /// Postcopy was decided after `passes` passes: discard lists come, then the device state.
    Discarding { passes: u32 },
    /// The device state is coming; `discarded` if discard lists came first (then it ends with
    /// Postcopy, never Complete).
    State { discarded: bool },
}

impl Main {
    /// A migration's main channel before its first record.
    pub(crate) const START: Main = Main::Passes { passes: 0 };
}

/// What the session does with a record the order allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Pass `n` ended: wait until every data channel ended it too.
    EndPass(u32),
    /// Read a discard list and drop its pages (postcopy fetches them again).
    Discard,
    /// Read a device-state section.
    Section,
    /// Read a chunk of iterative state and load it now.
    Chunk,
    /// Precopy is complete: every data channel must have ended; load the state and resume.
    Complete,
    /// Switch to postcopy with the state received.
    Postcopy,
    /// The source's Error record: read it and end with it.
    PeerError,
}

/// The record of kind `kind` (with the header's `count`) at `at`: the state after it and what
/// to do, or the rule it broke. `granted` is what the hello's answer granted.
pub(crate) fn next(
    at: Main,
    kind: Kind,
    count: u32,
    granted: Capabilities,
) -> Result<(Main, Step), ProtocolError> {
    use Main as M;
    let refuse = |rule| Err(ProtocolError::Misplaced { got: kind, rule });
    let postcopy = granted.contains(Capabilities::POSTCOPY);
    match (kind, at) {
        (Kind::Error, _) => Ok((at, Step::PeerError)),
        (Kind::EndOfPass, M::Passes { passes }) if count == passes + 1 => {
            Ok((M::Passes { passes: count }, Step::EndPass(count)))
        }
        (Kind::EndOfPass, M::Passes { passes }) => Err(ProtocolError::PassOrder {
            got: count,
            after: passes,
            data_channel: false,
        }),
        (Kind::EndOfPass, _) => refuse(Rule::NoPassAfterState),
        (Kind::StateChunk, _) if !granted.contains(Capabilities::ITERATIVE_STATE) => {
            refuse(Rule::NeedsIterativeState)
        }
        (Kind::StateChunk, M::Passes { .. } | M::Discarding { .. }) => Ok((at, Step::Chunk)),
        (Kind::StateChunk, M::State { .. }) => refuse(Rule::ChunksBeforeState),
        (Kind::Discard | Kind::Postcopy, _) if !postcopy => refuse(Rule::NeedsPostcopy),
        (Kind::Discard, M::Passes { passes } | M::Discarding { passes }) if passes > 0 => {
            Ok((M::Discarding { passes }, Step::Discard))
        }
        (Kind::Discard, _) => refuse(Rule::DiscardBetweenPassesAndState),
        (Kind::Postcopy, M::State { .. }) => Ok((at, Step::Postcopy)),
        (Kind::Postcopy, _) => refuse(Rule::PostcopyAfterState),
        (Kind::DeviceState, M::Passes { passes: 0 }) => refuse(Rule::StateAfterPass),
        (Kind::DeviceState, M::Passes { .. }) => Ok((M::State { discarded: false }, Step::Section)),
        (Kind::DeviceState, M::Discarding { .. }) => {
            Ok((M::State { discarded: true }, Step::Section))
        }
        (Kind::DeviceState, M::State { .. }) => Ok((at, Step::Section)),
        (Kind::Complete, M::Discarding { .. } | M::State { discarded: true }) => {
            refuse(Rule::NoCompleteAfterDiscard)
        }
        (Kind::Complete, M::State { discarded: false }) => Ok((at, Step::Complete)),
        (Kind::Complete, M::Passes { .. }) => refuse(Rule::CompleteAfterState),
        (k, _) => Err(ProtocolError::Misplaced {
            got: k,
            rule: Rule::MainChannel,
        }),
    }
}

/// Where a local handover's main channel is: no page and no pass, guest RAM's descriptors
/// first, devices' descriptors if granted and passed, then the device state and Complete, then
/// (after this side answered Loaded) Go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Local {
    /// Before the LocalRam record.
    Ram,
    /// Guest RAM is adopted; nothing came since: devices' descriptors may come (once, with
    /// the capability), or the device state.
    Adopted,
    /// The device state comes, up to Complete.
    State,
    /// The state is loaded: Go, or nothing (the guest is the source's again).
    Go,
}

/// What the session does with a record of a local handover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LocalStep {
    /// Map guest RAM from the descriptors that came with the record.
    Adopt,
    /// Hand the descriptors that came with the record to the devices they name.
    AdoptDevices,
    /// Read a device-state section.
    Section,
    /// Load the state and answer Loaded.
    Load,
    /// Resume the guest.
    Resume,
    /// The source's Error record: read it and end with it.
    PeerError,
}

/// The record of kind `kind` in a local handover at `at`: the state after it and what to do,
/// or the rule it broke. `granted` is what the hello's answer granted.
pub(crate) fn next_local(
    at: Local,
    kind: Kind,
    granted: Capabilities,
) -> Result<(Local, LocalStep), ProtocolError> {
    use Local as L;
    let refuse = |rule| Err(ProtocolError::Misplaced { got: kind, rule });
    match (kind, at) {
        (Kind::Error, _) => Ok((at, LocalStep::PeerError)),
        (Kind::LocalRam, L::Ram) => Ok((L::Adopted, LocalStep::Adopt)),
        (_, L::Ram) => refuse(Rule::LocalRamFirst),
        (Kind::LocalDevices, _) if !granted.contains(Capabilities::LOCAL_DEVICES) => {
            refuse(Rule::NeedsLocalDevices)
        }
        (Kind::LocalDevices, L::Adopted) => Ok((L::State, LocalStep::AdoptDevices)),
        (Kind::LocalDevices, _) => refuse(Rule::DevicesAfterRam),
        (Kind::DeviceState, L::Adopted | L::State) => Ok((L::State, LocalStep::Section)),
        (Kind::Complete, L::Adopted | L::State) => Ok((L::Go, LocalStep::Load)),
        (Kind::Go, L::Go) => Ok((L::Go, LocalStep::Resume)),
        (k, _) => Err(ProtocolError::Misplaced {
            got: k,
            rule: Rule::LocalChannel,
        }),
    }
}

/// Where a data channel's (or the preempt connection's) stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Data {
    /// A data channel in precopy; `passes` have ended on it.
    Passes { passes: u32 },
    /// The preempt connection before its first record, which must be Postcopy.
    Preempt,
    /// After its Postcopy record: postcopy pages only.
    Postcopy,
}

impl Data {
    /// A connection's state before its first record.
    pub(crate) fn start(channel: u16) -> Data {
        match channel {
            crate::wire::PREEMPT_CHANNEL => Data::Preempt,
            _ => Data::Passes { passes: 0 },
        }
    }
}

/// What a receiver does with a record the order allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataStep {
    /// Read and land a Pages record.
    Pages,
    /// Read, decompress and place a CompressedPages record's pages.
    CompressedPages,
    /// Read and apply a ZeroRuns record.
    ZeroRuns,
    /// Pass `n` ended on this channel: wait until every channel ended it.
    EndPass(u32),
    /// Switch to postcopy once the session has (the gate).
    Postcopy,
    /// The source's Error record: read it and end with it.
    PeerError,
}

/// The record of kind `kind` (with the header's `count`) on a data channel or the preempt
/// connection at `at`: the state after it and what to do, or the rule it broke.
pub(crate) fn next_data(
    at: Data,
    kind: Kind,
    count: u32,
) -> Result<(Data, DataStep), ProtocolError> {
    use Data as D;
    let refuse = |rule| Err(ProtocolError::Misplaced { got: kind, rule });
    match (kind, at) {
        (Kind::Postcopy, D::Preempt | D::Passes { .. }) => Ok((D::Postcopy, DataStep::Postcopy)),
        (_, D::Preempt) => refuse(Rule::PreemptStartsWithPostcopy),
        (Kind::Pages, _) => Ok((at, DataStep::Pages)),
        (Kind::CompressedPages, D::Passes { .. }) => Ok((at, DataStep::CompressedPages)),
        (Kind::CompressedPages, _) => refuse(Rule::CompressedInPasses),
        (Kind::ZeroRuns, _) => Ok((at, DataStep::ZeroRuns)),
        (Kind::EndOfPass, D::Passes { passes }) if count == passes + 1 => {
            Ok((D::Passes { passes: count }, DataStep::EndPass(count)))
        }
        (Kind::EndOfPass, D::Passes { passes }) => Err(ProtocolError::PassOrder {
            got: count,
            after: passes,
            data_channel: true,
        }),
        (Kind::EndOfPass, D::Postcopy) => refuse(Rule::NoPassInPostcopy),
        (Kind::Postcopy, D::Postcopy) => refuse(Rule::OnePostcopy),
        (Kind::Error, _) => Ok((at, DataStep::PeerError)),
        _ => refuse(Rule::DataChannel),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P0: Main = Main::START;
    const P2: Main = Main::Passes { passes: 2 };
    const D2: Main = Main::Discarding { passes: 2 };
    const S: Main = Main::State { discarded: false };
    const SD: Main = Main::State { discarded: true };

    /// Every state against every record kind the main channel can meet, with and without the
    /// postcopy capability where it matters: what is allowed, and the rule each refusal names.
    #[test]
    fn the_main_channel_takes_records_in_the_protocol_s_order() {
        use Kind as K;
        use Step as St;
        let ok = |m: Main, s: Step| Ok::<_, Rule>((m, s));
        let no = Err::<(Main, Step), Rule>;
        type Row = (Main, Kind, u32, bool, Result<(Main, Step), Rule>);
        let table: &[Row] = &[
            // Passes end in order, and only before postcopy and the state.
            (
                P0,
                K::EndOfPass,
                1,
                false,
                ok(Main::Passes { passes: 1 }, St::EndPass(1)),
            ),
            (
                P2,
                K::EndOfPass,
                3,
                true,
                ok(Main::Passes { passes: 3 }, St::EndPass(3)),
            ),
            (D2, K::EndOfPass, 3, true, no(Rule::NoPassAfterState)),
            (S, K::EndOfPass, 3, true, no(Rule::NoPassAfterState)),
            // Discard lists: with postcopy, after a pass, before the state; several.
            (P2, K::Discard, 0, true, ok(D2, St::Discard)),
            (D2, K::Discard, 0, true, ok(D2, St::Discard)),
            (P2, K::Discard, 0, false, no(Rule::NeedsPostcopy)),
            (
                P0,
                K::Discard,
                0,
                true,
                no(Rule::DiscardBetweenPassesAndState),
            ),
            (
                S,
                K::Discard,
                0,
                true,
                no(Rule::DiscardBetweenPassesAndState),
            ),
            // The device state: after a pass; after discard lists it remembers them.
            (P0, K::DeviceState, 0, true, no(Rule::StateAfterPass)),
            (P2, K::DeviceState, 0, false, ok(S, St::Section)),
            (D2, K::DeviceState, 0, true, ok(SD, St::Section)),
            (S, K::DeviceState, 0, false, ok(S, St::Section)),
            (SD, K::DeviceState, 0, true, ok(SD, St::Section)),
            // Complete: after the state, never after discard lists.
            (S, K::Complete, 0, false, ok(S, St::Complete)),
            (P2, K::Complete, 0, false, no(Rule::CompleteAfterState)),
            (SD, K::Complete, 0, true, no(Rule::NoCompleteAfterDiscard)),
            (D2, K::Complete, 0, true, no(Rule::NoCompleteAfterDiscard)),
            // Postcopy: with the capability, after the state (with or without discard lists).
            (SD, K::Postcopy, 0, true, ok(SD, St::Postcopy)),
            (S, K::Postcopy, 0, true, ok(S, St::Postcopy)),
            (S, K::Postcopy, 0, false, no(Rule::NeedsPostcopy)),
            (D2, K::Postcopy, 0, true, no(Rule::PostcopyAfterState)),
            (P2, K::Postcopy, 0, true, no(Rule::PostcopyAfterState)),
            // The source's Error, anywhere.
            (P0, K::Error, 0, false, ok(P0, St::PeerError)),
            (SD, K::Error, 0, true, ok(SD, St::PeerError)),
            // What belongs on other connections, or to the other direction.
            (P2, K::Pages, 1, true, no(Rule::MainChannel)),
            (P2, K::ZeroRuns, 1, true, no(Rule::MainChannel)),
            (S, K::Resumed, 0, true, no(Rule::MainChannel)),
            (S, K::VmConfig, 0, true, no(Rule::MainChannel)),
        ];
        for &(at, kind, count, postcopy, want) in table {
            let granted = match postcopy {
                true => Capabilities::POSTCOPY,
                false => Capabilities::NONE,
            };
            let got = next(at, kind, count, granted).map_err(|e| match e {
                ProtocolError::Misplaced { got, rule } => {
                    assert_eq!(got, kind);
                    rule
                }
                e => panic!("{at:?} {kind:?}: {e}"),
            });
            assert_eq!(
                got, want,
                "{at:?} {kind:?} count {count} postcopy {postcopy}"
            );
        }
    }

    /// A data channel's and the preempt connection's records, in every state.
    #[test]
    fn a_data_channel_takes_records_in_the_protocol_s_order() {
        use DataStep as St;
        use Kind as K;
        let p0 = Data::start(1);
        let p1 = Data::Passes { passes: 1 };
        let (pre, pc) = (Data::start(0), Data::Postcopy);
        let ok = |d: Data, s: DataStep| Ok::<_, Rule>((d, s));
        let no = Err::<(Data, DataStep), Rule>;
        type Row = (Data, Kind, u32, Result<(Data, DataStep), Rule>);
        let table: &[Row] = &[
            (p0, K::Pages, 8, ok(p0, St::Pages)),
            (p0, K::ZeroRuns, 2, ok(p0, St::ZeroRuns)),
            (p0, K::EndOfPass, 1, ok(p1, St::EndPass(1))),
            (p1, K::Postcopy, 0, ok(pc, St::Postcopy)),
            (p1, K::Error, 0, ok(p1, St::PeerError)),
            (pc, K::Pages, 1, ok(pc, St::Pages)),
            (pc, K::EndOfPass, 2, no(Rule::NoPassInPostcopy)),
            (pc, K::Postcopy, 0, no(Rule::OnePostcopy)),
            (pc, K::Error, 0, ok(pc, St::PeerError)),
            // The preempt connection: Postcopy first, nothing before it (not even an Error).
            (pre, K::Postcopy, 0, ok(pc, St::Postcopy)),
            (pre, K::Pages, 1, no(Rule::PreemptStartsWithPostcopy)),
            (pre, K::Error, 0, no(Rule::PreemptStartsWithPostcopy)),
            // What belongs on the main channel.
            (p1, K::DeviceState, 0, no(Rule::DataChannel)),
            (p1, K::Complete, 0, no(Rule::DataChannel)),
            (pc, K::Discard, 0, no(Rule::DataChannel)),
        ];
        for &(at, kind, count, want) in table {
            let got = next_data(at, kind, count).map_err(|e| match e {
                ProtocolError::Misplaced { got, rule } => {
                    assert_eq!(got, kind);
                    rule
                }
                e => panic!("{at:?} {kind:?}: {e}"),
            });
            assert_eq!(got, want, "{at:?} {kind:?} count {count}");
        }
        let e = next_data(p1, K::EndOfPass, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "end of pass 3 after pass 1 on a data channel"
        );
    }

    /// A local handover's main channel: guest RAM first, then the state, Complete, and Go
    /// only after it; nothing of precopy or postcopy.
    #[test]
    fn a_local_handover_takes_records_in_the_protocol_s_order() {
        use Kind as K;
        use Local as L;
        use LocalStep as St;
        let ok = |l: Local, s: LocalStep| Ok::<_, Rule>((l, s));
        let no = Err::<(Local, LocalStep), Rule>;
        type Row = (Local, Kind, Result<(Local, LocalStep), Rule>);
        let table: &[Row] = &[
            (L::Ram, K::LocalRam, ok(L::Adopted, St::Adopt)),
            (L::Ram, K::Error, ok(L::Ram, St::PeerError)),
            (L::Ram, K::DeviceState, no(Rule::LocalRamFirst)),
            (L::Ram, K::Go, no(Rule::LocalRamFirst)),
            (L::Ram, K::Pages, no(Rule::LocalRamFirst)),
            (L::Ram, K::LocalDevices, no(Rule::LocalRamFirst)),
            (L::Adopted, K::LocalDevices, ok(L::State, St::AdoptDevices)),
            (L::Adopted, K::DeviceState, ok(L::State, St::Section)),
            (L::Adopted, K::Complete, ok(L::Go, St::Load)),
            (L::Adopted, K::Go, no(Rule::LocalChannel)),
            (L::Adopted, K::LocalRam, no(Rule::LocalChannel)),
            (L::Adopted, K::Error, ok(L::Adopted, St::PeerError)),
            (L::State, K::LocalDevices, no(Rule::DevicesAfterRam)),
            (L::Go, K::LocalDevices, no(Rule::DevicesAfterRam)),
            (L::State, K::DeviceState, ok(L::State, St::Section)),
            (L::State, K::Complete, ok(L::Go, St::Load)),
            (L::State, K::Go, no(Rule::LocalChannel)),
            (L::State, K::LocalRam, no(Rule::LocalChannel)),
            (L::State, K::EndOfPass, no(Rule::LocalChannel)),
            (L::State, K::Postcopy, no(Rule::LocalChannel)),
            (L::State, K::Error, ok(L::State, St::PeerError)),
            (L::Go, K::Go, ok(L::Go, St::Resume)),
            (L::Go, K::DeviceState, no(Rule::LocalChannel)),
            (L::Go, K::Complete, no(Rule::LocalChannel)),
            (L::Go, K::Error, ok(L::Go, St::PeerError)),
        ];
        let granted = Capabilities::LOCAL.with(Capabilities::LOCAL_DEVICES);
        for &(at, kind, want) in table {
            let got = next_local(at, kind, granted).map_err(|e| match e {
                ProtocolError::Misplaced { got, rule } => {
                    assert_eq!(got, kind);
                    rule
                }
                e => panic!("{at:?} {kind:?}: {e}"),
            });
            assert_eq!(got, want, "{at:?} {kind:?}");
        }
        // Devices' descriptors only where this side granted them.
        let e = next_local(L::Adopted, K::LocalDevices, Capabilities::LOCAL).unwrap_err();
        assert!(
            matches!(
                e,
                ProtocolError::Misplaced {
                    rule: Rule::NeedsLocalDevices,
                    ..
                }
            ),
            "{e}"
        );
    }

    /// State chunks: only with the capability, while the passes run or among the discard
    /// lists, and never once the device state began.
    #[test]
    fn state_chunks_come_before_the_device_state_and_only_when_granted() {
        let iterative = Capabilities::ITERATIVE_STATE.with(Capabilities::POSTCOPY);
        type Row = (Main, Capabilities, Result<(Main, Step), Rule>);
        let table: &[Row] = &[
            (P0, iterative, Ok((P0, Step::Chunk))),
            (P2, iterative, Ok((P2, Step::Chunk))),
            (D2, iterative, Ok((D2, Step::Chunk))),
            (S, iterative, Err(Rule::ChunksBeforeState)),
            (SD, iterative, Err(Rule::ChunksBeforeState)),
            (P2, Capabilities::POSTCOPY, Err(Rule::NeedsIterativeState)),
            (P0, Capabilities::NONE, Err(Rule::NeedsIterativeState)),
        ];
        for &(at, granted, want) in table {
            let got = next(at, Kind::StateChunk, 0, granted).map_err(|e| match e {
                ProtocolError::Misplaced { rule, .. } => rule,
                e => panic!("{at:?}: {e}"),
            });
            assert_eq!(got, want, "{at:?} {granted:?}");
        }
    }

    #[test]
    fn a_pass_end_out_of_order_names_both_passes() {
        for (at, count) in [(P0, 2), (P2, 2), (P2, 5)] {
            let e = next(at, Kind::EndOfPass, count, Capabilities::NONE).unwrap_err();
            let Main::Passes { passes } = at else {
                unreachable!()
            };
            assert!(
                matches!(e, ProtocolError::PassOrder { got, after, data_channel: false } if got == count && after == passes),
                "{e}"
            );
            assert_eq!(
                e.to_string(),
                format!("end of pass {count} after pass {passes}")
            );
        }
    }
}
