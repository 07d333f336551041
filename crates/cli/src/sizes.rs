//! Byte sizes as the command line writes them (`2G`, `512M`, `64GiB`), and a guest's RAM size,
//! which may also be `max`. Below every command that takes one.

/// A guest's RAM size: a size, or `max` for the most this host and guest allow (resolved by
/// [`memory_size`] once the guest is known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemorySize {
    Bytes(u64),
    Max,
}

pub fn parse_memory(s: &str) -> Result<MemorySize, String> {
    match s {
        "max" => Ok(MemorySize::Max),
        s => parse_size(s).map(MemorySize::Bytes),
    }
}

/// The bytes of RAM `size` asks for a guest of kind `guest`: `max` is the limit of this host
/// and guest, said on standard error with why.
pub fn memory_size(size: MemorySize, guest: ferry_vmm::GuestKind) -> anyhow::Result<u64> {
    match size {
        MemorySize::Bytes(b) => Ok(b),
        MemorySize::Max => {
            let limit = ferry_vmm::limit::MemoryLimit::of_host(&ferry_vmm::kvm::open()?, guest);
            eprintln!(
                "ferry: --memory max: {} ({})",
                ferry_vmm::memory::Size(limit.bytes),
                limit.why
            );
            Ok(limit.bytes)
        }
    }
}

/// Parses a byte size such as `2G`, `512M` or `64GiB` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    ferry_guest_abi::params::parse_size(s).ok_or_else(|| {
        format!("'{s}' is not a size; write a number, a fraction allowed, with an optional K, M, G or T suffix (either case), e.g. 2G or 3.5g")
    })
}
