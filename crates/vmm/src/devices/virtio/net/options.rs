//! How a NIC is given: `tap=NAME[,mac=MAC]` or `fd=N[,mac=MAC]`, parsed into [`NetOptions`].

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

/// An Ethernet address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    /// A random locally administered unicast address (`x2:xx:xx:xx:xx:xx`), as a NIC given
    /// no `mac=` gets.
    pub fn random() -> Mac {
        let mut b = [0u8; 6];
        getrandom::fill(&mut b).expect("the kernel's random source");
        b[0] = (b[0] & 0xfc) | 0x02;
        Mac(b)
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl FromStr for Mac {
    type Err = NetError;

    fn from_str(text: &str) -> Result<Mac, NetError> {
        let bad = || NetError::BadMac { text: text.into() };
        let mut b = [0u8; 6];
        let mut parts = text.split(':');
        for byte in &mut b {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 {
                return Err(bad());
            }
            *byte = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() || b[0] & 1 != 0 {
            return Err(bad());
        }
        Ok(Mac(b))
    }
}

/// Where the NIC's frames go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TapSource {
    /// The tap of this name in the VMM's network namespace, attached at start.
    Name(String),
    /// A descriptor of `/dev/net/tun` attached to a tap, inherited by the VMM (`fd=N`).
    Fd(i32),
}

/// A NIC and its tap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetOptions {
    pub tap: TapSource,
    /// `None`: a random one ([`Mac::random`]) on a new VM; a migrated or restored VM keeps
    /// its source's.
    pub mac: Option<Mac>,
}

/// Why a NIC's options or state were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NetError {
    #[error(
        "--net {text:?} names no tap; give --net tap=NAME[,mac=52:54:00:12:34:56] or --net fd=N"
    )]
    NoTap { text: String },
    #[error("--net: unknown option {option:?}; the options are tap=NAME, fd=N and mac=MAC")]
    Unknown { option: String },
    #[error("--net: {option} given twice; give it once")]
    Repeated { option: &'static str },
    #[error(
        "--net: {text:?} is not a unicast MAC address; give six hex bytes with colons, e.g. 52:54:00:12:34:56"
    )]
    BadMac { text: String },
    #[error(
        "--net: fd={text:?} is not a descriptor number; give the number of an inherited tap descriptor"
    )]
    BadFd { text: String },
}

impl FromStr for NetOptions {
    type Err = NetError;

    fn from_str(text: &str) -> Result<NetOptions, NetError> {
        let mut tap = None;
        let mut mac = None;
        for part in text.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').unwrap_or((part, ""));
            match key {
                "tap" | "fd" => {
                    let source = match key {
                        "tap" => TapSource::Name(value.into()),
                        _ => TapSource::Fd(
                            value
                                .parse()
                                .map_err(|_| NetError::BadFd { text: value.into() })?,
                        ),
                    };
                    if tap.replace(source).is_some() {
                        return Err(NetError::Repeated { option: "tap" });
                    }
                }
                "mac" => {
                    if mac.replace(value.parse()?).is_some() {
                        return Err(NetError::Repeated { option: "mac" });
                    }
                }
                _ => {
                    return Err(NetError::Unknown {
                        option: part.into(),
                    });
                }
            }
        }
        let tap = tap.ok_or_else(|| NetError::NoTap { text: text.into() })?;
        Ok(NetOptions { tap, mac })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_refuse_with_the_fix() {
        let o: NetOptions = "tap=ft0,mac=52:54:00:12:34:56".parse().unwrap();
        assert_eq!(o.tap, TapSource::Name("ft0".into()));
        assert_eq!(o.mac.unwrap().to_string(), "52:54:00:12:34:56");
        assert_eq!("fd=7".parse::<NetOptions>().unwrap().tap, TapSource::Fd(7));
        assert!(matches!(
            "mac=52:54:00:12:34:56".parse::<NetOptions>(),
            Err(NetError::NoTap { .. })
        ));
        assert!(matches!(
            "tap=a,mac=01:00:00:00:00:00".parse::<NetOptions>(),
            Err(NetError::BadMac { .. })
        ));
        assert!(matches!(
            "tap=a,tap=b".parse::<NetOptions>(),
            Err(NetError::Repeated { .. })
        ));
        assert!(matches!(
            "tap=a,speed=10".parse::<NetOptions>(),
            Err(NetError::Unknown { .. })
        ));
    }

    #[test]
    fn a_random_mac_is_local_and_unicast() {
        let m = Mac::random();
        assert_eq!(m.0[0] & 0x03, 0x02);
        assert_eq!(m.to_string().parse::<Mac>().unwrap(), m);
    }
}
