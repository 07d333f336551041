//! The start of a migration to a live destination: the hello and the VM's configuration on
//! the main connection, what is asked for and what the answer grants, the check of who
//! listens on a Unix socket, and the run of every phase in order.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::error::{ConfigError, MigrateError, ProtocolError};
use crate::source::ack_state::AckUse;
use crate::source::agreement::Agreement;
use crate::source::live::Live;
use crate::source::reader::{InboundReader, Opening};
use crate::source::{Ending, Mode, Preempt, Session};
use crate::transport::Stream;
use crate::vm::{SourceVm, VmError};
use crate::wire::{self, Capabilities, Header, Hello, Kind, Role};

/// The protocol features this source always asks for: progress acknowledgements, so that it
/// decides the switchover on what the destination has taken in, and error codes, so that a
/// cancel reads as one on both sides. Postcopy is asked for when
/// [`SourceParams::mode`](crate::source::SourceParams::mode) is [`Mode::Postcopy`].
const REQUESTED: Capabilities =
    Capabilities(Capabilities::PROGRESS.0 | Capabilities::ERROR_CODES.0);
/// Longest the source waits for the answer to its hello: a destination answers at once (its
/// VMM checks the guest's configuration first, in milliseconds), so a peer silent this long is
/// something else listening there.
const HELLO_WAIT: Duration = Duration::from_secs(10);
/// How often the hello's wait looks for a cancel: well under what a control plane would notice
/// (its own polls are hundreds of ms apart), and a look is one atomic load.
const CANCEL_LOOK: Duration = Duration::from_millis(10);

