//! TLS over loopback TCP: what passes, and each refusal with the words it is refused in.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::pki::Ca;
use super::*;
use crate::transport::{Address, Dialer};

const WAIT: Duration = Duration::from_secs(5);

fn names(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

/// A `--tls-dir` from one CA: the destination is 127.0.0.1 and `localhost`, the source
/// `source.test`.
fn tls_dir(ca: &Ca, dir: &Path) {
    ca.write_dir(
        dir,
        &names(&["127.0.0.1", "localhost"]),
        &names(&["source.test"]),
    )
    .unwrap();
}

struct Pair {
    source: Result<Box<dyn Stream>, crate::transport::AddressError>,
    destination: Box<dyn Stream>,
}

/// One connection from a source with `src` to a destination with `dst` on loopback; the
/// destination's side is taken as accepted (its handshake runs in its first read).
fn connect(src: &Path, src_name: Option<&str>, dst: &Path, allow: &[String]) -> Pair {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = Address::Tcp(l.local_addr().unwrap().to_string());
    let dtls =
        Arc::new(DestinationTls::new(&TlsFiles::in_dir(dst, Side::Destination), allow).unwrap());
    let listener = dtls.listener(Box::new(l));
    let stls = Arc::new(SourceTls::new(&TlsFiles::in_dir(src, Side::Source), src_name).unwrap());
    let dialer = Dialer::new(at, Some(stls)).unwrap();
    std::thread::scope(|s| {
        let accepted = s.spawn(|| {
            let mut d = listener.accept_within(WAIT).unwrap().unwrap();
            d.set_read_timeout(Some(WAIT)).unwrap();
            // The destination's handshake runs in its first read; a peek of zero bytes would
            // not start it, so it reads one byte that the source sends below.
            let mut byte = [0u8; 1];
            let read = d.read_exact(&mut byte).map(|()| byte[0]);
            (d, read)
        });
        let mut source = dialer.connect(WAIT);
        if let Ok(c) = source.as_mut() {
            let _ = c.write_all(&[7]);
        }
        let (destination, read) = accepted.join().unwrap();
        Pair {
            source,
            destination: DestinationOutcome::wrap(destination, read),
        }
    })
}

/// The destination's stream with the outcome of its first read kept for the test.
#[derive(Debug)]
struct DestinationOutcome {
    stream: Box<dyn Stream>,
    first: Result<u8, String>,
}

impl DestinationOutcome {
    fn wrap(stream: Box<dyn Stream>, first: io::Result<u8>) -> Box<dyn Stream> {
        Box::new(DestinationOutcome {
            stream,
            first: first.map_err(|e| e.to_string()),
        })
    }
}

impl Read for DestinationOutcome {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        if let Err(e) = &self.first {
            return Err(io::Error::other(e.clone()));
        }
        self.stream.read(b)
    }
}
impl Write for DestinationOutcome {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.stream.write(b)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}
impl Stream for DestinationOutcome {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        self.stream.try_clone_stream()
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.stream.shutdown(how)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.stream.set_read_timeout(t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.stream.set_write_timeout(t)
    }
    fn peer(&self) -> String {
        self.stream.peer()
    }
    fn set_low_latency(&self) -> io::Result<()> {
        Ok(())
    }
    fn set_urgent(&self) -> io::Result<()> {
        Ok(())
    }
}

fn destination_error(p: &mut Pair) -> String {
    let mut b = [0u8; 1];
    p.destination.read(&mut b).unwrap_err().to_string()
}

/// What the source sees: its connect's error, or the error of its first read.
fn source_error(p: &mut Pair) -> String {
    match p.source.as_mut() {
        Err(e) => e.to_string(),
        Ok(s) => {
            s.set_read_timeout(Some(WAIT)).unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Err(e) => e.to_string(),
                Ok(n) => panic!("the source read {n} bytes from a destination that refused it"),
            }
        }
    }
}

#[test]
fn one_ca_carries_bytes_both_ways_while_two_threads_share_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let p = connect(dir.path(), None, dir.path(), &[]);
    let mut src = p.source.unwrap();
    assert!(src.peer().ends_with("(TLS)"), "{}", src.peer());
    // 8 MiB each way at once: the source writes while its clone reads, and so does the
    // destination, so both locks are contended and records interleave.
    const LEN: usize = 8 << 20;
    let pattern = |i: usize, salt: u8| (i as u8).wrapping_mul(31) ^ salt;
    let mut dst = p.destination;
    let mut src_reader = src.try_clone_stream().unwrap();
    let mut dst_reader = dst.try_clone_stream().unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let data: Vec<u8> = (0..LEN).map(|i| pattern(i, 1)).collect();
            src.write_all(&data).unwrap();
            src.flush().unwrap();
        });
        s.spawn(|| {
            let data: Vec<u8> = (0..LEN).map(|i| pattern(i, 2)).collect();
            dst.write_all(&data).unwrap();
            dst.flush().unwrap();
        });
        let to_dst = s.spawn(|| {
            let mut got = vec![0u8; LEN];
            dst_reader.read_exact(&mut got).unwrap();
            got
        });
        let mut got = vec![0u8; LEN];
        src_reader.read_exact(&mut got).unwrap();
        assert!(got.iter().enumerate().all(|(i, b)| *b == pattern(i, 2)));
        let got = to_dst.join().unwrap();
        assert!(got.iter().enumerate().all(|(i, b)| *b == pattern(i, 1)));
    });
}

#[test]
fn a_clean_shutdown_reads_as_the_end_of_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let mut p = connect(dir.path(), None, dir.path(), &[]);
    let src = p.source.unwrap();
    src.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    p.destination.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "nothing after the first byte: {rest:?}");
}

