//! TLS 1.3 with mutual authentication, as one more transport: a [`TlsStream`] is a
//! [`Stream`] over any other stream (TCP, a Unix socket), so the engine neither knows nor
//! cares. rustls with its ring provider does the protocol; this module owns the files, the
//! policy and one stream that several threads share.
//!
//! Policy:
//! - Both ends present a certificate signed by one CA (`--tls-dir`), and each checks the
//!   other's against that CA. TLS 1.3 only, no session tickets: a migration's connections are
//!   few and each handshakes once.
//! - The source checks that the destination's certificate carries the name it connected to
//!   (the host of `tcp:HOST:PORT`, or `--tls-name`); the destination may restrict the sources
//!   it takes to certificates carrying one of the names in `--tls-allow` (QEMU's tls-authz).
//! - A destination finishes the handshake before it reads a byte of the hello, so a peer that
//!   fails any check is refused before any migration byte is read.
//!
//! A connection is read by one thread while another writes (the [`Stream`] contract), but a
//! TLS connection is one state machine: [`TlsStream`] keeps it under a lock that is held only
//! to encrypt or decrypt, never across a socket read or write. Ciphertext is written under a
//! second lock, in the order it was sealed, so records keep their sequence numbers.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, ClientConfig, ClientConnection, Connection, DigitallySignedStruct,
    DistinguishedName, RootCertStore, ServerConfig, ServerConnection, SignatureScheme,
};

use super::stream::{Listener, Stream};

/// The CA certificate in a `--tls-dir`.
pub const CA_FILE: &str = "ca-cert.pem";

/// Which end of a migration a TLS configuration is for: the source connects (the TLS
/// client), the destination listens (the TLS server).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

/// Where one side's CA, certificate and private key are (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// The files of a `--tls-dir`, laid out as QEMU's and libvirt's x509 directories are:
    /// `ca-cert.pem`, `server-cert.pem` and `server-key.pem` for the destination,
    /// `client-cert.pem` and `client-key.pem` for the source, so that one directory copied to
    /// both hosts serves either end.
    pub fn in_dir(dir: &Path, side: Side) -> TlsFiles {
        let role = match side {
            Side::Source => "client",
            Side::Destination => "server",
        };
        TlsFiles {
            ca: dir.join(CA_FILE),
            cert: dir.join(format!("{role}-cert.pem")),
            key: dir.join(format!("{role}-key.pem")),
        }
    }
}

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "cannot read the TLS {what} {}: {detail}; a --tls-dir holds ca-cert.pem, server-cert.pem and server-key.pem (destination), client-cert.pem and client-key.pem (source)",
        path.display()
    )]
    Read {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error(
        "the TLS {what} {} is not usable: {detail}; give a PEM file a CA issued for this side",
        path.display()
    )]
    Unusable {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error(
        "'{0}' is not a TLS name; write a DNS name or an IP address that the peer's certificate carries"
    )]
    Name(String),
    #[error("TLS to {0} needs the name the destination's certificate carries; add --tls-name NAME")]
    NeedsName(String),
}

/// TLS 1.3 with the ring provider: no C toolchain beyond what the build already has (aws-lc
/// would want cmake), AES-GCM with the CPU's instructions.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = |detail: String| TlsError::Read {
        what,
        path: path.into(),
        detail,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| read(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| read(e.to_string()))?;
    if certs.is_empty() {
        return Err(read("no PEM certificate in it".into()));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Read {
        what: "private key",
        path: path.into(),
        detail: e.to_string(),
    })
}

fn read_roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs("CA certificate", path)? {
        roots.add(cert).map_err(|e| TlsError::Unusable {
            what: "CA certificate",
            path: path.into(),
            detail: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

pub(super) fn parse_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(name.to_string()).map_err(|_| TlsError::Name(name.into()))
}

/// A source's TLS: its certificate, the CA it trusts, and the name it expects (or the host it
/// connects to).
pub struct SourceTls {
    config: Arc<ClientConfig>,
    pub(super) name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for SourceTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceTls")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl SourceTls {
    /// Reads `files`; `name` overrides the name the destination's certificate must carry
    /// (by default the host of the address connected to).
    pub fn new(files: &TlsFiles, name: Option<&str>) -> Result<SourceTls, TlsError> {
        let roots = read_roots(&files.ca)?;
        let certs = read_certs("certificate", &files.cert)?;
        let key = read_key(&files.key)?;
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("the ring provider speaks TLS 1.3")
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| TlsError::Unusable {
                what: "certificate and key",
                path: files.cert.clone(),
                detail: e.to_string(),
            })?;
        Ok(SourceTls {
            config: Arc::new(config),
            name: name.map(parse_name).transpose()?,
        })
    }

    /// Runs the handshake over `stream` as the source, within `timeout`; the destination's
    /// certificate must carry `name`.
    pub fn secure(
        &self,
        stream: Box<dyn Stream>,
        name: ServerName<'static>,
        timeout: Duration,
    ) -> io::Result<TlsStream> {
        let conn = ClientConnection::new(self.config.clone(), name).map_err(io::Error::other)?;
        let tls = TlsStream::new(stream, conn.into(), Side::Source)?;
        tls.socket().set_read_timeout(Some(timeout))?;
        tls.socket().set_write_timeout(Some(timeout))?;
        tls.handshake()?;
        tls.socket().set_read_timeout(None)?;
        tls.socket().set_write_timeout(None)?;
        Ok(tls)
    }
}

/// A destination's TLS: its certificate, the CA its sources' certificates must chain to, and
/// the names it allows.
pub struct DestinationTls {
    config: Arc<ServerConfig>,
}

impl std::fmt::Debug for DestinationTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DestinationTls").finish_non_exhaustive()
    }
}

