//! The timer that names every part of a state save or load (each vCPU, the clock, the
//! interrupt controller, each device) for the downtime breakdown. The sections and the devices
//! both mark it, so it sits below both.

#![forbid(unsafe_code)]

use std::time::Instant;

use ferry_migrate::StatePart;

/// Times a save or load part by part, for the downtime breakdown: each [`PartTimer::mark`]
/// ends the part that began at the previous one.
#[derive(Debug)]
pub struct PartTimer {
    parts: Vec<StatePart>,
    at: Instant,
}

impl PartTimer {
    pub fn start() -> PartTimer {
        PartTimer {
            parts: Vec::new(),
            at: Instant::now(),
        }
    }

    /// Ends a part of `bytes` of state named `name` (built only now, off the clock's path).
    pub fn mark(&mut self, name: impl FnOnce() -> String, bytes: usize) {
        let now = Instant::now();
        let ms = (now - self.at).as_secs_f64() * 1e3;
        self.parts.push(StatePart {
            name: name(),
            ms,
            bytes: bytes as u64,
        });
        self.at = Instant::now();
    }

    pub fn finish(self) -> Vec<StatePart> {
        self.parts
    }
}
