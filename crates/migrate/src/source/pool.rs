//! The data channels of one migration: their connections and handshakes, a [`Sender`] thread
//! each, which batch goes to which, pass ends, closing, and the bytes they wrote.
//!
//! Invariants: a pass end is queued on every sender after all of that pass's batches (each
//! sender writes its queue in order, so the destination's barrier sees every page of a pass
//! before the pass ends); a sender that stopped is noticed at the next message queued to it
//! and its own error is returned; every sender is finished (its thread joined) before the
//! pool is dropped.
//!
//! The data channels' senders are alike, fed round-robin. Postcopy's preempt connection, when
//! granted, has a sender of its own, fed only by [`ChannelPool::queue_urgent`] (the pages a
//! vCPU on the destination waits for), so that they never queue behind the background stream
//! in a data channel's queue or socket; it takes no part in passes, and its bytes count in the
//! same counter.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::forward::Lane;
use super::params::{Preempt, SourceParams, TestHooks};
use super::sender::{ChannelMsg, Sender, SenderConfig};
use super::wakeup::Wakeup;
use crate::conn::Conn;
use crate::error::{Connection, MigrateError, ProtocolError};
use crate::ram::Ram;
use crate::stage_clock::PushClock;
use crate::stats::MigrationStats;
use crate::transport::Stream;
use crate::wire::{self, Hello, Latencies, Role};

/// The data channels' senders.
#[derive(Debug, Default)]
pub struct ChannelPool {
    /// Sender `i` serves data channel `i + 1`.
    senders: Vec<Sender>,
    /// The preempt connection's sender, when granted.
    preempt: Option<Sender>,
    /// The sender the next batch goes to.
    next: usize,
    /// Bytes all data channels wrote.
    bytes: Arc<AtomicU64>,
    /// Pages queued on the senders, and pages they wrote: the difference is still on this side.
    queued_pages: u64,
    written_pages: Arc<AtomicU64>,
    /// A handle on every connection, to shut them all down at once ([`ChannelPool::sever`]).
    streams: Vec<Box<dyn Stream>>,
    /// Postcopy's requests, from read to their pages written (the senders', and the
    /// session's on the main connection).
    turnaround: Arc<Mutex<Latencies>>,
    /// Pages the main connection's reader queued on the preempt connection itself
    /// (`forward.rs`), counted with the queued ones.
    forwarded: Arc<AtomicU64>,
    /// Each channel's share of the bandwidth limit (0: none), and the data records' page and
    /// wire bytes (`SenderConfig`).
    link_cap: Arc<AtomicU64>,
    data_pages: Arc<AtomicU64>,
    data_wire: Arc<AtomicU64>,
    /// Where the postcopy push's time goes, the senders' stages and the session's.
    clock: Arc<PushClock>,
    /// Rung by the senders as they take a batch, and by the reader for a request once the
    /// push waits on it (`wakeup.rs`).
    wakeup: Wakeup,
}

impl ChannelPool {
    /// Connects and greets `params.channels` data channels, and starts their senders. A
    /// refused or failed channel fails the migration; the senders already started are
    /// finished when the pool is.
    pub fn open(
        &mut self,
        connect: &dyn Fn() -> std::io::Result<Box<dyn Stream>>,
        params: &SourceParams,
        ram: &Ram,
        hooks: TestHooks,
        preempt: Preempt,
    ) -> Result<(), MigrateError> {
        let io = |e| MigrateError::io("connecting a data channel", e);
        let lanes = (1..=params.channels).map(|c| (Role::Data, c)).chain(
            preempt
                .is_on()
                .then_some((Role::Preempt, wire::PREEMPT_CHANNEL)),
        );
        for (role, channel) in lanes {
            let stream = connect().map_err(io)?;
            if role == Role::Preempt {
                // Small records that a vCPU waits for: no Nagle delay, and ahead in the queues
                // that have priorities. Both are hints; a failure changes no byte.
                let _ = stream.set_low_latency();
                if preempt == Preempt::Urgent
                    && let Err(e) = stream.set_urgent()
                {
                    tracing::debug!("the preempt connection is not marked urgent: {e}");
                }
            }
            self.streams.push(stream.try_clone_stream().map_err(io)?);
            let mut c = Conn::new(stream.try_clone_stream().map_err(io)?).map_err(io)?;
            c.write_hello(&Hello {
                role,
                channel,
                uuid: params.uuid,
                memory_size: ram.size(),
                status: 0,
                channels: params.channels,
                capabilities: wire::Capabilities::NONE,
                postcopy_page_shift: 0,
            })?;
            let reply = c.read_hello(params.peer_timeout)?;
            if reply.status != wire::Refusal::Accepted as u32 {
                let what = match role {
                    Role::Preempt => "the preempt connection".to_string(),
                    _ => format!("data channel {channel}"),
                };
                return Err(MigrateError::Refused(format!(
                    "{what} refused with status {}",
                    reply.status
                )));
            }
            let config = SenderConfig {
                zero: params.zero.clone(),
                bytes: self.bytes.clone(),
                pages: self.written_pages.clone(),
                checksum_pages: params.checksum_pages,
                compression: params.compression,
                link_cap: self.link_cap.clone(),
                data_pages: self.data_pages.clone(),
                data_wire: self.data_wire.clone(),
                turnaround: self.turnaround.clone(),
                clock: self.clock.clone(),
                room: self.wakeup.clone(),
            };
            let sender = Sender::start(channel, stream, ram.clone(), config, hooks)?;
            match role {
                Role::Preempt => self.preempt = Some(sender),
                _ => self.senders.push(sender),
            }
        }
        // Before the first batch is queued, so every sender reads the share it starts with.
        self.max_bandwidth_changed(params.max_bandwidth);
        Ok(())
    }

