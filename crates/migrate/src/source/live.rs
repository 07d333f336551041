//! The live destination a migration talks to: the main connection, the data channels, what
//! comes back on the main connection (`ack_state.rs`, `reader.rs`), and what the handshake
//! agreed. The session's phases reach it as `self.peer`.

#![forbid(unsafe_code)]

use super::ack_state::Acks;
use super::agreement::Agreement;
use super::pool::ChannelPool;
use super::readahead::Readahead;
use crate::conn::Conn;

/// A live destination's side of a session.
pub(super) struct Live {
    pub(super) conn: Conn,
    pub(super) pool: ChannelPool,
    /// The reader of the main connection and what the destination acknowledged.
    pub(super) acks: Acks,
    /// What the destination granted (the handshake sets it).
    pub(super) agreed: Agreement,
    /// Bytes written on main connections that a postcopy recovery replaced (the data
    /// channels' count spans recoveries).
    pub(super) earlier_bytes: u64,
    /// Postcopy's readahead after a vCPU's requests (`readahead.rs`).
    pub(super) readahead: Readahead,
    /// The VM's configuration went with the hello (so CONFIG is asked for).
    pub(super) config_sent: bool,
}

impl Live {
    pub(super) fn new(conn: Conn) -> Live {
        Live {
            conn,
            pool: ChannelPool::default(),
            acks: Acks::default(),
            agreed: Agreement::NONE,
            earlier_bytes: 0,
            readahead: Readahead::default(),
            config_sent: false,
        }
    }
}
