//! The live destination a migration talks to: the main connection, the data channels, what the
//! handshake agreed, and what comes back on the main connection (`reader.rs`, folded into
//! `Acks`). The session's phases reach it as `self.peer`; the transfer core asks it, as any
//! [`Target`], what was acknowledged and whether the destination said something that ends the
//! migration.
//!
//! What a session does only with a live destination lives here, one phase to a file:
//! `handshake.rs` (the hello, the grant, and the run of every phase), `handover.rs` (the
//! device state, Complete and the wait for Resumed), `postcopy.rs` (the switch, the discards,
//! the requests and the background push), `shared_main.rs` (requested pages on the main
//! connection without a preempt connection), `recover.rs` (a postcopy recovery) and
//! `local.rs` (the local handover of guest RAM's descriptors).

#![forbid(unsafe_code)]

mod handover;
mod handshake;
mod local;
mod postcopy;
mod recover;
mod shared_main;

use std::sync::Arc;
use std::time::Duration;

use super::ack_state::Acks;
use super::agreement::Agreement;
use super::forward::MainOut;
use super::pool::ChannelPool;
use super::readahead::Readahead;
use super::reader::{Inbound, InboundReader};
use super::target::Target;
use crate::conn::Conn;
use crate::error::{MigrateError, Rule};
use crate::stats::MigrationStats;
use crate::vm::Section;
use crate::wire::{Header, Kind};

/// How long a failed write waits for the destination's explanation on the main connection.
const PEER_ERROR_WAIT: Duration = Duration::from_millis(200);

/// A live destination's side of a session.
pub(super) struct Live {
    pub(super) conn: Conn,
    /// The reader of the main connection and what the destination acknowledged.
    pub(super) acks: Acks,
    pub(super) pool: ChannelPool,
    /// What the destination granted (the handshake sets it).
    pub(super) agreed: Agreement,
    /// Bytes written on main connections that a postcopy recovery replaced (the data
    /// channels' count spans recoveries).
    pub(super) earlier_bytes: u64,
    /// Postcopy's readahead after a vCPU's requests (`readahead.rs`).
    pub(super) readahead: Readahead,
    /// The VM's configuration went with the hello (so CONFIG is asked for).
    pub(super) config_sent: bool,
    /// In postcopy without the preempt connection, the main connection's writer the reader
    /// shares (`forward.rs`).
    pub(super) main_out: Option<Arc<MainOut>>,
}

impl Live {
    pub(super) fn new(conn: Conn) -> Live {
        Live {
            conn,
            acks: Acks::default(),
            pool: ChannelPool::default(),
            agreed: Agreement::NONE,
            earlier_bytes: 0,
            readahead: Readahead::default(),
            config_sent: false,
            main_out: None,
        }
    }
}

impl Target for Live {
    fn agreement(&self) -> Agreement {
        self.agreed
    }

    fn queue_pages(&mut self, gpas: Vec<u64>) -> Result<(), MigrateError> {
        self.pool.queue_pages(gpas)
    }

    /// On every data channel, then on the main connection (the destination's barrier counts
    /// on both).
    fn end_pass(&mut self, pass: u32) -> Result<(), MigrateError> {
        self.pool.end_pass(pass)?;
        self.conn
            .write_header(&Header::new(Kind::EndOfPass, pass, 0))?;
        self.conn.flush("ending a pass")
    }

    fn pending_pages(&self) -> u64 {
        self.pool.pending_pages()
    }

    fn bytes_written(&self) -> u64 {
        self.conn.bytes_written + self.pool.bytes_written() + self.earlier_bytes
    }

    fn data_totals(&self) -> (u64, u64) {
        self.pool.data_totals()
    }

    fn max_bandwidth_changed(&mut self, max: Option<u64>) {
        self.pool.max_bandwidth_changed(max);
    }

    fn close_pages(&mut self, stats: &mut MigrationStats) -> Result<(), MigrateError> {
        self.pool.close(stats)
    }

    fn abandon(&mut self) {
        self.pool.abandon();
    }

    fn send_ending(&mut self, e: &MigrateError) {
        self.conn.send_ending(e);
    }

    /// On the reader thread once it runs; before that, on the connection.
    fn peer_error(&mut self) -> Option<String> {
        match &self.acks.reader {
            Some(reader) => match reader.wait(PEER_ERROR_WAIT) {
                Some(Ok(Inbound::Error(message))) => Some(message),
                _ => None,
            },
            None => self.conn.peer_error(),
        }
    }

    fn send_state_chunk(&mut self, chunk: &Section) -> Result<(), MigrateError> {
        self.conn.write_sectioned(
            Kind::StateChunk,
            chunk.header(),
            &chunk.data,
            "sending a state chunk",
        )
    }

    fn state_ready(&self) -> bool {
        self.acks
            .reader
            .as_ref()
            .is_some_and(InboundReader::state_ready)
    }

    fn acks(&self) -> Option<&Acks> {
        Some(&self.acks)
    }

    fn acks_mut(&mut self) -> Option<&mut Acks> {
        Some(&mut self.acks)
    }

    fn heard(&mut self) -> Result<(), MigrateError> {
        match self.acks.reader.as_ref().and_then(InboundReader::poll) {
            None => Ok(()),
            Some(Ok(Inbound::Error(message))) => Err(MigrateError::Remote(
                crate::error::Side::Destination,
                message,
            )),
            Some(Ok(Inbound::Resumed(_))) => Err(MigrateError::misplaced(
                Kind::Resumed,
                Rule::ResumedAfterComplete,
            )),
            Some(Ok(Inbound::Received(_) | Inbound::PageRequest(_) | Inbound::StateReady)) => {
                unreachable!("the reader folds acknowledgements and queues requests")
            }
            Some(Ok(Inbound::Done(_))) => {
                Err(MigrateError::misplaced(Kind::Done, Rule::NoDoneInPrecopy))
            }
            Some(Err(e)) => Err(e),
        }
    }
}