/// A shutdown wrote its close_notify with the connection's write timeout, so severing N
/// connections whose peer stopped reading took N peer timeouts.
#[test]
fn regression_a_shutdown_does_not_wait_out_the_write_timeout_of_a_peer_that_stopped_reading() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let p = connect(dir.path(), None, dir.path(), &[]);
    let mut src = p.source.unwrap();
    // The destination reads nothing more: fill every buffer on the way.
    src.set_write_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    for size in [64 << 10, 1 << 10, 16, 1] {
        let chunk = vec![0x5a; size];
        while src.write_all(&chunk).is_ok() {}
    }
    // A peer timeout far longer than the bound below.
    src.set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let t = std::time::Instant::now();
    src.shutdown(Shutdown::Both).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the shutdown took {:?}",
        t.elapsed()
    );
    drop(p.destination);
}

#[test]
fn a_destination_certificate_from_another_ca_is_refused_by_the_source() {
    let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    tls_dir(&Ca::new("ours").unwrap(), ours.path());
    tls_dir(&Ca::new("theirs").unwrap(), theirs.path());
    let mut p = connect(ours.path(), None, theirs.path(), &[]);
    let e = source_error(&mut p);
    assert!(
        e.contains("the destination's certificate is not signed by this source's CA"),
        "{e}"
    );
    let e = destination_error(&mut p);
    assert!(
        e.contains("the source refused this destination's TLS"),
        "{e}"
    );
}

#[test]
fn a_source_certificate_from_another_ca_is_refused_by_the_destination() {
    let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ca = Ca::new("ours").unwrap();
    tls_dir(&ca, ours.path());
    // The source trusts the destination's CA, but its own certificate is from another.
    tls_dir(&Ca::new("theirs").unwrap(), theirs.path());
    std::fs::copy(ours.path().join(CA_FILE), theirs.path().join(CA_FILE)).unwrap();
    let mut p = connect(theirs.path(), None, ours.path(), &[]);
    let e = destination_error(&mut p);
    assert!(
        e.contains("the source's certificate is not signed by this destination's CA"),
        "{e}"
    );
    let e = source_error(&mut p);
    assert!(
        e.contains("the destination refused this source's TLS"),
        "{e}"
    );
}

#[test]
fn a_source_name_outside_the_allowed_list_is_refused_and_one_inside_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let mut p = connect(dir.path(), None, dir.path(), &names(&["other.test"]));
    let e = destination_error(&mut p);
    assert!(
        e.contains("carries source.test, none of the names this destination allows (other.test)"),
        "{e}"
    );
    assert!(source_error(&mut p).contains("refused this source's TLS"));
    let mut p = connect(
        dir.path(),
        None,
        dir.path(),
        &names(&["other.test", "source.test"]),
    );
    assert!(p.source.is_ok());
    p.destination.write_all(b"ok").unwrap();
}

#[test]
fn a_destination_without_the_name_the_source_expects_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let mut p = connect(dir.path(), Some("elsewhere.test"), dir.path(), &[]);
    let e = source_error(&mut p);
    assert!(
        e.contains("does not carry the name this source connected to"),
        "{e}"
    );
}

#[test]
fn a_plaintext_source_is_refused_by_a_tls_destination_at_its_first_byte() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = Address::Tcp(l.local_addr().unwrap().to_string());
    let dtls = Arc::new(
        DestinationTls::new(&TlsFiles::in_dir(dir.path(), Side::Destination), &[]).unwrap(),
    );
    let listener = dtls.listener(Box::new(l));
    let mut plain = at.connect(WAIT).unwrap();
    plain.write_all(b"FERRYMIG hello in plaintext").unwrap();
    let mut d = listener.accept_within(WAIT).unwrap().unwrap();
    d.set_read_timeout(Some(WAIT)).unwrap();
    let e = d.read(&mut [0u8; 8]).unwrap_err().to_string();
    assert!(
        e.contains("sent plaintext, not TLS: this destination requires TLS"),
        "{e}"
    );
}

#[test]
fn a_tls_source_is_told_when_the_destination_answers_in_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = Address::Tcp(l.local_addr().unwrap().to_string());
    let stls = Arc::new(SourceTls::new(&TlsFiles::in_dir(dir.path(), Side::Source), None).unwrap());
    let dialer = Dialer::new(at, Some(stls)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let (mut c, _) = l.accept().unwrap();
            let mut hello = [0u8; 64];
            let n = c.read(&mut hello).unwrap();
            assert!(
                looks_like_tls(&hello[..n]),
                "a ClientHello opens the connection"
            );
            c.write_all(b"FERRYMIG refused").unwrap();
        });
        let e = dialer.connect(WAIT).unwrap_err().to_string();
        assert!(e.contains("answered in plaintext, not TLS"), "{e}");
    });
}

#[test]
fn missing_files_and_unix_sockets_without_a_name_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = SourceTls::new(&TlsFiles::in_dir(dir.path(), Side::Source), None).unwrap_err();
    assert!(e.to_string().contains("ca-cert.pem"), "{e}");
    tls_dir(&Ca::new("ferry test CA").unwrap(), dir.path());
    let tls = Arc::new(SourceTls::new(&TlsFiles::in_dir(dir.path(), Side::Source), None).unwrap());
    let e = Dialer::new(Address::Unix("/run/x.sock".into()), Some(tls.clone())).unwrap_err();
    assert!(e.to_string().contains("add --tls-name"), "{e}");
    let e = SourceTls::new(
        &TlsFiles::in_dir(dir.path(), Side::Source),
        Some("no name!"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("is not a TLS name"), "{e}");
    let name = tls
        .name_for(&Address::Tcp("[::1]:4444".into()))
        .unwrap()
        .to_str()
        .into_owned();
    assert_eq!(name, "::1");
}