    /// Queues pages a vCPU waits for: on the preempt connection if there is one, else on the
    /// next data channel like any batch.
    /// `asked` is when the oldest request among them was read, for the turnaround.
    pub fn queue_urgent(&mut self, gpas: Vec<u64>, asked: Instant) -> Result<(), MigrateError> {
        self.queued_pages += gpas.len() as u64;
        let Some(preempt) = &mut self.preempt else {
            self.queue_for(self.next, ChannelMsg::Urgent(gpas, asked))?;
            self.next = (self.next + 1) % self.senders.len();
            return Ok(());
        };
        if preempt.send(ChannelMsg::Urgent(gpas, asked)) {
            return Ok(());
        }
        Err(match preempt.finish() {
            Err(e) => e,
            Ok(_) => ProtocolError::StoppedEarly {
                connection: Connection(0),
            }
            .into(),
        })
    }

    /// Counts a request served by its pages written elsewhere (on the main connection).
    pub fn note_turnaround(&self, asked: Instant) {
        let us = asked.elapsed().as_micros() as u64;
        self.turnaround.lock().unwrap().add(us);
    }

    /// Postcopy's requests so far, from read to their pages written.
    pub fn turnaround(&self) -> Latencies {
        *self.turnaround.lock().unwrap()
    }

    /// What the push waits on for room in a queue or a request (`wakeup.rs`).
    pub(crate) fn wakeup(&self) -> Wakeup {
        self.wakeup.clone()
    }

    /// The push's stage clocks (the senders keep theirs in it; the session its own).
    pub(crate) fn clock(&self) -> &PushClock {
        &self.clock
    }

    /// Pages the main connection's reader queued on the preempt connection itself.
    pub(crate) fn forwarded_pages(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }

    /// Where requests' turnarounds are counted, for a writer outside the pool.
    pub(crate) fn turnaround_counter(&self) -> Arc<Mutex<Latencies>> {
        self.turnaround.clone()
    }

    /// Queues a batch of page addresses on the next data channel, round-robin.
    pub fn queue_pages(&mut self, gpas: Vec<u64>) -> Result<(), MigrateError> {
        self.queued_pages += gpas.len() as u64;
        self.queue_for(self.next, ChannelMsg::Pages(gpas))?;
        self.next = (self.next + 1) % self.senders.len();
        Ok(())
    }

    /// Marks the switch to postcopy on every data channel, after its last pass end, and on
    /// the preempt connection.
    pub fn postcopy(&mut self) -> Result<(), MigrateError> {
        for i in 0..self.senders.len() {
            self.queue_for(i, ChannelMsg::Postcopy)?;
        }
        if let Some(p) = &mut self.preempt
            && !p.send(ChannelMsg::Postcopy)
        {
            return Err(p.finish().err().unwrap_or_else(|| {
                ProtocolError::StoppedEarly {
                    connection: Connection(0),
                }
                .into()
            }));
        }
        Ok(())
    }

    /// Queues a batch on the next data channel if its queue has room; gives the batch back if
    /// it has none (the caller does something else and tries again).
    /// Each channel is tried in turn from the next one's: a batch goes to the first with room
    /// (a channel whose socket drains slower gets fewer, and none waits while another idles).
    pub fn try_queue_pages(
        &mut self,
        mut gpas: Vec<u64>,
    ) -> Result<Option<Vec<u64>>, MigrateError> {
        let n = gpas.len() as u64;
        for _ in 0..self.senders.len() {
            match self.senders[self.next].try_send(ChannelMsg::Pages(gpas)) {
                Ok(None) => {
                    self.queued_pages += n;
                    self.next = (self.next + 1) % self.senders.len();
                    return Ok(None);
                }
                Ok(Some(ChannelMsg::Pages(back))) => gpas = back,
                Ok(Some(_)) => unreachable!("try_send gives back what it was given"),
                Err(_) => {
                    return Err(match self.senders[self.next].finish() {
                        Err(e) => e,
                        Ok(_) => ProtocolError::StoppedEarly {
                            connection: Connection(self.next as u16 + 1),
                        }
                        .into(),
                    });
                }
            }
            self.next = (self.next + 1) % self.senders.len();
        }
        Ok(Some(gpas))
    }

