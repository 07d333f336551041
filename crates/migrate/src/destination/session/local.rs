//! A local handover received (`Capabilities::LOCAL`, a source on this host): guest RAM's
//! descriptors come on the LocalRam record and the VMM maps them in place of its own RAM
//! (`DestinationVm::adopt_ram`) while the guest still runs at the source; then, with
//! `Capabilities::LOCAL_DEVICES`, the devices' descriptors on a LocalDevices record, handed to
//! the VMM for its devices to use from the state load on (`DestinationVm::adopt_device_fds`)
//! and answered DevicesAdopted; then the device state up to Complete, loaded with the vCPUs
//! waiting; Loaded; and the guest resumes here only on the source's Go (`order::next_local`
//! is the order). No data channel, no page.
//!
//! Invariant: the guest never runs here unless Go came, and the source never runs it once it
//! sent Go, so it runs in one process at a time. A failure before Go leaves the adopted memory
//! to the source, which resumes its guest in it; this side writes none of it and returns the
//! error, and the VMM drops this VM (`DestinationVm::adopt_ram`'s contract).
//!
//! Before the LocalRam record is read, the source's uid is read from the socket
//! (`SO_PEERCRED`, `transport/peer.rs`): a process of another uid than this VMM's, unless
//! [`IncomingControl::set_allow_uids`](crate::destination::IncomingControl::set_allow_uids)
//! names it, is refused, and no descriptor of it is taken or mapped.

#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::time::Instant;

use super::super::order::{self, LocalStep};
use super::super::progress::IncomingPhase;
use super::super::sections::Sections;
use super::{ReceiveStats, Session};
use crate::error::{ConfigError, MigrateError, ProtocolError, Side};
use crate::ram::Ram;
use crate::transport::{PeerRole, peer};
use crate::vm::DeviceFd;
use crate::wire::{self, Capabilities, Header, Kind, LocalDevice, LocalRegion};

impl Session<'_> {
    /// Receives a local handover, as the module says.
    pub(super) fn receive_locally(&mut self) -> Result<ReceiveStats, MigrateError> {
        let from = peer::check(
            self.conn.stream(),
            PeerRole::Gives,
            &self.control.allow_uids(),
        )?;
        tracing::info!(
            "taking guest RAM from pid {} (uid {}) on this host",
            from.pid,
            from.uid
        );
        let mut at = order::Local::Ram;
        let mut state = Sections::default();
        loop {
            // Descriptors may ride on the first record, and on the one after RamAdopted (the
            // source sends nothing between them, so nothing is buffered before either).
            let (h, fds) = match at {
                order::Local::Ram => self.conn.read_header_with_fds("receiving guest RAM")?,
                order::Local::Adopted if self.granted.contains(Capabilities::LOCAL_DEVICES) => self
                    .conn
                    .read_header_with_fds("receiving devices' descriptors")?,
                _ => (
                    self.conn.read_header("receiving the device state")?,
                    Vec::new(),
                ),
            };
            let c = &self.control;
            c.add(&c.bytes, wire::HEADER_SIZE as u64 + h.len);
            let (then, step) = order::next_local(at, h.kind, self.granted)?;
            if !fds.is_empty() && !matches!(step, LocalStep::Adopt | LocalStep::AdoptDevices) {
                return Err(ProtocolError::StrayDescriptors { got: h.kind }.into());
            }
            at = then;
            match step {
                LocalStep::Adopt => {
                    let payload = self.conn.read_payload(&h, "receiving guest RAM's layout")?;
                    if fds.is_empty() {
                        return Err(ConfigError::LocalNoDescriptors.into());
                    }
                    let regions = LocalRegion::decode_all(&payload, fds.len())?;
                    self.vm.adopt_ram(&regions, fds)?;
                    self.ram = Ram::new(self.vm.ram())?;
                    self.answer(Kind::RamAdopted, "answering that guest RAM is mapped")?;
                }
                LocalStep::AdoptDevices => {
                    let payload = self
                        .conn
                        .read_payload(&h, "receiving devices' descriptors")?;
                    let named = LocalDevice::decode_all(&payload, fds.len())?;
                    let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
                    let devices = named
                        .iter()
                        .map(|d| DeviceFd {
                            id: d.id,
                            instance: d.instance,
                            // Each index is named once (`decode_all`).
                            fd: fds[d.fd as usize].take().expect("named once"),
                        })
                        .collect();
                    self.vm.adopt_device_fds(devices)?;
                    self.answer(Kind::DevicesAdopted, "answering that devices took theirs")?;
                }
                LocalStep::Section => {
                    let payload = self.conn.read_payload(&h, "receiving device state")?;
                    state.add(&payload)?;
                }
                LocalStep::Load => {
                    if self.control.cancelled() {
                        return Err(MigrateError::CancelledHere);
                    }
                    self.control.update(|p| p.phase = IncomingPhase::Loading);
                    let t = Instant::now();
                    self.vm.load_state(&std::mem::take(&mut state).into_vec())?;
                    self.stats.load = t.elapsed();
                    self.answer(Kind::Loaded, "answering that the state is loaded")?;
                }
                // Go came: the guest is this side's.
                LocalStep::Resume => return self.resume_and_acknowledge(),
                LocalStep::PeerError => {
                    let p = self.conn.read_payload(&h, "reading the source's error")?;
                    return Err(MigrateError::from_peer(Side::Source, &h, &p));
                }
            }
        }
    }

    /// Writes an empty answer of `kind` on the main connection.
    fn answer(&mut self, kind: Kind, during: &'static str) -> Result<(), MigrateError> {
        self.conn.write_header(&Header::new(kind, 0, 0))?;
        self.conn.flush(during)
    }
}
