//! What the destination granted in its answer to the hello, as one value the session reads:
//! which optional parts of the protocol this migration uses (docs/protocol.md,
//! "Capabilities"), and the page unit its postcopy works in. Set once by the handshake; the
//! phases only read it.

#![forbid(unsafe_code)]

use crate::error::ProtocolError;
use crate::wire::{self, Capabilities, Hello};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Agreement {
    /// Received records: the source sees what the destination took in.
    pub progress: bool,
    /// Postcopy (discard lists, page requests, Done).
    pub postcopy: bool,
    /// A preempt connection for requested pages.
    pub preempt: bool,
    /// Postcopy recovery: a broken connection in postcopy pauses both sides.
    pub recover: bool,
    /// Error records carry a code (a cancel is told from a failure).
    pub error_codes: bool,
    /// Requested pages go on the main connection once the guest resumed there (granted
    /// without a preempt connection, on 4 KiB pages).
    pub main_pages: bool,
    /// Wire pages per host page of the destination's postcopy (1, or 512 for 2 MiB pages):
    /// postcopy discards, sends and serves whole units.
    pub postcopy_unit: u64,
    /// A local handover: guest RAM's descriptors instead of its pages.
    pub local: bool,
    /// In a local handover, devices' descriptors go too (a LocalDevices record).
    pub local_devices: bool,
    /// Iterative device state: StateChunk records while the guest runs, and the
    /// destination's StateReady before a switchover.
    pub iterative: bool,
}

impl Agreement {
    /// Before the handshake: nothing granted.
    pub const NONE: Agreement = Agreement {
        progress: false,
        postcopy: false,
        preempt: false,
        recover: false,
        error_codes: false,
        main_pages: false,
        postcopy_unit: 1,
        local: false,
        local_devices: false,
        iterative: false,
    };

    /// The destination's accepting answer `reply`: what it granted, or why the grant cannot be
    /// used (a postcopy unit larger than a record).
    pub fn from_reply(reply: &Hello) -> Result<Agreement, ProtocolError> {
        let granted = |c| reply.capabilities.contains(c);
        let postcopy = granted(Capabilities::POSTCOPY);
        let postcopy_unit = reply.postcopy_unit_pages();
        if postcopy && postcopy_unit > u64::from(wire::MAX_PAGES_PER_RECORD) {
            return Err(ProtocolError::UnitTooLarge {
                pages: postcopy_unit,
            });
        }
        let preempt = granted(Capabilities::PREEMPT);
        Ok(Agreement {
            progress: granted(Capabilities::PROGRESS),
            postcopy,
            preempt,
            recover: granted(Capabilities::RECOVER),
            error_codes: granted(Capabilities::ERROR_CODES),
            main_pages: granted(Capabilities::MAIN_PAGES) && !preempt && postcopy_unit == 1,
            postcopy_unit,
            local: granted(Capabilities::LOCAL),
            local_devices: granted(Capabilities::LOCAL.with(Capabilities::LOCAL_DEVICES)),
            iterative: granted(Capabilities::ITERATIVE_STATE),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Role;

    fn reply(capabilities: Capabilities, postcopy_page_shift: u8) -> Hello {
        Hello {
            role: Role::Main,
            channel: crate::wire::MAIN_CHANNEL,
            uuid: [1; 16],
            memory_size: 1 << 30,
            status: 0,
            channels: 2,
            capabilities,
            postcopy_page_shift,
        }
    }

    #[test]
    fn a_grant_reads_as_what_the_session_may_use() {
        let none = Agreement::from_reply(&reply(Capabilities::NONE, 0)).unwrap();
        assert_eq!(none, Agreement::NONE);
        let pc = Capabilities(Capabilities::POSTCOPY.0 | Capabilities::MAIN_PAGES.0);
        let a = Agreement::from_reply(&reply(pc, 0)).unwrap();
        assert!(a.postcopy && a.main_pages && !a.preempt && a.postcopy_unit == 1);
        // With a preempt connection, requested pages go there, not on the main connection.
        let pre = Capabilities(pc.0 | Capabilities::PREEMPT.0);
        let a = Agreement::from_reply(&reply(pre, 0)).unwrap();
        assert!(a.preempt && !a.main_pages);
        // 2 MiB host pages: whole units of 512 wire pages, never on the main connection.
        let a = Agreement::from_reply(&reply(pc, 21)).unwrap();
        assert!(a.postcopy_unit == 512 && !a.main_pages, "{a:?}");
        // Devices' descriptors only within a local handover.
        let a = Agreement::from_reply(&reply(Capabilities::LOCAL_DEVICES, 0)).unwrap();
        assert!(!a.local && !a.local_devices);
        let local = Capabilities::LOCAL.with(Capabilities::LOCAL_DEVICES);
        let a = Agreement::from_reply(&reply(local, 0)).unwrap();
        assert!(a.local && a.local_devices);
        // A unit no record can carry.
        let e = Agreement::from_reply(&reply(pc, 40)).unwrap_err();
        assert!(matches!(e, ProtocolError::UnitTooLarge { .. }), "{e}");
    }
}
