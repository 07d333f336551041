//! When the NIC last opened its gate and what it did first afterwards, on the host's
//! `CLOCK_MONOTONIC` (the telemetry's clock, so a bench lines them up with the guest's pause):
//! the first receive turn, the first frame given to the guest (and on which thread), the first
//! frame the guest sent. The steps between a resume and the first answer a peer sees, shown in
//! `GET /vm`; not migrated (they are this process's).

#![forbid(unsafe_code)]

use serde::Serialize;

use crate::devices::telemetry::host_monotonic_ns;

/// The first steps since the gate last opened (ns, `None`: not yet).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OpenMarks {
    pub opened_ns: Option<u64>,
    /// The first receive turn with the gate open, whatever it found.
    pub first_turn_ns: Option<u64>,
    /// The first frame put in a guest buffer, and the thread that put it (`net-rx`, a vCPU's,
    /// or the one that opened the gate).
    pub first_rx_ns: Option<u64>,
    pub first_rx_on: Option<String>,
    /// The first frame the guest sent that went out on the tap.
    pub first_tx_ns: Option<u64>,
}

impl OpenMarks {
    /// The gate opened: the marks start again.
    pub(super) fn opened() -> OpenMarks {
        OpenMarks {
            opened_ns: Some(host_monotonic_ns()),
            ..OpenMarks::default()
        }
    }

    pub(super) fn turn(&mut self) {
        self.first_turn_ns.get_or_insert_with(host_monotonic_ns);
    }

    pub(super) fn received(&mut self) {
        if self.first_rx_ns.is_none() {
            self.first_rx_ns = Some(host_monotonic_ns());
            self.first_rx_on = std::thread::current().name().map(String::from);
        }
    }

    pub(super) fn sent(&mut self) {
        self.first_tx_ns.get_or_insert_with(host_monotonic_ns);
    }
}
