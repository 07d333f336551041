//! The live destination a migration talks to: the main connection, the data channels and
//! what the handshake agreed. The session's phases reach it as `self.peer`; what comes back on
//! the main connection (`reader.rs`) the session keeps in its `Acks`, which a target that
//! says nothing (a file) leaves empty.

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::agreement::Agreement;
use super::forward::MainOut;
use super::pool::ChannelPool;
use super::readahead::Readahead;
use super::target::Target;
use crate::conn::Conn;
use crate::error::MigrateError;
use crate::stats::MigrationStats;
use crate::wire::{Header, Kind};

/// A live destination's side of a session.
pub(super) struct Live {
    pub(super) conn: Conn,
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

    fn peer_error(&mut self) -> Option<String> {
        self.conn.peer_error()
    }
}