impl Session<'_, Live> {
    /// With the preempt connection, lets the main connection's reader queue requested pages
    /// on it itself (`forward.rs`); taken back when the pool finishes its sender.
    pub(super) fn lend_lane(&self) {
        let unit = self.peer.agreed.postcopy_unit;
        if let (Some(reader), Some(lane)) =
            (&self.peer.acks.reader, self.peer.pool.lane(&self.ram, unit))
        {
            reader.set_lane(lane);
        }
    }

    /// Where postcopy's requested pages go, as asked and agreed.
    pub(super) fn preempt(&self) -> Preempt {
        match self.params.postcopy() {
            Some(p) if self.peer.agreed.preempt => p.preempt,
            _ => Preempt::Off,
        }
    }

    /// Every phase in order; the first failure ends the run.
    pub(in crate::source) fn run(
        &mut self,
        vm: &mut dyn SourceVm,
        connect: &dyn Fn() -> std::io::Result<Box<dyn Stream>>,
    ) -> Result<(), MigrateError> {
        let config = match vm.config() {
            Ok(c) => Some(c),
            Err(VmError::Unsupported { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        self.handshake(config.as_deref())?;
        // Over a Unix socket the kernel says who listens: guest RAM, copied or handed over,
        // goes only to a process of this VMM's uid or one allowed (`transport/peer.rs`),
        // checked before any page or descriptor (the hello carries none). TCP and TLS streams
        // cannot say; TLS authenticates its peer itself.
        if let Ok(listener) = self.peer.conn.stream().peer_credentials() {
            crate::transport::peer::judge(
                listener,
                crate::transport::PeerRole::Takes,
                crate::transport::peer::own_uid(),
                &self.params.allow_uids,
            )?;
        }
        if self.peer.agreed.local {
            return self.hand_over_locally(vm);
        }
        let preempt = self.preempt();
        self.peer
            .pool
            .open(connect, &self.params, &self.ram, self.hooks, preempt)?;
        self.lend_lane();
        self.start_tracking(vm)?;
        match self.precopy(vm)? {
            Ending::Switchover(last) => self.switchover(vm, last + 1),
            Ending::Postcopy(last, trigger) => self.postcopy(vm, last, trigger),
        }
    }

    /// What to ask the destination for.
    fn requested(&self) -> Capabilities {
        let p = &self.params;
        let mut c = REQUESTED;
        if self.peer.config_sent {
            c = c.with(Capabilities::CONFIG);
        }
        if p.checksum_pages {
            c = c.with(Capabilities::CHECKSUM_PAGES);
        }
        if p.compression.is_on() {
            c = c.with(Capabilities::COMPRESS);
        }
        // Iterative device state goes with any copy of the guest (a destination grants it
        // only where its VMM takes chunks; a source VM without such state sends none).
        if !p.is_local() {
            c = c.with(Capabilities::ITERATIVE_STATE);
        }
        match &p.mode {
            Mode::Precopy => {}
            // Devices' descriptors too, where the destination's VMM takes them (else it opens
            // its devices' files itself, as an older ferry does).
            Mode::Local => {
                c = c
                    .with(Capabilities::LOCAL)
                    .with(Capabilities::LOCAL_DEVICES)
            }
            Mode::Postcopy(postcopy) => {
                c = c.with(Capabilities::POSTCOPY);
                if postcopy.preempt.is_on() {
                    c = c.with(Capabilities::PREEMPT);
                } else {
                    c = c.with(Capabilities::MAIN_PAGES);
                }
                if postcopy.recover {
                    c = c.with(Capabilities::RECOVER);
                }
            }
        }
        c
    }

    /// The hello of a main connection (`Main`, or `Resume` for a postcopy recovery).
    pub(super) fn main_hello(&self, role: Role) -> Hello {
        Hello {
            role,
            channel: wire::MAIN_CHANNEL,
            uuid: self.params.uuid,
            memory_size: self.ram.size(),
            status: 0,
            channels: self.params.channels,
            // A recovery's hello has no configuration after it: that was checked at the start.
            capabilities: match role {
                Role::Resume => Capabilities(self.requested().0 & !Capabilities::CONFIG.0),
                _ => self.requested(),
            },
            postcopy_page_shift: 0,
        }
    }

    /// Reads the destination's answer to the hello within `within`. A cancel asked meanwhile
    /// ends the wait within [`CANCEL_LOOK`]: a watcher shuts the connection down under the
    /// read, and the failed read is the cancel (a control plane's cancel in setup is not held
    /// for the whole wait; issue 55).
    fn await_hello(&mut self, within: Duration) -> Result<Hello, MigrateError> {
        let closer = self
            .peer
            .conn
            .stream()
            .try_clone_stream()
            .map_err(|e| MigrateError::io("watching the hello's wait for a cancel", e))?;
        let (done, control) = (AtomicBool::new(false), self.control);
        let done = &done;
        let conn = &mut self.peer.conn;
        let read = std::thread::scope(|s| {
            s.spawn(move || {
                while !done.load(Ordering::Acquire) {
                    if control.cancelled() {
                        let _ = closer.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    std::thread::sleep(CANCEL_LOOK);
                }
            });
            let read = conn.read_hello(Some(within));
            done.store(true, Ordering::Release);
            read
        });
        match read {
            Err(_) if self.control.cancelled() => Err(MigrateError::Cancelled),
            read => read,
        }
    }

    /// Greets the destination on the main connection, with the VM's configuration when the
    /// VMM describes it; a refusal names the cause and the fix.
    fn handshake(&mut self, config: Option<&[u8]>) -> Result<(), MigrateError> {
        self.peer.config_sent = config.is_some();
        self.peer.conn.write_hello(&self.main_hello(Role::Main))?;
        if let Some(config) = config {
            if config.len() as u64 > wire::MAX_CONFIG_BYTES {
                return Err(ConfigError::VmConfigTooLarge {
                    bytes: config.len() as u64,
                    max: wire::MAX_CONFIG_BYTES,
                }
                .into());
            }
            let h = Header::new(Kind::VmConfig, 0, config.len() as u64);
            self.peer.conn.write_record(&h, config)?;
            self.peer.conn.flush("sending the VM's configuration")?;
        }
        let within = self
            .params
            .peer_timeout
            .map_or(HELLO_WAIT, |t| t.min(HELLO_WAIT));
        let reply = self.await_hello(within).map_err(|e| match e {
            MigrateError::Stalled { .. } => MigrateError::Stalled {
                during: "waiting for the answer to the hello (a ferry destination answers at once: is --to its --incoming address, and not, say, its API socket?)",
            },
            e => e,
        })?;
        if !reply.capabilities.is_subset(self.requested()) {
            return Err(ProtocolError::NotAsked {
                bits: reply.capabilities.0,
            }
            .into());
        }
        if reply.status != wire::Refusal::Accepted as u32 {
            return Err(MigrateError::Refused(match wire::Refusal::try_from(reply.status) {
                Ok(wire::Refusal::MemorySize) => crate::error::memory_sizes_differ(self.ram.size(), reply.memory_size),
                Ok(wire::Refusal::Busy) => "the destination is busy with another migration; start another `ferry run --incoming` for this one".into(),
                Ok(wire::Refusal::Config) => self
                    .peer
                    .conn
                    .peer_error()
                    .unwrap_or_else(|| "the destination VM is configured differently".into()),
                _ => format!("status {}", reply.status),
            }));
        }
        let agreed = Agreement::from_reply(&reply)?;
        if agreed.progress {
            self.peer.acks.use_ = AckUse::Live;
        }
        if self.params.checksum_pages && !reply.capabilities.contains(Capabilities::CHECKSUM_PAGES)
        {
            return Err(MigrateError::Refused(
                "the destination does not check page checksums (an older ferry); migrate without --checksum pages".into(),
            ));
        }
        if self.params.compression.is_on() && !reply.capabilities.contains(Capabilities::COMPRESS) {
            if let crate::Compression::Zstd { .. } = self.params.compression {
                return Err(MigrateError::Refused(
                    "the destination does not decompress pages (an older ferry); migrate without --compression, or with --compression auto".into(),
                ));
            }
            // `auto` is a wish, not a need: without the destination's grant, pages go raw.
            self.params.compression = crate::Compression::Off;
        }
        if self.params.postcopy().is_some() && !agreed.postcopy {
            return Err(MigrateError::Refused(
                "the destination does not offer postcopy (its log says why: userfaultfd not available to it, guest RAM on huge pages, or an older ferry); migrate without --postcopy".into(),
            ));
        }
        self.peer.agreed = agreed;
        self.peer.conn.error_codes = agreed.error_codes;
        self.control.update(|p| p.postcopy_recover = agreed.recover);
        if self.params.postcopy().is_some_and(|p| p.preempt.is_on()) && !agreed.preempt {
            return Err(MigrateError::Refused(
                "the destination does not offer postcopy's preempt connection (an older ferry); migrate without --postcopy-preempt".into(),
            ));
        }
        if self.params.is_local() && !agreed.local {
            return Err(ConfigError::LocalNotGranted.into());
        }
        // A local handover reads its few answers in turn on this thread (`local.rs`).
        if !agreed.local {
            self.peer.acks.reader = Some(InboundReader::start(
                &mut self.peer.conn,
                agreed,
                Opening::Handshake,
            )?);
        }
        Ok(())
    }
}
