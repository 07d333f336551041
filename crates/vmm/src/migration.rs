//! ferry's migration engine driving this VMM: [`ferry_migrate::SourceVm`] on a running VM and
//! [`ferry_migrate::DestinationVm`] on an [`IncomingVm`].
//!
//! Dirty pages are KVM's log (guest writes) ∪ the pages the VMM wrote itself (guest memory
//! records every VMM write, see `crate::memory`; [`GuestRam::take_writes`] hands them over
//! while a migration tracks): `fetch_dirty` below is the one place the two are merged, both
//! placed by guest address.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_migrate::destination::{IncomingPhase, IncomingProgress};
use ferry_migrate::source;
use ferry_migrate::transport::tls::DestinationTls;
use ferry_migrate::transport::{
    Address, AddressError, DEFAULT_SOCKET_MODE, Dialer, Listener, Stream,
};
use ferry_migrate::{Control, MigrateError, Phase, Progress, Tuning};

use crate::vm::handle::{ControlError, VmHandle};
use crate::vm::state::RunState;

mod adapter;
mod incoming;
mod regions;

pub use adapter::SourceAdapter;
pub use incoming::receive;

/// How long connecting to a destination may take before the API reports failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub use crate::request::MigrationRequest;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The request itself is wrong (a migration's or a snapshot's); the error names the field.
    #[error(transparent)]
    Request(#[from] crate::request::RequestError),
    #[error(
        "a migration of this VM is already running; cancel it first (ferry cancel, or PUT /migration/cancel)"
    )]
    AlreadyRunning,
    #[error("disk_copy asks to copy the VM's disk, and this VM has none; leave it out")]
    NoDiskToCopy,
    #[error("the VM is {0:?}; only a running VM can be migrated")]
    NotRunning(RunState),
    #[error(
        "this VM's RAM is not complete yet ({0}): a copy taken now would miss the pages still to come. Retry once `ferry status` no longer shows \"ram_arriving\""
    )]
    RamArriving(crate::vm::Arrival),
    #[error(
        "this VM's RAM is mapped from its snapshot file (ferry run --restore FILE --map), and a migration, local handover or snapshot finds guest memory in the VM's own memory, which a mapped VM does not use: restore the snapshot without --map (eagerly, or with --lazy) to move or snapshot its VM"
    )]
    Mapped,
    #[error(transparent)]
    Connect(#[from] MigrateError),
}

impl StartError {
    /// Whether nothing listens at the destination's address yet (the connection was refused,
    /// or the Unix socket does not exist): a destination still starting up, worth trying
    /// again shortly, unlike a refusal of the hello or a failed TLS handshake.
    pub fn not_listening(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                );
            }
            cause = e.source();
        }
        false
    }
}

/// Why new settings for a running migration were refused.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(
        "no migration is running from this VM (settings are the source's: send them to the source VM's API socket)"
    )]
    NotRunning,
    #[error(transparent)]
    Refused(#[from] MigrateError),
}

/// Why a pause, recovery or resume of a postcopy migration was refused.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error(
        "no migration here is in postcopy with recovery granted; only such a migration can be paused (start it with ferry migrate --postcopy, recovery is on by default)"
    )]
    NotInPostcopy,
    #[error(
        "no incoming migration here is postcopy-paused; ferry migrate-recover (PUT /migration/recover) is for a destination whose postcopy connection broke (GET /migration shows phase postcopy_paused)"
    )]
    DestinationNotPaused,
    #[error(
        "no migration from here is postcopy-paused; ferry migrate --resume (PUT /migration/resume) is for a source whose postcopy connection broke (GET /migration shows phase postcopy_paused)"
    )]
    SourceNotPaused,
    #[error(transparent)]
    Address(#[from] ferry_migrate::transport::AddressError),
}

