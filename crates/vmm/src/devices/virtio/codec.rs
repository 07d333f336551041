//! Little-endian encoding of virtio state sections: a writer that appends fields and a reader
//! that takes them back, naming the field it was reading when the bytes run out, so every
//! decoder in `virtio` refuses a short or long section with a reason instead of an index panic.
//!
//! Invariant: [`Reader`] never reads past its slice and never allocates more than the caller's
//! cap; [`Reader::finish`] refuses trailing bytes, so a section decodes only if its length is
//! exactly what its fields say.

#![forbid(unsafe_code)]

use crate::devices::device::DeviceStateError;

/// Appends little-endian fields.
#[derive(Debug, Default)]
pub(crate) struct Writer(Vec<u8>);

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }
    /// A u32 length, then the bytes.
    pub(crate) fn blob(&mut self, b: &[u8]) -> &mut Self {
        let len = u32::try_from(b.len()).expect("a state blob fits in u32 bytes");
        self.u32(len);
        self.0.extend_from_slice(b);
        self
    }
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

/// Takes little-endian fields back, refusing what does not fit.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    device: &'static str,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(device: &'static str, bytes: &'a [u8]) -> Reader<'a> {
        Reader {
            device,
            bytes,
            at: 0,
        }
    }

    /// A refusal naming this reader's device.
    pub(crate) fn malformed(&self, reason: impl Into<String>) -> DeviceStateError {
        DeviceStateError::Malformed {
            device: self.device,
            reason: reason.into(),
        }
    }

    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], DeviceStateError> {
        let end = self.at.checked_add(N).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(self.malformed(format!(
                "{} bytes end at byte {} inside {what}, which needs {N}",
                self.bytes.len(),
                self.at
            )));
        };
        let v = self.bytes[self.at..end].try_into().expect("N bytes");
        self.at = end;
        Ok(v)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, DeviceStateError> {
        Ok(self.take::<1>(what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &str) -> Result<u16, DeviceStateError> {
        Ok(u16::from_le_bytes(self.take(what)?))
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, DeviceStateError> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, DeviceStateError> {
        Ok(u64::from_le_bytes(self.take(what)?))
    }
    pub(crate) fn bool(&mut self, what: &str) -> Result<bool, DeviceStateError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.malformed(format!("{what} is {v}, not 0 or 1"))),
        }
    }
    /// A u32 length of at most `max`, then that many bytes.
    pub(crate) fn blob(&mut self, what: &str, max: usize) -> Result<&'a [u8], DeviceStateError> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(self.malformed(format!("{what} claims {len} bytes, above the cap {max}")));
        }
        let rest = &self.bytes[self.at..];
        if len > rest.len() {
            return Err(self.malformed(format!(
                "{what} claims {len} bytes but {} remain",
                rest.len()
            )));
        }
        self.at += len;
        Ok(&rest[..len])
    }
    /// Refuses bytes left over after the last field.
    pub(crate) fn finish(self) -> Result<(), DeviceStateError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            n => Err(self.malformed(format!("{n} bytes follow the last field"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_short_or_long_input_is_refused_by_field() {
        let mut w = Writer::default();
        w.u8(7)
            .u16(0x1234)
            .u32(5)
            .u64(u64::MAX)
            .bool(true)
            .blob(b"abc");
        let b = w.into_bytes();
        let mut r = Reader::new("dev", &b);
        assert_eq!(r.u8("a").unwrap(), 7);
        assert_eq!(r.u16("b").unwrap(), 0x1234);
        assert_eq!(r.u32("c").unwrap(), 5);
        assert_eq!(r.u64("d").unwrap(), u64::MAX);
        assert!(r.bool("e").unwrap());
        assert_eq!(r.blob("f", 3).unwrap(), b"abc");
        r.finish().unwrap();

        let err = Reader::new("dev", &b[..5]).u64("the counter").unwrap_err();
        assert!(err.to_string().contains("the counter"), "{err}");
        let mut long = b.clone();
        long.push(0);
        let mut r = Reader::new("dev", &long);
        r.take::<16>("all").unwrap();
        r.blob("f", 3).unwrap();
        assert!(r.finish().is_err());
        let mut r = Reader::new("dev", &b);
        r.take::<16>("all").unwrap();
        assert!(r.blob("f", 2).is_err(), "above the cap");
        assert!(Reader::new("dev", &[2]).bool("flag").is_err());
    }
}
