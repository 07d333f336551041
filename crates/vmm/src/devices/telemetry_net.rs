//! The guest's network workload (`net=`) as the telemetry shows it: the counters of its latest
//! [`Kind::Net`](ferry_guest_abi::report::Kind::Net) report, which the boot vCPU sends after
//! every heartbeat while the workload runs. They are cumulative in the guest, so the latest
//! report is the whole story and a lost one loses nothing. What each counts is
//! `ferry_guest_abi::report::net`'s to say.

use ferry_guest_abi::report::{self, NetCounters};
use serde::Serialize;

/// The network workload's counters, in frames.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuestNet {
    /// Frames the guest took from its receive queue, whatever they held.
    pub frames_received: u64,
    /// Echoes it sent, one per echo request.
    pub echoes_sent: u64,
    pub arp_replies: u64,
    /// Request numbers skipped (a request past the last seen + 1 adds those in between).
    pub seq_gaps: u64,
    /// Requests at or below the last number seen: given twice, or late. Each was answered.
    pub duplicates: u64,
    /// Frames not for the guest, or malformed.
    pub ignored: u64,
    /// Frames it could not send because the device held every transmit buffer.
    pub tx_errors: u64,
    /// The highest request number seen; 0 before the first.
    pub last_seq: u64,
}

impl GuestNet {
    /// The counters of a Net report's detail words.
    pub fn from_detail(d: &[u64; report::DETAIL_WORDS]) -> GuestNet {
        let c = NetCounters::from_detail(d);
        GuestNet {
            frames_received: c.frames_received,
            echoes_sent: c.echoes_sent,
            arp_replies: c.arp_replies,
            seq_gaps: c.seq_gaps,
            duplicates: c.duplicates,
            ignored: c.ignored,
            tx_errors: c.tx_errors,
            last_seq: c.last_seq,
        }
    }

    /// Whether the guest saw every number once and in order and sent every answer.
    pub fn clean(&self) -> bool {
        self.seq_gaps == 0 && self.duplicates == 0 && self.tx_errors == 0
    }
}

#[cfg(test)]
mod tests {
    use ferry_guest_abi::report::{Kind, Report};

    use super::*;

    #[test]
    fn an_encoded_net_report_decodes_to_its_counters() {
        let sent = NetCounters {
            frames_received: 1_003,
            echoes_sent: 1_000,
            arp_replies: 2,
            seq_gaps: 4,
            duplicates: 1,
            ignored: 1,
            tx_errors: 0,
            last_seq: 1_004,
        };
        let r = Report {
            kind: Kind::Net as u16,
            detail: sent.to_detail(),
            ..Report::default()
        };
        let back = Report::from_bytes(&r.to_bytes()).unwrap();
        assert_eq!(back.kind(), Kind::Net);
        let net = GuestNet::from_detail(&back.detail);
        assert_eq!(
            net,
            GuestNet {
                frames_received: 1_003,
                echoes_sent: 1_000,
                arp_replies: 2,
                seq_gaps: 4,
                duplicates: 1,
                ignored: 1,
                tx_errors: 0,
                last_seq: 1_004,
            }
        );
        assert!(!net.clean());
        assert!(GuestNet::from_detail(&NetCounters::default().to_detail()).clean());
        let json = serde_json::to_value(net).unwrap();
        assert_eq!(json["echoes_sent"], 1_000);
        assert_eq!(json["last_seq"], 1_004);
    }
}