impl VmHandle {
    /// Connects to the destination and starts migrating in a thread of its own; returns the
    /// control handle at once. The VM keeps running until the switchover.
    pub fn start_migration(&self, req: MigrationRequest) -> Result<Arc<Control>, StartError> {
        let mut slot = self.migration_slot()?;
        let params = req.source_params(migration_uuid())?;
        if req.disk_copy && self.0.disk.is_none() {
            return Err(StartError::NoDiskToCopy);
        }
        let tls = req.source_tls()?;
        let dialer = address_of(&req.to)
            .and_then(|a| Ok(Dialer::new(a, tls.clone())?))
            .map_err(MigrateError::from)?;
        let stream = connect(&dialer)?;
        *self.0.migration_tls.lock().unwrap() = tls;
        let control = Arc::new(Control::with_events(self.0.events.clone()));
        *slot = Some(control.clone());
        // Whoever read how an earlier migration ended has not read this one's.
        self.0
            .ending_read
            .store(false, std::sync::atomic::Ordering::Release);
        let mut adapter = match req.disk_copy {
            true => self.migration_source_copying_disk(),
            false => self.migration_source(),
        };
        let thread_control = control.clone();
        std::thread::Builder::new()
            .name("migration".into())
            .spawn(move || {
                let connect = || connect(&dialer).map_err(std::io::Error::other);
                if let Err(e) =
                    source::migrate(&mut adapter, stream, &connect, &params, &thread_control)
                {
                    tracing::warn!("migration failed: {e}");
                }
            })
            .map_err(|e| MigrateError::io("starting the migration thread", e))?;
        Ok(control)
    }

