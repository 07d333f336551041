//! How a disk is given: `PATH[,readonly][,cache=none|writeback]`, parsed into [`DiskOptions`].

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::str::FromStr;

use super::error::BlockError;

/// How the host caches the image's data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cache {
    /// Through the host's page cache; FLUSH makes writes durable (fdatasync).
    #[default]
    Writeback,
    /// O_DIRECT: data bypasses the host's page cache (no double caching, no host memory
    /// grown by the guest's I/O); FLUSH still fdatasyncs, as the device's write cache may
    /// hold data. The file system must support O_DIRECT at 512-byte alignment, else the
    /// open is refused (no silent fallback to the page cache: the user asked for none).
    None,
}

/// A disk image and how to open it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskOptions {
    /// A raw image file. Its size sets the capacity in whole 512-byte sectors; a partial
    /// last sector is not visible to the guest.
    pub path: PathBuf,
    /// Open it read-only and offer VIRTIO_BLK_F_RO; the guest's writes fail.
    pub readonly: bool,
    pub cache: Cache,
}

impl FromStr for DiskOptions {
    type Err = BlockError;

    fn from_str(text: &str) -> Result<DiskOptions, BlockError> {
        let mut parts = text.split(',');
        let path = parts.next().unwrap_or_default();
        if path.is_empty() {
            return Err(BlockError::NoPath { text: text.into() });
        }
        let mut readonly = None;
        let mut cache = None;
        for part in parts {
            let repeated = |option| BlockError::Repeated { option };
            match part.split_once('=') {
                None if part == "readonly" => {
                    readonly
                        .replace(true)
                        .map_or(Ok(()), |_| Err(repeated("readonly")))?;
                }
                Some(("cache", value)) => {
                    let mode = match value {
                        "writeback" => Cache::Writeback,
                        "none" => Cache::None,
                        _ => {
                            return Err(BlockError::UnknownCache {
                                value: value.into(),
                            });
                        }
                    };
                    cache
                        .replace(mode)
                        .map_or(Ok(()), |_| Err(repeated("cache")))?;
                }
                _ => return Err(BlockError::UnknownOption { part: part.into() }),
            }
        }
        Ok(DiskOptions {
            path: path.into(),
            readonly: readonly.unwrap_or(false),
            cache: cache.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<DiskOptions, String> {
        text.parse().map_err(|e: BlockError| e.to_string())
    }

    #[test]
    fn options_parse_in_any_order() {
        let plain = parse("/img/disk.raw").unwrap();
        assert_eq!(
            plain,
            DiskOptions {
                path: "/img/disk.raw".into(),
                readonly: false,
                cache: Cache::Writeback
            }
        );
        let all = parse("disk.raw,cache=none,readonly").unwrap();
        assert_eq!((all.readonly, all.cache), (true, Cache::None));
        let again = parse("disk.raw,readonly,cache=writeback").unwrap();
        assert_eq!((again.readonly, again.cache), (true, Cache::Writeback));
    }

    #[test]
    fn bad_options_name_the_part_and_the_fix() {
        for (text, names) in [
            ("", "PATH[,readonly]"),
            (",readonly", "names no image"),
            ("d.raw,ro", "\"ro\""),
            ("d.raw,readonly=on", "\"readonly=on\""),
            ("d.raw,cache=unsafe", "cache=unsafe"),
            ("d.raw,cache=none,cache=none", "cache is given twice"),
            ("d.raw,readonly,readonly", "readonly is given twice"),
            ("d.raw,", "\"\""),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(names), "{text:?}: {err}");
        }
    }
}
