//! An interrupt line from a device to the VM's interrupt controller: an eventfd that KVM's
//! in-kernel controller listens on (an irqfd), so raising an interrupt is one write from the
//! device's thread and never a trip through the VMM's own code.

#![forbid(unsafe_code)]

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// One device's interrupt line. Until the KVM layer connects it to a GSI (see
/// `kvm::irqchip::connect`), raising it only counts in the eventfd: nothing is delivered.
#[derive(Debug)]
pub struct IrqLine {
    fd: EventFd,
}

impl IrqLine {
    /// A line not yet connected to the interrupt controller.
    pub fn unconnected() -> std::io::Result<IrqLine> {
        Ok(IrqLine {
            fd: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// The same line, for a second owner.
    pub fn try_clone(&self) -> std::io::Result<IrqLine> {
        Ok(IrqLine {
            fd: self.fd.try_clone()?,
        })
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.fd
    }

    /// Raises the interrupt (an edge on the GSI, which the controller latches).
    pub fn raise(&self) -> std::io::Result<()> {
        self.fd.write(1)
    }
}

impl vm_superio::Trigger for IrqLine {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.raise()
    }
}