    /// Ends `pass` on every data channel, after the batches already queued.
    pub fn end_pass(&mut self, pass: u32) -> Result<(), MigrateError> {
        for i in 0..self.senders.len() {
            self.queue_for(i, ChannelMsg::EndOfPass(pass))?;
        }
        Ok(())
    }

    /// Flushes and closes every data channel and adds the senders' counts to `stats`; a
    /// sender that failed fails the migration (before the guest is handed over).
    pub fn close(&mut self, stats: &mut MigrationStats) -> Result<(), MigrateError> {
        for i in 0..self.senders.len() {
            self.queue_for(i, ChannelMsg::Shutdown)?;
        }
        if let Some(p) = &self.preempt {
            p.send(ChannelMsg::Shutdown);
        }
        for mut sender in self.senders.drain(..).chain(self.preempt.take()) {
            let s = sender.finish()?;
            stats.pages_normal += s.pages_normal;
            stats.pages_zero += s.pages_zero;
            stats.zero_scan_fallbacks += s.fallbacks;
            stats.cpu_seconds_source += s.cpu_ns as f64 / 1e9;
            if let Some(c) = &s.compression {
                stats
                    .compression
                    .get_or_insert_with(Default::default)
                    .add(c);
            }
        }
        // Closed for good: their ends closing on the destination is no longer news.
        self.streams.clear();
        Ok(())
    }

    /// Closes every remaining sender's queue and joins its thread, ignoring how it ended: the
    /// migration is over (it failed, or [`ChannelPool::close`] already collected them).
    pub fn abandon(&mut self) {
        for mut sender in self.senders.drain(..).chain(self.preempt.take()) {
            let _ = sender.finish();
        }
        self.streams.clear();
    }

    /// Shuts every connection down (a sender blocked on a dead peer returns at once), then
    /// abandons the senders: what a postcopy pause does with the connections it gives up.
    pub fn sever(&mut self) {
        for s in &self.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.abandon();
    }

    /// Whether the destination (or the network between) closed one of the connections: it
    /// never writes on them, so anything but waiting means the connection is gone.
    pub fn hung_up(&self) -> bool {
        self.streams.iter().any(|s| s.hung_up())
    }

    /// Bytes written on all data channels so far.
    pub fn bytes_written(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The data records' page bytes and the bytes written for them, so far.
    pub fn data_totals(&self) -> (u64, u64) {
        (
            self.data_pages.load(Ordering::Relaxed),
            self.data_wire.load(Ordering::Relaxed),
        )
    }

    /// The bandwidth limit is now `max` (bytes per second): each channel's share of it is what
    /// `auto` compression takes as the link's rate at most.
    pub fn max_bandwidth_changed(&self, max: Option<u64>) {
        let share = max.map_or(0, |m| (m / self.senders.len().max(1) as u64).max(1));
        self.link_cap.store(share, Ordering::Relaxed);
    }

    /// Pages queued on the senders that they have not written yet (at most their queues'
    /// depth in batches each).
    pub fn pending_pages(&self) -> u64 {
        (self.queued_pages + self.forwarded.load(Ordering::Relaxed))
            .saturating_sub(self.written_pages.load(Ordering::Relaxed))
    }

    /// With the preempt connection, where the main connection's reader may queue requested
    /// pages itself (`forward.rs`): its sender's queue, for as long as it runs.
    pub(crate) fn lane(&self, ram: &Ram, unit_pages: u64) -> Option<Lane> {
        self.preempt.as_ref().map(|p| Lane {
            way: super::forward::Way::Preempt {
                queue: p.queue(),
                forwarded: self.forwarded.clone(),
            },
            ram: ram.clone(),
            unit_pages,
        })
    }

    /// Queues `msg` for sender `i`; if that sender has stopped, returns why.
    fn queue_for(&mut self, i: usize, msg: ChannelMsg) -> Result<(), MigrateError> {
        if self.senders[i].send(msg) {
            return Ok(());
        }
        Err(match self.senders[i].finish() {
            Err(e) => e,
            Ok(_) => ProtocolError::StoppedEarly {
                connection: Connection(i as u16 + 1),
            }
            .into(),
        })
    }
}