impl DestinationTls {
    /// Reads `files`; with `allow` not empty, a source's certificate must also carry one of
    /// those names (DNS names or IP addresses).
    pub fn new(files: &TlsFiles, allow: &[String]) -> Result<DestinationTls, TlsError> {
        let roots = read_roots(&files.ca)?;
        let certs = read_certs("certificate", &files.cert)?;
        let key = read_key(&files.key)?;
        let chain = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TlsError::Unusable {
                what: "CA certificate",
                path: files.ca.clone(),
                detail: e.to_string(),
            })?;
        let verifier = Arc::new(AllowedNames {
            chain,
            allow: allow
                .iter()
                .map(|n| parse_name(n))
                .collect::<Result<_, _>>()?,
        });
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("the ring provider speaks TLS 1.3")
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| TlsError::Unusable {
                what: "certificate and key",
                path: files.cert.clone(),
                detail: e.to_string(),
            })?;
        // No resumption: each connection handshakes once, and a ticket would be one more
        // record the source's reader has to take in after the handshake.
        config.send_tls13_tickets = 0;
        Ok(DestinationTls {
            config: Arc::new(config),
        })
    }

    /// `inner`, with every connection it accepts wrapped in TLS. The handshake runs on the
    /// thread that first reads the connection (the destination's hello screen), not on the
    /// accepting thread, so a slow or silent peer holds up no other.
    pub fn listener(self: &Arc<Self>, inner: Box<dyn Listener>) -> Box<dyn Listener> {
        Box::new(TlsListener {
            inner,
            tls: self.clone(),
        })
    }
}

/// The chain check of rustls's WebPKI verifier, then the destination's list of names.
#[derive(Debug)]
struct AllowedNames {
    chain: Arc<dyn ClientCertVerifier>,
    allow: Vec<ServerName<'static>>,
}

/// A source certificate that chains to the CA but carries none of the allowed names.
#[derive(Debug, thiserror::Error)]
#[error(
    "the source's certificate carries {carried}, none of the names this destination allows ({allowed}); add its name to --tls-allow or give the source a certificate with an allowed name"
)]
struct NotAllowed {
    carried: String,
    allowed: String,
}

impl ClientCertVerifier for AllowedNames {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .chain
            .verify_client_cert(end_entity, intermediates, now)?;
        if self.allow.is_empty() {
            return Ok(verified);
        }
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        if self
            .allow
            .iter()
            .any(|n| cert.verify_is_valid_for_subject_name(n).is_ok())
        {
            return Ok(verified);
        }
        let carried: Vec<&str> = cert.valid_dns_names().collect();
        let refusal = NotAllowed {
            carried: if carried.is_empty() {
                "no DNS name".into()
            } else {
                carried.join(", ")
            },
            allowed: self
                .allow
                .iter()
                .map(|n| n.to_str().into_owned())
                .collect::<Vec<_>>()
                .join(", "),
        };
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            rustls::OtherError(Arc::new(refusal)),
        )))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

#[derive(Debug)]
struct TlsListener {
    inner: Box<dyn Listener>,
    tls: Arc<DestinationTls>,
}

impl Listener for TlsListener {
    fn accept_within(&self, wait: Duration) -> io::Result<Option<Box<dyn Stream>>> {
        let Some(stream) = self.inner.accept_within(wait)? else {
            return Ok(None);
        };
        let conn = ServerConnection::new(self.tls.config.clone()).map_err(io::Error::other)?;
        Ok(Some(Box::new(TlsStream::new(
            stream,
            conn.into(),
            Side::Destination,
        )?)))
    }

    fn local(&self) -> String {
        self.inner.local()
    }
}

