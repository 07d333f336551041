//! The VMM's top-level error: which layer failed, with that layer's own explanation.

use crate::boot::BootError;
use crate::kvm::KvmError;
use crate::memory::MemoryError;

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error("--vcpus {0} is not supported: a VM has 1 to {max} vCPUs", max = crate::vm::config::MAX_VCPUS)]
    Vcpus(u8),
    #[error("cannot open the serial output {path}: {source}")]
    Serial {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create an interrupt line (eventfd): {0}")]
    Eventfd(std::io::Error),
    #[error("cannot place a device: {0}")]
    Register(#[from] crate::devices::RegisterError),
    #[error("the VM was stopped before it could start: {0}")]
    Stopped(String),
    #[error("cannot catch SIGXFSZ (a snapshot past the file size limit would kill the VM): {0}")]
    FileSizeSignal(#[source] vmm_sys_util::errno::Error),
    #[error("cannot start the vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot start the RTC's timer thread: {0}")]
    RtcTimer(std::io::Error),
    #[error(transparent)]
    DirtyLog(#[from] crate::kvm::dirty::DirtyLogError),
    #[error(transparent)]
    State(#[from] crate::kvm::state::StateError),
    #[error(transparent)]
    GenerationId(#[from] crate::devices::vmgenid::EntropyError),
    #[error(transparent)]
    Disk(#[from] crate::devices::virtio::blk::BlockError),
    #[error(transparent)]
    Tap(#[from] crate::tap::TapError),
}

impl VmmError {
    /// Whether the VM was refused for a value the user gave (`--memory`, `--vcpus`, the guest's
    /// command line, a tap's name) before anything was set up: a usage error, which `ferry run`
    /// exits with as it does for a flag its parser refuses.
    pub fn is_usage(&self) -> bool {
        use crate::memory::MemoryError as M;
        match self {
            VmmError::Vcpus(_) => true,
            VmmError::Memory(e) => matches!(
                e,
                M::TooSmall { .. } | M::TooLarge { .. } | M::Unaligned { .. }
            ),
            VmmError::Boot(e) => matches!(
                e,
                BootError::Cmdline(_)
                    | BootError::CmdlineText { .. }
                    | BootError::MemoryTooSmall { .. }
            ),
            VmmError::Tap(e) => matches!(e, crate::tap::TapError::BadName { .. }),
            _ => false,
        }
    }
}
