//! Postcopy without the preempt connection: once the guest runs on the destination the
//! requested pages go on the main connection, and the reader writes them there itself
//! (`forward.rs`), through a writer this thread shares with it for as long as the push runs.

#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::conn::Conn;
use crate::control::Phase;
use crate::error::MigrateError;
use crate::source::Session;
use crate::source::forward::{Lane, MainOut, MainWriter, Way};
use crate::source::sender;
use crate::stats::PostcopyStats;

impl Session<'_> {
    /// Once the guest runs on the destination without the preempt connection, where requested
    /// pages go on the main connection: from here the reader writes them there itself,
    /// through a writer it shares with this thread (`forward.rs`).
    pub(super) fn share_main(&mut self) -> Result<(), MigrateError> {
        let agreed = self.peer.agreed;
        if agreed.preempt || !agreed.main_pages || self.report.phase != Phase::Postcopy {
            return Ok(());
        }
        let io = |e| MigrateError::io("sharing the main connection", e);
        self.peer.conn.flush("sending requested pages")?;
        let conn =
            Conn::new(self.peer.conn.stream().try_clone_stream().map_err(io)?).map_err(io)?;
        let main = Arc::new(MainOut::new(MainWriter {
            conn,
            checksum_pages: self.params.checksum_pages,
            forwarded_pages: 0,
            turnaround: self.peer.pool.turnaround_counter(),
        }));
        self.peer
            .acks
            .reader
            .as_ref()
            .expect("the reader runs")
            .set_lane(Lane {
                way: Way::Main(main.clone()),
                ram: self.ram.clone(),
                unit_pages: agreed.postcopy_unit,
            });
        self.peer.main_out = Some(main);
        Ok(())
    }

    /// Takes the shared writer back from the reader (nothing goes through it after this) and
    /// counts what it wrote for the reader.
    pub(super) fn unshare_main(&mut self, pc: &mut PostcopyStats) {
        let Some(main) = self.peer.main_out.take() else {
            return;
        };
        if let Some(reader) = &self.peer.acks.reader {
            reader.clear_lane();
        }
        if let Some(w) = main.take() {
            self.peer.earlier_bytes += w.conn.bytes_written;
            pc.pages_on_main += w.forwarded_pages;
            pc.pages_forwarded += w.forwarded_pages;
            self.report.stats.pages_normal += w.forwarded_pages;
        }
    }

    /// Writes Pages records of `gpas` on the main connection: through the writer shared with
    /// the reader while there is one, then flushed (the reader flushes what it writes, so a
    /// record left in the shared buffer would wait for it), else buffered on this thread's.
    pub(super) fn write_main(&mut self, gpas: &[u64]) -> Result<(), MigrateError> {
        let Some(main) = &self.peer.main_out else {
            return sender::write_pages(
                &mut self.peer.conn,
                &self.ram,
                gpas,
                self.params.checksum_pages,
            );
        };
        main.with(|w| {
            sender::write_pages(&mut w.conn, &self.ram, gpas, w.checksum_pages)
                .and_then(|()| w.conn.flush("sending requested pages"))
        })
        .unwrap_or_else(|| {
            Err(MigrateError::io(
                "sending requested pages",
                std::io::Error::from(std::io::ErrorKind::BrokenPipe),
            ))
        })
    }
}
