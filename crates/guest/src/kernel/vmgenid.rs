//! The VM generation ID (`ferry_guest_abi::vmgenid`) as the boot vCPU watches it: four port
//! reads at boot and at every heartbeat, and a VmGeneration report at boot and whenever the ID
//! changed since the last look. Under a VMM without the device the ID reads as all-ones, never
//! changes, and the report goes where the telemetry port's do (nowhere, under QEMU).

use ferry_guest::vmgenid::Watch;
use ferry_guest_abi::report::{Kind, Report};
use ferry_guest_abi::vmgenid::{GenerationId, PORT};

use super::clock::Clock;
use super::{arch, telemetry};

/// The ID as the ports show it now.
fn read() -> GenerationId {
    GenerationId::from_words(core::array::from_fn(|k| arch::inl(PORT + 4 * k as u16)))
}

/// The boot vCPU's watch over the ID.
pub struct Watcher(Watch);

impl Watcher {
    /// The first look, reported.
    pub fn boot(clock: &Clock) -> Watcher {
        let w = Watcher(Watch::new(read()));
        w.send(clock);
        w
    }

    /// Another look; reported when the ID changed.
    pub fn look(&mut self, clock: &Clock) {
        if self.0.look(read()) {
            self.send(clock);
        }
    }

    fn send(&self, clock: &Clock) {
        telemetry::send(&Report {
            kind: Kind::VmGeneration as u16,
            vcpu: clock.vcpu(),
            guest_ns: clock.now_ns(),
            detail: self.0.detail(),
            ..Report::default()
        });
    }
}
