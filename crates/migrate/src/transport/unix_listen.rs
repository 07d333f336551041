//! The Unix socket a destination listens on (`unix:PATH`): reachable with the mode asked for
//! (0600 by default) from its first instant, and never put over anything but a stale socket.
//!
//! Whoever can connect to it can offer this VMM a guest, and in a local handover hand it
//! memory, so the socket's mode matters as much as the API socket's. The bind's own mode
//! follows the umask (775 was seen), and setting the mode after `bind` by path leaves a window
//! in which the socket listens with the umask's mode. Instead it is bound inside a directory
//! made for it beside `PATH` with mode 0700 (no other user can reach anything in it), given
//! its mode there, and only then linked to `PATH`. `link` never replaces what is there, so a
//! file, a directory or a socket that appeared meanwhile is refused as well, and left alone.
//! (The process's umask is shared by every thread, so binding under a umask of its own would
//! race with whatever another thread creates meanwhile; `fchmod` on an unbound socket is a
//! Linux detail nothing documents.) Root bypasses the mode, as it bypasses every permission.
//!
//! What is at `PATH` before: nothing, or a stale socket (nobody listens: `connect` is refused
//! with `ECONNREFUSED`), which is removed and replaced; anything else (a regular file, a
//! directory, a symbolic link, a socket a process listens on, or one this process cannot
//! probe) is refused, named in the error, and kept.

#![forbid(unsafe_code)]

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::stream::{Listener, Stream};

/// The incoming socket's default mode: only the VMM's own user may connect, since whoever
/// connects may hand this VMM a guest (and, in a local handover, its memory). The API socket's
/// default is the same, for the same reason.
pub const DEFAULT_SOCKET_MODE: u32 = 0o600;

/// The private directory's mode: its owner alone may look inside while the socket in it has
/// not got its mode yet.
const PRIVATE_DIR_MODE: u32 = 0o700;

/// The private directory's name prefix: short, since the socket's path inside it must fit
/// `sun_path` (108 bytes) as `PATH` must, and hidden beside `PATH` for the moment it exists.
const PRIVATE_DIR_PREFIX: &str = ".ferry-";

/// What was found at the path, where a socket was to be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occupant {
    RegularFile,
    Directory,
    Symlink,
    /// A fifo or a device node.
    Special,
    /// A socket a process listens on.
    LiveSocket,
    /// A socket nobody listens on that appeared while this one was being made: another
    /// process is making one there too.
    NewSocket,
}

impl std::fmt::Display for Occupant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Occupant::RegularFile => "a regular file",
            Occupant::Directory => "a directory",
            Occupant::Symlink => "a symbolic link",
            Occupant::Special => "a fifo or a device node",
            Occupant::LiveSocket => "a socket a process listens on",
            Occupant::NewSocket => "a socket another process made meanwhile",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UnixListenError {
    #[error(
        "cannot listen on unix:{}: {what} is there, and it was left as it is; choose another path, or remove it if nothing needs it",
        path.display()
    )]
    Occupied { path: PathBuf, what: Occupant },
    #[error(
        "cannot listen on unix:{}: a socket is there that this process cannot probe ({source}), so it may not be stale, and it was left as it is; choose another path, or remove it if nothing listens there",
        path.display()
    )]
    Unprobed {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot listen on unix:{}: {during}: {source}; check that its directory exists and this user may write to it (and that the path is under 108 bytes)",
        path.display()
    )]
    Io {
        path: PathBuf,
        during: &'static str,
        #[source]
        source: io::Error,
    },
}

/// A listening Unix socket made by [`bind`]: where sources connect is `path` (the name it was
/// bound to first is gone).
#[derive(Debug)]
pub struct UnixSocketListener {
    inner: UnixListener,
    path: PathBuf,
}

/// Listens on `path` with permission bits `mode` (at most 0o777; higher bits are ignored), as
/// the module says.
pub fn bind(path: &Path, mode: u32) -> Result<UnixSocketListener, UnixListenError> {
    let failed = |during: &'static str| {
        move |source| UnixListenError::Io {
            path: path.into(),
            during,
            source,
        }
    };
    match look(path)? {
        None => {}
        Some(Found::Kept(what)) => {
            return Err(UnixListenError::Occupied {
                path: path.into(),
                what,
            });
        }
        // The process that listened is gone.
        Some(Found::Stale) => match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed("removing the stale socket there")(e)),
        },
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let private = tempfile::Builder::new()
        .prefix(PRIVATE_DIR_PREFIX)
        .permissions(std::fs::Permissions::from_mode(PRIVATE_DIR_MODE))
        .tempdir_in(dir)
        .map_err(failed("making a private directory beside it"))?;
    let staged = private.path().join("s");
    let inner = UnixListener::bind(&staged).map_err(failed("binding the socket"))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode & 0o777))
        .map_err(failed("setting the socket's mode"))?;
    if let Err(e) = std::fs::hard_link(&staged, path) {
        if e.kind() == io::ErrorKind::AlreadyExists {
            // Something came between the look and the link: named, and kept.
            let what = match look(path) {
                Ok(Some(Found::Kept(what))) => what,
                _ => Occupant::NewSocket,
            };
            return Err(UnixListenError::Occupied {
                path: path.into(),
                what,
            });
        }
        return Err(failed("linking the socket into place")(e));
    }
    // Dropping `private` removes the staged name and its directory; the socket stays, at
    // `path`.
    Ok(UnixSocketListener {
        inner,
        path: path.into(),
    })
}

