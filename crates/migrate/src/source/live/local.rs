//! The local handover: the destination shares this host, so guest RAM is handed over instead of
//! sent. Guest RAM's descriptors go first, on the LocalRam record's bytes (`SCM_RIGHTS`), and
//! the destination maps them while the guest still runs here (RamAdopted); devices'
//! descriptors follow on a LocalDevices record, where the destination takes them
//! (`SourceVm::device_fds`: a disk's image, for its devices to use once the state is
//! loaded), and it answers DevicesAdopted; then the guest
//! pauses, its state goes with Complete, and the destination loads it and says Loaded; only then
//! does Go hand the guest over, and the destination resumes it and says Resumed. No page is
//! sent, no dirty page tracked, no data channel opened.
//!
//! Invariant: the guest runs in one process at a time. Until Go is sent, the destination has
//! not run it (it waits for Go with the state loaded), so any failure (its Error, a crash, a
//! silence past the peer timeout, a cancel) resumes it here with nothing lost; once Go left,
//! this side never runs it again, whatever follows (`GuestState::HandedOver`), even the
//! destination's Error: its VMM's resume may have woken a vCPU before it failed, and the memory is one.
//! A guest then paused in both processes is the operator's to resume, by force, where it
//! should run.
//!
//! Before anything is handed over, the destination's uid is read from the socket
//! (`SO_PEERCRED`, `transport/peer.rs`): a process of another uid than this VMM's, unless
//! [`SourceParams::allow_uids`](crate::source::SourceParams::allow_uids) names it, is refused before
//! any descriptor is sent, and the guest runs on here.

#![forbid(unsafe_code)]

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use crate::error::{MigrateError, Rule, Side};
use crate::source::reader::Awaiting;
use crate::source::{GuestState, Session, ms};
use crate::transport::{PeerRole, peer};
use crate::vm::{SourceVm, VmError};
use crate::wire::{Header, Kind, LocalDevice, LocalRegion, ResumedRecord};

/// How long the source waits for each of the destination's answers without a peer timeout:
/// mapping RAM and loading the state take milliseconds, so this only bounds a hung destination.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

const MAPPED: Awaiting = Awaiting {
    during: "waiting for the destination to map guest RAM",
    expected: "RamAdopted",
};
const DEVICES: Awaiting = Awaiting {
    during: "waiting for the destination to take devices' descriptors",
    expected: "DevicesAdopted",
};
const LOADED: Awaiting = Awaiting {
    during: "waiting for the destination to load the state",
    expected: "Loaded",
};
const RESUMED: Awaiting = Awaiting {
    during: "waiting for the destination to resume the guest",
    expected: "Resumed",
};

impl Session<'_> {
    /// Hands the guest over to a destination on this host, as the module says.
    pub(super) fn hand_over_locally(&mut self, vm: &mut dyn SourceVm) -> Result<(), MigrateError> {
        let to = peer::check(
            self.peer.conn.stream(),
            PeerRole::Takes,
            &self.params.allow_uids,
        )?;
        tracing::info!(
            "handing guest RAM over to pid {} (uid {}) on this host",
            to.pid,
            to.uid
        );
        let (regions, fds) = self.ram.local_layout()?;
        let (h, payload) = LocalRegion::encode_all(&regions);
        self.peer
            .conn
            .write_record_with_fds(&h, &payload, &fds, "handing guest RAM over")?;
        drop(fds);
        self.await_answer(Kind::RamAdopted, MAPPED)?;
        self.hand_over_device_fds(vm)?;
        self.report.stats.setup_ms = ms(self.report.start.elapsed());
        self.refuse_if_cancelled()?;
        let (t0, t1) = self.pause_guest(vm)?;
        let sections = vm.save_state()?;
        let t4 = Instant::now();
        self.note_state(vm, &sections);
        self.send_device_state(&sections)?;
        self.peer
            .conn
            .write_header(&Header::new(Kind::Complete, 0, 0))?;
        self.peer.conn.flush("sending the device state")?;
        self.await_answer(Kind::Loaded, LOADED)?;
        // The last moment a cancel can take effect: after Go the guest is the destination's.
        self.refuse_if_cancelled()?;
        self.peer.conn.write_header(&Header::new(Kind::Go, 0, 0))?;
        self.peer.conn.flush("handing the guest over")?;
        self.guest = GuestState::HandedOver;
        self.control.update(|p| p.handed_over = true);
        let resumed = self
            .await_answer(Kind::Resumed, RESUMED)
            .and_then(|(h, payload)| Ok(ResumedRecord::decode(h.count, &payload)?))
            .map_err(|e| MigrateError::Unacknowledged(Box::new(e)))?;
        // No final sync and no final pages: those steps take no time.
        self.note_resumed([t0, t1, t1, t1, t4], resumed);
        Ok(())
    }

    /// Passes the VMM's devices' descriptors (`SourceVm::device_fds`) on a LocalDevices
    /// record, if the destination takes them and there are any, and waits for its
    /// DevicesAdopted: before the pause, so they cost the downtime nothing and a destination
    /// that refuses one does so while the guest runs on here. A destination that does not
    /// take them opens its devices' files itself, as before they could travel.
    fn hand_over_device_fds(&mut self, vm: &dyn SourceVm) -> Result<(), MigrateError> {
        let fds = match vm.device_fds() {
            Ok(fds) => fds,
            Err(VmError::Unsupported { .. }) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        if fds.is_empty() {
            return Ok(());
        }
        if !self.peer.agreed.local_devices {
            tracing::info!(
                "the destination does not take devices' descriptors (an older ferry): it opens \
                 its devices' files itself"
            );
            return Ok(());
        }
        let devices: Vec<LocalDevice> = (0..)
            .zip(&fds)
            .map(|(fd, d)| LocalDevice {
                id: d.id,
                instance: d.instance,
                fd,
            })
            .collect();
        let (h, payload) = LocalDevice::encode_all(&devices);
        let borrowed: Vec<_> = fds.iter().map(|d| d.fd.as_fd()).collect();
        self.peer.conn.write_record_with_fds(
            &h,
            &payload,
            &borrowed,
            "handing devices' descriptors over",
        )?;
        drop(fds);
        self.await_answer(Kind::DevicesAdopted, DEVICES)?;
        tracing::info!("handed {} device descriptor(s) over", devices.len());
        Ok(())
    }

    /// A cancel asked for (`ferry cancel`) ends the handover here, the guest resumed by the
    /// ending.
    fn refuse_if_cancelled(&self) -> Result<(), MigrateError> {
        match self.control.cancelled() {
            true => Err(MigrateError::Cancelled),
            false => Ok(()),
        }
    }

    /// Reads the destination's next record, which must be `want` (its header and payload), or
    /// its Error; within the peer timeout.
    fn await_answer(
        &mut self,
        want: Kind,
        awaiting: Awaiting,
    ) -> Result<(Header, Vec<u8>), MigrateError> {
        let during = awaiting.during;
        let within = self.params.peer_timeout.unwrap_or(ANSWER_TIMEOUT);
        let conn = &mut self.peer.conn;
        conn.stream()
            .set_read_timeout(Some(within))
            .map_err(|e| MigrateError::io(during, e))?;
        let h = conn.read_header(during)?;
        let payload = conn.read_payload(&h, during)?;
        match h.kind {
            k if k == want => Ok((h, payload)),
            Kind::Error => Err(MigrateError::from_peer(Side::Destination, &h, &payload)),
            k => Err(MigrateError::misplaced(
                k,
                Rule::Awaiting(awaiting.expected),
            )),
        }
    }
}