/// Longest a shutdown waits to write its close_notify to a peer that does not read.
const CLOSE_NOTIFY_WAIT: Duration = Duration::from_millis(50);

/// The first byte of a TLS handshake record (RFC 8446 §5.1: content type 22).
const HANDSHAKE_RECORD: u8 = 0x16;
/// The first byte of a TLS alert record (content type 21).
const ALERT_RECORD: u8 = 0x15;

/// Whether `bytes` open a TLS handshake (a ClientHello or ServerHello record): content type
/// 22, protocol version 3.x. A destination without TLS uses this to name what it was sent.
pub fn looks_like_tls(bytes: &[u8]) -> bool {
    bytes.len() >= 2 && bytes[0] == HANDSHAKE_RECORD && bytes[1] == 3
}

/// Ciphertext read from the socket and not yet handed to rustls.
struct Incoming {
    socket: Box<dyn Stream>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Nothing came from the peer yet: its first byte tells TLS from plaintext.
    first: bool,
}

/// Ciphertext sealed and not yet written.
struct Outgoing {
    socket: Box<dyn Stream>,
    buf: Vec<u8>,
}

struct Shared {
    conn: Mutex<Connection>,
    incoming: Mutex<Incoming>,
    outgoing: Mutex<Outgoing>,
    /// For shutdowns and timeouts: a third handle, never read or written (a lock only to make
    /// it shareable; no call on it blocks).
    socket: Mutex<Box<dyn Stream>>,
    side: Side,
    peer: String,
}

/// One TLS connection; its clones ([`Stream::try_clone_stream`]) share it.
#[derive(Clone)]
pub struct TlsStream(Arc<Shared>);

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream")
            .field("peer", &self.0.peer)
            .field("side", &self.0.side)
            .finish_non_exhaustive()
    }
}

/// Ciphertext read from the socket at a time: four full records (16 KiB of plaintext each,
/// RFC 8446 §5.1) per system call.
const READ_CHUNK: usize = 4 * (16 * 1024 + 256);

impl TlsStream {
    fn new(socket: Box<dyn Stream>, conn: Connection, side: Side) -> io::Result<TlsStream> {
        let peer = socket.peer();
        Ok(TlsStream(Arc::new(Shared {
            conn: Mutex::new(conn),
            incoming: Mutex::new(Incoming {
                socket: socket.try_clone_stream()?,
                buf: vec![0; READ_CHUNK].into_boxed_slice(),
                start: 0,
                end: 0,
                first: true,
            }),
            outgoing: Mutex::new(Outgoing {
                socket: socket.try_clone_stream()?,
                buf: Vec::new(),
            }),
            socket: Mutex::new(socket),
            side,
            peer,
        })))
    }

