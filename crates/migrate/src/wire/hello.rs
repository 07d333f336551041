//! The hello that opens every connection, in both directions: the role, channel, uuid and
//! capabilities of the source's, the status ([`Refusal`]) and postcopy page size of the
//! destination's reply.

#![forbid(unsafe_code)]

use super::capabilities::Capabilities;
use super::error::WireError;
use super::format::{HELLO_SIZE, MAGIC, OLDEST_VERSION, PAGE_SIZE, VERSION, crc};
use super::kind::Role;
use super::wire_enum::wire_enum;

/// The first 64 bytes on a connection, in both directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub channel: u16,
    pub uuid: [u8; 16],
    /// Guest RAM bytes; the destination refuses a size different from its own.
    pub memory_size: u64,
    /// In the destination's reply: 0 = accepted, else a [`Refusal`].
    pub status: u32,
    /// In the main hello: how many data channels follow
    /// (1..=[`MAX_CHANNELS`](super::MAX_CHANNELS)).
    pub channels: u16,
    /// In the main hello: the features the source asks for; in its reply, those granted.
    /// Zero on data connections.
    pub capabilities: Capabilities,
    /// In the destination's main reply when it grants postcopy: log2 of the host page in which
    /// it places postcopy pages ([`SMALL_PAGE_SHIFT`] or [`HUGE_PAGE_SHIFT`]), so that the
    /// source discards, sends and serves whole host pages. Zero everywhere else, and in a
    /// reply without postcopy.
    pub postcopy_page_shift: u8,
}

/// The hello's CRC32C of bytes 0..60 sits in its last four bytes.
const HELLO_CRC_AT: usize = HELLO_SIZE - 4;

/// Rewrites a hello's checksum after its bytes were changed on purpose (tests, fuzzing).
pub fn reseal_hello(b: &mut [u8; HELLO_SIZE]) {
    let crc = crc(&b[..HELLO_CRC_AT]);
    b[HELLO_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// `postcopy_page_shift` for 4 KiB host pages (shmem, anonymous memory).
pub const SMALL_PAGE_SHIFT: u8 = 12;
/// `postcopy_page_shift` for 2 MiB host pages (hugetlbfs): userfaultfd places a huge page
/// whole, so postcopy moves guest memory in units of 512 wire pages.
pub const HUGE_PAGE_SHIFT: u8 = 21;

wire_enum! {
    /// Why a destination refused a connection (the reply hello's `status`). A source reads it
    /// with `Refusal::try_from(reply.status)`; a status this version does not know is the
    /// number back.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Refusal: u32 {
        Accepted = 0,
        MemorySize = 1,
        Role = 2,
        /// A data channel named a migration uuid the destination is not receiving.
        UnknownMigration = 3,
        /// A data channel's id is out of range or already connected.
        ChannelId = 4,
        /// Another migration is under way on this destination (or has ended there).
        Busy = 5,
        /// A recovery for a migration that is not paused in postcopy here.
        NotPaused = 6,
        /// The destination VM cannot take the source's (its
        /// [`Kind::VmConfig`](super::Kind::VmConfig) differs: vCPUs, devices, CPU); an Error
        /// record after the hello says what and how to fix it.
        Config = 7,
    }
}

impl Hello {
    /// `magic[8] version:u32 role:u16 channel:u16 uuid[16] memory_size:u64 page_size:u32
    /// status:u32 channels:u16 capabilities:u64 postcopy_page_shift:u8 reserved[1] crc:u32`.
    pub fn encode(&self) -> [u8; HELLO_SIZE] {
        let mut b = [0u8; HELLO_SIZE];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.capabilities.version().to_le_bytes());
        b[12..14].copy_from_slice(&(self.role as u16).to_le_bytes());
        b[14..16].copy_from_slice(&self.channel.to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        b[32..40].copy_from_slice(&self.memory_size.to_le_bytes());
        b[40..44].copy_from_slice(&(PAGE_SIZE as u32).to_le_bytes());
        b[44..48].copy_from_slice(&self.status.to_le_bytes());
        b[48..50].copy_from_slice(&self.channels.to_le_bytes());
        b[50..58].copy_from_slice(&self.capabilities.0.to_le_bytes());
        b[58] = self.postcopy_page_shift;
        reseal_hello(&mut b);
        b
    }

    pub fn decode(b: &[u8; HELLO_SIZE]) -> Result<Hello, WireError> {
        let magic: [u8; 8] = b[0..8].try_into().unwrap();
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(WireError::Version(version));
        }
        if crc(&b[..HELLO_CRC_AT]).to_le_bytes() != b[HELLO_CRC_AT..] {
            return Err(WireError::HelloChecksum("hello"));
        }
        let raw_role = u16::from_le_bytes([b[12], b[13]]);
        let role = match Role::try_from(raw_role) {
            Ok(Role::Invalid) | Err(_) => return Err(WireError::Role(raw_role)),
            Ok(role) => role,
        };
        let page_size = u32::from_le_bytes(b[40..44].try_into().unwrap());
        if u64::from(page_size) != PAGE_SIZE {
            return Err(WireError::PageSize(page_size));
        }
        if b[59..HELLO_CRC_AT].iter().any(|&x| x != 0) {
            return Err(WireError::Reserved("hello"));
        }
        let postcopy_page_shift = b[58];
        if ![0, SMALL_PAGE_SHIFT, HUGE_PAGE_SHIFT].contains(&postcopy_page_shift)
            || (role != Role::Main && postcopy_page_shift != 0)
        {
            return Err(WireError::PostcopyPage(postcopy_page_shift));
        }
        let capabilities = Capabilities(u64::from_le_bytes(b[50..58].try_into().unwrap()));
        if capabilities.version() > version {
            return Err(WireError::Reserved("capabilities of the hello's version"));
        }
        if !matches!(role, Role::Main | Role::Resume) && capabilities != Capabilities::NONE {
            return Err(WireError::DataCapabilities(capabilities.0));
        }
        Ok(Hello {
            role,
            channel: u16::from_le_bytes([b[14], b[15]]),
            uuid: b[16..32].try_into().unwrap(),
            memory_size: u64::from_le_bytes(b[32..40].try_into().unwrap()),
            status: u32::from_le_bytes(b[44..48].try_into().unwrap()),
            channels: u16::from_le_bytes([b[48], b[49]]),
            capabilities,
            postcopy_page_shift,
        })
    }

    /// Wire pages per host page of postcopy, from the destination's main reply (a reply
    /// without a shift means 4 KiB pages).
    pub fn postcopy_unit_pages(&self) -> u64 {
        match self.postcopy_page_shift {
            0 => 1,
            s => 1 << (s - SMALL_PAGE_SHIFT),
        }
    }
}
