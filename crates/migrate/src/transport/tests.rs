//! The transports' own tests: TCP keepalive and priority, addresses, hang-up detection, and
//! listeners' timeouts.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::stream::URGENT_PRIORITY;
use super::*;

/// A silently lost peer (no FIN, no reset) used to be seen only when a write timed out,
/// or after the 600 s record timeout on a reader.
#[test]
fn regression_a_migration_connection_probes_a_silent_peer_within_its_peer_timeout() {
    use nix::sys::socket::{getsockopt, sockopt};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    s.set_keepalive(Some(Duration::from_secs(30))).unwrap();
    assert!(getsockopt(&s, sockopt::KeepAlive).unwrap());
    assert_eq!(getsockopt(&s, sockopt::TcpKeepIdle).unwrap(), 10);
    assert_eq!(getsockopt(&s, sockopt::TcpKeepInterval).unwrap(), 5);
    assert_eq!(getsockopt(&s, sockopt::TcpKeepCount).unwrap(), 4);
    assert_eq!(getsockopt(&s, sockopt::TcpUserTimeout).unwrap(), 30_000);
    let boxed: Box<dyn Stream> = Box::new(l.accept().unwrap().0);
    boxed.set_keepalive(Some(Duration::from_secs(5))).unwrap();
}

#[test]
fn addresses_parse_and_print_back() {
    for ok in [
        "tcp:127.0.0.1:4444",
        "tcp:[::1]:80",
        "tcp:host:1",
        "unix:/run/x.sock",
    ] {
        let a: Address = ok.parse().unwrap();
        assert_eq!(a.to_string(), ok);
    }
    for (bare, spelled) in [
        ("127.0.0.1:4444", "tcp:127.0.0.1:4444"),
        ("localhost:1", "tcp:localhost:1"),
        ("[::1]:4444", "tcp:[::1]:4444"),
    ] {
        let a: Address = bare.parse().unwrap();
        assert_eq!(a.to_string(), spelled, "a bare HOST:PORT is TCP");
    }
    for bad in [
        "127.0.0.1",
        "::1:4444",
        "h:port",
        "/run/ferry.sock",
        "tcp:4444",
        "tcp:h:port",
        "unix:",
        "udp:h:1",
        "",
    ] {
        let e = bad.parse::<Address>().unwrap_err().to_string();
        assert!(
            e.contains("tcp:HOST:PORT") && e.contains("unix:PATH"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn an_urgent_tcp_connection_carries_priority_6_and_dscp_ef() {
    use nix::sys::socket::{getsockopt, sockopt};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    assert_eq!(getsockopt(&c, sockopt::Priority).unwrap(), 0);
    Stream::set_urgent(&c).unwrap();
    assert_eq!(getsockopt(&c, sockopt::Priority).unwrap(), URGENT_PRIORITY);
    assert_eq!(getsockopt(&c, sockopt::Ipv4Tos).unwrap(), 0xb8);
}

#[test]
fn a_connection_is_hung_up_once_its_peer_closed_and_not_while_data_waits() {
    let dir = tempfile::tempdir().unwrap();
    for a in [
        "tcp:127.0.0.1:0".parse::<Address>().unwrap(),
        Address::Unix(dir.path().join("h.sock")),
    ] {
        let l = a.listen().unwrap();
        let at: Address = l.local().parse().unwrap();
        let mut c = at.connect(Duration::from_secs(1)).unwrap();
        let mut s = l.accept_within(Duration::from_secs(1)).unwrap().unwrap();
        assert!(!s.hung_up(), "{a}: a fresh connection");
        c.write_all(b"x").unwrap();
        drop(c);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!s.hung_up(), "{a}: a byte still waits to be read");
        let mut b = [0; 1];
        s.read_exact(&mut b).unwrap();
        assert!(s.hung_up(), "{a}: the peer closed");
    }
}

#[test]
fn a_unix_listener_accepts_and_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let a = Address::Unix(dir.path().join("m.sock"));
    let l = a.listen().unwrap();
    assert!(
        l.accept_within(Duration::from_millis(20))
            .unwrap()
            .is_none()
    );
    let mut c = a.connect(Duration::from_secs(1)).unwrap();
    let mut s = l.accept_within(Duration::from_secs(1)).unwrap().unwrap();
    c.write_all(b"hi").unwrap();
    let mut b = [0; 2];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"hi");
    assert_eq!(l.local(), a.to_string());
}