    fn socket(&self) -> std::sync::MutexGuard<'_, Box<dyn Stream>> {
        self.0.socket.lock().unwrap()
    }

    /// Drives the handshake to its end (the source's side; a destination's runs inside its
    /// first read).
    fn handshake(&self) -> io::Result<()> {
        let mut incoming = self.0.incoming.lock().unwrap();
        loop {
            self.flush_sealed(&mut self.0.outgoing.lock().unwrap())?;
            if !self.0.conn.lock().unwrap().is_handshaking() {
                return Ok(());
            }
            self.take_in(&mut incoming)?;
        }
    }

    /// Writes whatever rustls has sealed (handshake messages, alerts, records).
    fn flush_sealed(&self, out: &mut Outgoing) -> io::Result<()> {
        {
            let mut conn = self.0.conn.lock().unwrap();
            while conn.wants_write() {
                conn.write_tls(&mut out.buf)?;
            }
        }
        let Outgoing { socket, buf } = out;
        let written = socket.write_all(buf);
        buf.clear();
        written
    }

    /// Hands rustls the ciphertext already read, or reads more from the socket (blocking, or
    /// up to the read timeout) and hands that; writes what rustls answers during a
    /// handshake. Returns after one step, with plaintext possibly ready.
    fn take_in(&self, incoming: &mut Incoming) -> io::Result<()> {
        if incoming.start == incoming.end {
            let Incoming { socket, buf, .. } = incoming;
            let n = socket.read(buf)?;
            if incoming.first && n > 0 {
                incoming.first = false;
                self.check_first_byte(buf[0])?;
            }
            incoming.start = 0;
            incoming.end = n;
        }
        let mut conn = self.0.conn.lock().unwrap();
        let mut pending = &incoming.buf[incoming.start..incoming.end];
        let taken = conn.read_tls(&mut pending)?;
        incoming.start += taken;
        let processed = conn.process_new_packets();
        let handshaking = conn.is_handshaking();
        let answer = conn.wants_write();
        drop(conn);
        if answer {
            // An alert explaining a failure, or the next handshake flight. After the
            // handshake, a writer may hold the outgoing lock while it waits for the peer: its
            // next write carries what rustls sealed here, so this never waits for it.
            if handshaking || processed.is_err() {
                let _ = self.flush_sealed(&mut self.0.outgoing.lock().unwrap());
            } else if let Ok(mut out) = self.0.outgoing.try_lock() {
                self.flush_sealed(&mut out)?;
            }
        }
        processed.map(|_| ()).map_err(|e| self.explain(e))
    }

    /// A peer that does not speak TLS is named at its first byte, before rustls would call it
    /// a corrupt message.
    fn check_first_byte(&self, byte: u8) -> io::Result<()> {
        if byte == HANDSHAKE_RECORD || byte == ALERT_RECORD {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            match self.0.side {
                Side::Destination => {
                    "the source sent plaintext, not TLS: this destination requires TLS; start the source's migration with --tls-dir (or the destination without it)"
                }
                Side::Source => {
                    "the destination answered in plaintext, not TLS: it does not use TLS; start it with ferry run --tls-dir (or migrate without --tls-dir)"
                }
            },
        ))
    }

    /// A rustls error as a sentence that says which side refused what, and what to change.
    fn explain(&self, e: rustls::Error) -> io::Error {
        use rustls::Error as E;
        let (us, them) = match self.0.side {
            Side::Source => ("source", "destination"),
            Side::Destination => ("destination", "source"),
        };
        let why = match &e {
            // A CA of the same name but another key reads as a bad signature.
            E::InvalidCertificate(
                CertificateError::UnknownIssuer | CertificateError::BadSignature,
            ) => format!(
                "the {them}'s certificate is not signed by this {us}'s CA ({CA_FILE}); give both sides certificates from one CA"
            ),
            E::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            ) => format!(
                "the {them}'s certificate does not carry the name this {us} connected to ({e}); connect by a name it carries, or name it with --tls-name"
            ),
            E::InvalidCertificate(CertificateError::Other(other)) => other.to_string(),
            E::NoCertificatesPresented => format!(
                "the {them} presented no certificate; TLS here is mutual, so the {them} needs its own (--tls-dir)"
            ),
            E::AlertReceived(alert) => format!(
                "the {them} refused this {us}'s TLS (alert: {alert:?}); its log says why: a certificate not signed by its CA, or a name it does not allow (--tls-allow)"
            ),
            _ => format!("TLS failed: {e}"),
        };
        io::Error::new(io::ErrorKind::InvalidData, why)
    }
}

impl Read for TlsStream {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let mut incoming = self.0.incoming.lock().unwrap();
        loop {
            match self.0.conn.lock().unwrap().reader().read(out) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                done => return done,
            }
            self.take_in(&mut incoming)?;
        }
    }
}

impl Write for TlsStream {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut out = self.0.outgoing.lock().unwrap();
        let n = self.0.conn.lock().unwrap().writer().write(data)?;
        self.flush_sealed(&mut out)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut out = self.0.outgoing.lock().unwrap();
        self.flush_sealed(&mut out)?;
        out.socket.flush()
    }
}

impl Stream for TlsStream {
    fn try_clone_stream(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.clone()))
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        if how != Shutdown::Read {
            // A close_notify first, so that the peer reads a clean end; skipped when a writer
            // is blocked, since a shutdown must never wait (it is how blocked threads are
            // woken). A peer that stopped reading gets CLOSE_NOTIFY_WAIT for it, not the write
            // timeout: severing N stalled connections must not take N peer timeouts. The write
            // side closes right after, so its timeout is not put back.
            if let Ok(mut out) = self.0.outgoing.try_lock() {
                self.0.conn.lock().unwrap().send_close_notify();
                let _ = self.socket().set_write_timeout(Some(CLOSE_NOTIFY_WAIT));
                let _ = self.flush_sealed(&mut out);
            }
        }
        self.socket().shutdown(how)
    }
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket().set_read_timeout(timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket().set_write_timeout(timeout)
    }
    fn peer(&self) -> String {
        format!("{} (TLS)", self.0.peer)
    }
    fn set_low_latency(&self) -> io::Result<()> {
        self.socket().set_low_latency()
    }
    fn set_urgent(&self) -> io::Result<()> {
        self.socket().set_urgent()
    }
    fn set_keepalive(&self, within: Option<Duration>) -> io::Result<()> {
        self.socket().set_keepalive(within)
    }
    fn hung_up(&self) -> bool {
        self.socket().hung_up()
    }
}

#[cfg(any(test, feature = "pki"))]
pub mod pki;

#[cfg(test)]
mod tests;