/// What [`look`] found at a path.
enum Found {
    /// What must be kept.
    Kept(Occupant),
    /// A socket nobody listens on (`connect` refused): what may be replaced.
    Stale,
}

/// What is at `path`, touching nothing (but for a connection to a socket there, which is how a
/// live one is told from a stale one).
fn look(path: &Path) -> Result<Option<Found>, UnixListenError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(UnixListenError::Io {
                path: path.into(),
                during: "looking at what is there",
                source,
            });
        }
    };
    let t = meta.file_type();
    let what = if t.is_file() {
        Occupant::RegularFile
    } else if t.is_dir() {
        Occupant::Directory
    } else if t.is_symlink() {
        Occupant::Symlink
    } else if !t.is_socket() {
        Occupant::Special
    } else {
        return match UnixStream::connect(path) {
            Ok(_) => Ok(Some(Found::Kept(Occupant::LiveSocket))),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(Some(Found::Stale)),
            Err(source) => Err(UnixListenError::Unprobed {
                path: path.into(),
                source,
            }),
        };
    };
    Ok(Some(Found::Kept(what)))
}

impl Listener for UnixSocketListener {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        self.inner.accept_within(wait)
    }
    fn local(&self) -> String {
        format!("unix:{}", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    fn mode_of(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    /// What is in `dir` besides the names given: the private directory must be gone.
    fn leftovers(dir: &Path, expected: &[&str]) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !expected.contains(&n.as_str()))
            .collect()
    }

    #[test]
    fn the_socket_has_the_mode_asked_for_and_nothing_is_left_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        for (name, mode) in [("a.sock", DEFAULT_SOCKET_MODE), ("b.sock", 0o660)] {
            let path = dir.path().join(name);
            let l = bind(&path, mode).unwrap();
            assert!(
                std::fs::symlink_metadata(&path)
                    .unwrap()
                    .file_type()
                    .is_socket()
            );
            assert_eq!(mode_of(&path), mode, "{name}");
            assert_eq!(l.local(), format!("unix:{}", path.display()));
            // It accepts through its path.
            let _c = UnixStream::connect(&path).unwrap();
            assert!(l.accept_within(Duration::from_secs(1)).unwrap().is_some());
        }
        assert_eq!(
            leftovers(dir.path(), &["a.sock", "b.sock"]),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_regular_file_or_a_directory_or_a_link_at_the_path_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"precious").unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        for (path, what, said) in [
            (&file, Occupant::RegularFile, "a regular file is there"),
            (&sub, Occupant::Directory, "a directory is there"),
            (&link, Occupant::Symlink, "a symbolic link is there"),
        ] {
            let e = bind(path, DEFAULT_SOCKET_MODE).unwrap_err();
            assert!(
                matches!(&e, UnixListenError::Occupied { what: w, .. } if *w == what),
                "{e}"
            );
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(
                text.contains(said) && text.contains("left as it is"),
                "{text}"
            );
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");
        assert!(sub.is_dir());
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            leftovers(dir.path(), &["file", "sub", "link"]),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let live = bind(&path, DEFAULT_SOCKET_MODE).unwrap();
        let e = bind(&path, DEFAULT_SOCKET_MODE).unwrap_err();
        assert!(
            e.to_string().contains("a socket a process listens on"),
            "{e}"
        );
        // The live one still takes connections.
        let _c = UnixStream::connect(&path).unwrap();
        assert!(
            live.accept_within(Duration::from_secs(1))
                .unwrap()
                .is_some()
        );
        // Dropped, it leaves its file: nobody listens there now, so it is stale.
        drop(live);
        assert!(path.exists());
        assert_eq!(
            UnixStream::connect(&path).unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
        let again = bind(&path, DEFAULT_SOCKET_MODE).expect("a stale socket is replaced");
        assert_eq!(mode_of(&path), DEFAULT_SOCKET_MODE);
        // The one there now is listening (the stale one refused every connection).
        let _c = UnixStream::connect(&path).unwrap();
        assert!(
            again
                .accept_within(Duration::from_secs(1))
                .unwrap()
                .is_some()
        );
    }
}
