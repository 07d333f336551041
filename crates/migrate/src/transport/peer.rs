//! Who is on the other end of a Unix socket, and whether a local handover may give guest RAM
//! to it or take guest RAM from it.
//!
//! A local handover passes guest RAM's read-write memfd over the socket (`SCM_RIGHTS`): the
//! process that takes it can write every page of the guest, and one that gives it could keep
//! writing them after the handover. So both sides read the peer's credentials from the kernel
//! (`SO_PEERCRED`: for a connecting source, the process that called `listen` on the path; for
//! a listening destination, the process that connected) and, by default, hand over only
//! between processes of the VMM's own effective uid. Other uids are the operator's deliberate
//! choice (`allow_uids`, `--allow-uid`). The check comes before any descriptor moves: the
//! source's before it sends the LocalRam record, the destination's before it reads it.
//!
//! [`judge`] is the decision as a pure function (the table test below); [`check`] reads the
//! credentials and judges.

#![forbid(unsafe_code)]

use std::io;

use super::stream::{PeerCred, Stream};

/// What the peer would do with guest RAM in the handover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRole {
    /// A destination, as the source sees it: it would take guest RAM.
    Takes,
    /// A source, as the destination sees it: it would give its guest RAM.
    Gives,
}

/// Why a local handover refused its peer.
#[derive(Debug, thiserror::Error)]
pub enum LocalPeerError {
    #[error(
        "{}: the process on the other end of the Unix socket (pid {pid}, uid {uid}) is not of this VMM's uid {own}, and {}; {}, or pass --allow-uid {uid} if this is deliberate",
        refusal(*role),
        untouched(*role),
        advice(*role)
    )]
    Stranger {
        role: PeerRole,
        pid: i32,
        uid: u32,
        own: u32,
    },
    #[error(
        "cannot tell who is on the other end of the socket (SO_PEERCRED), so no guest RAM is handed over: {source}"
    )]
    Unknown {
        #[source]
        source: io::Error,
    },
}

/// The refusal's opening words.
fn refusal(role: PeerRole) -> &'static str {
    match role {
        PeerRole::Takes => "refused to hand guest RAM over",
        PeerRole::Gives => "refused to take guest RAM",
    }
}

/// What the refusal left as it was.
fn untouched(role: PeerRole) -> &'static str {
    match role {
        PeerRole::Takes => "no descriptor was sent to it",
        PeerRole::Gives => "none of its descriptors was taken",
    }
}

/// Where the mistake may be, besides the uid.
fn advice(role: PeerRole) -> &'static str {
    match role {
        PeerRole::Takes => "check that --to names the VMM you meant",
        PeerRole::Gives => {
            "check who may connect to the incoming socket (--incoming-socket-mode, its directory)"
        }
    }
}

/// Whether a peer of `peer`'s credentials may take part in a local handover as `role` with
/// a VMM of effective uid `own` that also allows `allow_uids`.
pub fn judge(
    peer: PeerCred,
    role: PeerRole,
    own: u32,
    allow_uids: &[u32],
) -> Result<(), LocalPeerError> {
    if peer.uid == own || allow_uids.contains(&peer.uid) {
        return Ok(());
    }
    Err(LocalPeerError::Stranger {
        role,
        pid: peer.pid,
        uid: peer.uid,
        own,
    })
}

/// This process's effective uid, the one a peer must share by default.
pub fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Reads the credentials of `stream`'s peer and judges them ([`judge`]) for this process.
pub fn check(
    stream: &dyn Stream,
    role: PeerRole,
    allow_uids: &[u32],
) -> Result<PeerCred, LocalPeerError> {
    let peer = stream
        .peer_credentials()
        .map_err(|source| LocalPeerError::Unknown { source })?;
    judge(peer, role, own_uid(), allow_uids)?;
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_own_uid_and_the_allowed_ones_pass() {
        let peer = |uid| PeerCred {
            pid: 42,
            uid,
            gid: uid,
        };
        // (peer uid, own uid, allowed, passes)
        let table: &[(u32, u32, &[u32], bool)] = &[
            (0, 0, &[], true),
            (1000, 1000, &[], true),
            (65534, 0, &[], false),
            (0, 1000, &[], false),
            (65534, 0, &[65534], true),
            (65534, 0, &[1000], false),
            (1000, 1000, &[65534], true),
            (1001, 1000, &[1002, 1001], true),
        ];
        for &(uid, own, allowed, passes) in table {
            for role in [PeerRole::Takes, PeerRole::Gives] {
                let r = judge(peer(uid), role, own, allowed);
                assert_eq!(
                    r.is_ok(),
                    passes,
                    "uid {uid} own {own} {allowed:?} {role:?}"
                );
            }
        }
    }

    #[test]
    fn a_refusal_names_the_peer_and_the_fix() {
        let peer = PeerCred {
            pid: 4242,
            uid: 65534,
            gid: 65534,
        };
        let e = judge(peer, PeerRole::Takes, 0, &[])
            .unwrap_err()
            .to_string();
        for said in [
            "refused to hand guest RAM over",
            "pid 4242",
            "uid 65534",
            "uid 0",
            "no descriptor was sent to it",
            "pass --allow-uid 65534 if this is deliberate",
        ] {
            assert!(e.contains(said), "{said:?} not in: {e}");
        }
        let e = judge(peer, PeerRole::Gives, 0, &[])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("refused to take guest RAM"), "{e}");
    }

    /// The credentials come from the kernel: a socket pair's peer is this very process.
    #[test]
    fn so_peercred_reads_this_process_on_a_socket_pair() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let got = check(&a, PeerRole::Takes, &[]).expect("our own uid passes");
        assert_eq!(got.uid, own_uid());
        assert_eq!(got.pid, std::process::id() as i32);
    }

    /// A stream that is not a Unix socket cannot say who is there, and so refuses.
    #[test]
    fn a_stream_without_credentials_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let e = check(&s, PeerRole::Gives, &[]).unwrap_err();
        assert!(matches!(e, LocalPeerError::Unknown { .. }), "{e}");
    }
}