    /// The migration's slot, for a migration, a local handover or a snapshot to start in:
    /// refused while one runs, when the VM does not run, or while its RAM is still arriving
    /// (`vm/holds.rs`).
    pub(crate) fn migration_slot(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, Option<Arc<Control>>>, StartError> {
        let slot = self.0.migration.lock().unwrap();
        if slot
            .as_ref()
            .is_some_and(|c| c.progress().phase.is_active())
        {
            return Err(StartError::AlreadyRunning);
        }
        match self.state() {
            RunState::Running => {}
            s => return Err(StartError::NotRunning(s)),
        }
        if self.0.ram.is_mapped() {
            return Err(StartError::Mapped);
        }
        match self.ram_arriving() {
            Some(from) => Err(StartError::RamArriving(from)),
            None => Ok(slot),
        }
    }

    /// What this VM's RAM is still arriving from, if anything. An incoming migration that
    /// completed has placed every page in the moment it says so, a little before its receive
    /// lets its hold go: a control plane that migrates the guest on at the completion it was
    /// told of is not refused.
    pub(crate) fn ram_arriving(&self) -> Option<crate::vm::Arrival> {
        let completed = || {
            self.0
                .incoming
                .as_ref()
                .is_some_and(|c| c.progress().phase == IncomingPhase::Completed)
        };
        self.0
            .holds
            .still_arriving_but(|a| a == crate::vm::Arrival::IncomingMigration && completed())
    }

    /// Records how the last migration away from this VMM ended, on the VM it then made to
    /// receive the guest again; `GET /migration` shows it as `previous` until this VM migrates.
    pub fn set_previous_migration(&self, progress: Progress) {
        *self.0.previous_migration.lock().unwrap() = Some(progress);
    }

    /// Says that once a migration takes the guest away, this VMM waits for its return on
    /// `at` (`ferry run --then-incoming`): `GET /migration` tells a follower so from the start,
    /// so that it need not race the VMM's move to that wait.
    pub fn set_then_incoming(&self, at: &str) {
        *self.0.then_incoming.lock().unwrap() = Some(at.to_string());
    }

    /// See [`VmHandle::set_then_incoming`].
    pub fn then_incoming(&self) -> Option<String> {
        self.0.then_incoming.lock().unwrap().clone()
    }

    /// See [`VmHandle::set_previous_migration`].
    pub fn previous_migration(&self) -> Option<Progress> {
        self.0.previous_migration.lock().unwrap().clone()
    }

    /// The log of this VM's migration events, both sides (`GET /events`).
    pub fn events(&self) -> Arc<ferry_migrate::events::EventLog> {
        self.0.events.clone()
    }

    /// The current or last migration's progress.
    pub fn migration(&self) -> Option<Progress> {
        self.0
            .migration
            .lock()
            .unwrap()
            .as_ref()
            .map(|c| c.progress())
    }

    /// Records that the API answered with the migration's end (`progress` is what it sent).
    pub fn note_read(&self, progress: &Progress) {
        if !progress.phase.is_active() {
            self.0
                .ending_read
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Waits until the API told someone how the migration ended (`ferry migrate` follows it,
    /// looking every 200 ms), at most `within`: a process that exits once it handed its guest
    /// over would otherwise leave its follower with no answer.
    pub fn wait_ending_read(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while !self
            .0
            .ending_read
            .load(std::sync::atomic::Ordering::Acquire)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// On a migration destination: the incoming migration's progress.
    pub fn incoming(&self) -> Option<IncomingProgress> {
        self.0.incoming.as_ref().map(|c| {
            let mut p = c.progress();
            if let Some(preparing) = &mut p.preparing {
                preparing.done_bytes = self.0.ram.populated_bytes();
            }
            p
        })
    }

    /// Changes settings of the migration running from this VM, at its next step (see
    /// [`Tuning`]).
    pub fn tune_migration(&self, tuning: Tuning) -> Result<(), TuneError> {
        match self.0.migration.lock().unwrap().as_ref() {
            Some(c) if c.progress().phase.is_active() => Ok(c.tune(tuning)?),
            _ => Err(TuneError::NotRunning),
        }
    }

    /// Asks a migration in precopy that has postcopy enabled to switch to it at the end of
    /// the current pass; false when there is none that can.
    pub fn start_postcopy(&self) -> bool {
        match self.0.migration.lock().unwrap().as_ref() {
            Some(c) if matches!(c.progress().phase, Phase::Setup | Phase::Precopy) => {
                c.start_postcopy();
                true
            }
            _ => false,
        }
    }

    /// Breaks the connections of a migration in postcopy, as a network failure would (QEMU's
    /// migrate-pause): on a source or a destination, both sides go to postcopy-paused.
    pub fn pause_migration(&self) -> Result<(), RecoveryError> {
        let source = self.0.migration.lock().unwrap().clone();
        if source.is_some_and(|c| c.pause_postcopy())
            || self.0.incoming.as_ref().is_some_and(|c| c.pause_postcopy())
        {
            return Ok(());
        }
        Err(RecoveryError::NotInPostcopy)
    }

    /// On a destination in postcopy-paused: listens on `listen` (`tcp:HOST:PORT`,
    /// `unix:PATH` or a bare `HOST:PORT`) for the source's recovery; returns where it
    /// listens (the port chosen for `:0`).
    pub fn recover_migration(&self, listen: &str) -> Result<String, RecoveryError> {
        let control = self
            .0
            .incoming
            .as_ref()
            .filter(|c| c.progress().phase == IncomingPhase::PostcopyPaused)
            .ok_or(RecoveryError::DestinationNotPaused)?;
        let tls = self.0.incoming_tls.lock().unwrap().clone();
        let listener = listen_on(address_of(listen)?, tls, DEFAULT_SOCKET_MODE)?;
        let local = listener.local();
        control.recover_on(listener);
        Ok(local)
    }

    /// On a source in postcopy-paused: reconnects to a destination that listens for the
    /// recovery at `to` (after [`VmHandle::recover_migration`] there).
    pub fn resume_migration(&self, to: &str) -> Result<(), RecoveryError> {
        let slot = self.0.migration.lock().unwrap();
        let control = slot
            .as_ref()
            .filter(|c| c.progress().phase == Phase::PostcopyPaused)
            .ok_or(RecoveryError::SourceNotPaused)?;
        let tls = self.0.migration_tls.lock().unwrap().clone();
        control.resume_postcopy(Dialer::new(address_of(to)?, tls).map_err(AddressError::from)?);
        Ok(())
    }

    /// Resumes the guest here. A guest whose migration handed it over (Complete or Postcopy
    /// sent: it may run on the destination) is refused unless `force`, since running it on
    /// both sides corrupts whatever it writes outside its RAM; forced, a migration waiting in
    /// postcopy-paused is given up first (it would otherwise send pages of a guest that runs
    /// again here).
    pub fn resume_guest(&self, force: bool) -> Result<(), ResumeError> {
        if let Some(c) = self.0.migration.lock().unwrap().as_ref() {
            let p = c.progress();
            if p.handed_over && !force {
                return Err(ResumeError::HandedOver);
            }
            if p.handed_over && force {
                tracing::warn!("resuming a guest that was handed over, by force");
                c.give_up();
            }
        }
        self.resume().map_err(ResumeError::Control)
    }

    /// Asks a running migration to stop (on a source in precopy, or on a destination before
    /// the guest was resumed); false when there is none it can stop.
    pub fn cancel_migration(&self) -> bool {
        match self.0.migration.lock().unwrap().as_ref() {
            Some(c) if c.progress().is_cancellable() => {
                c.cancel();
                return true;
            }
            _ => {}
        }
        match &self.0.incoming {
            Some(c)
                if matches!(
                    c.progress().phase,
                    IncomingPhase::Preparing
                        | IncomingPhase::Waiting
                        | IncomingPhase::Handshake
                        | IncomingPhase::Precopy
                ) =>
            {
                c.cancel();
                true
            }
            _ => false,
        }
    }
}

/// `tcp:HOST:PORT`, `unix:PATH`, or a bare `HOST:PORT` (the address's own syntax).
fn address_of(to: &str) -> Result<Address, ferry_migrate::transport::AddressError> {
    to.parse()
}

fn connect(to: &Dialer) -> Result<Box<dyn Stream>, MigrateError> {
    Ok(to.connect(CONNECT_TIMEOUT)?)
}

/// A listener on `at` for a migration's connections, through `tls` when given; a Unix
/// socket with permission bits `socket_mode`.
fn listen_on(
    at: Address,
    tls: Option<Arc<DestinationTls>>,
    socket_mode: u32,
) -> Result<Box<dyn Listener>, AddressError> {
    let plain = at.listen_with_mode(socket_mode)?;
    Ok(match tls {
        Some(tls) => tls.listener(plain),
        None => plain,
    })
}

impl VmHandle {
    /// On a migration destination: listens on `at` for the source (`tcp:HOST:PORT` or
    /// `unix:PATH`, a socket of permission bits `socket_mode` from its first instant, never
    /// made over anything but a stale socket: `ferry_migrate::transport::bind_unix`), every
    /// connection through `tls` when given. A postcopy recovery's listener
    /// ([`VmHandle::recover_migration`]) later uses the same TLS, and a Unix socket there
    /// [`DEFAULT_SOCKET_MODE`].
    pub fn listen_incoming(
        &self,
        at: &Address,
        tls: Option<Arc<DestinationTls>>,
        socket_mode: u32,
    ) -> Result<Box<dyn Listener>, AddressError> {
        *self.0.incoming_tls.lock().unwrap() = tls.clone();
        listen_on(at.clone(), tls, socket_mode)
    }
}

/// 16 bytes that differ between migrations: time and process id, mixed.
pub(crate) fn migration_uuid() -> [u8; 16] {
    let t = crate::devices::telemetry::host_monotonic_ns();
    let mut u = [0u8; 16];
    u[..8].copy_from_slice(&t.to_le_bytes());
    u[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    u[12..].copy_from_slice(&(t.rotate_left(29) as u32 ^ 0x5f3759df).to_le_bytes());
    u
}

/// Why `PUT /vm/resume` refused.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error(
        "the migration handed this guest over to the destination, where it may be running: resuming it here too could run it twice and corrupt what it writes outside its RAM (after a local handover, its RAM itself, which both processes map); if you know the destination does not run it, ferry resume --risk-running-twice (PUT /vm/resume {{\"force\": true}})"
    )]
    HandedOver,
    #[error(transparent)]
    Control(ControlError),
}
