//! A small PKI for migrations: a CA and the certificates a `--tls-dir` holds, made with rcgen
//! (ECDSA P-256). For trying TLS out and for tests; a deployment brings certificates from its
//! own CA, laid out as [`super::TlsFiles::in_dir`] says.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use super::{CA_FILE, Side, TlsFiles};

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("cannot make a certificate: {0}")]
    Make(#[from] rcgen::Error),
    #[error("cannot write {}: {source}; choose a directory this user can write", path.display())]
    Write {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A certificate authority held in memory.
#[derive(Debug)]
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its private key, in PEM.
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert: String,
    pub key: String,
}

impl Ca {
    /// A new CA whose certificate's common name is `name`.
    pub fn new(name: &str) -> Result<Ca, PkiError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Ok(Ca {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate()?)?,
        })
    }

    /// The CA's certificate in PEM.
    pub fn cert(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses, as subject alternative names),
    /// good for either end of a connection.
    pub fn issue(&self, names: &[String]) -> Result<Issued, PkiError> {
        let mut params = CertificateParams::new(names.to_vec())?;
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, first);
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// Writes a `--tls-dir` into `dir`: this CA's certificate, a destination certificate for
    /// `destination` names and a source certificate for `source` names. Keys are written
    /// readable by their owner only.
    pub fn write_dir(
        &self,
        dir: &Path,
        destination: &[String],
        source: &[String],
    ) -> Result<(), PkiError> {
        write(&dir.join(CA_FILE), &self.cert(), CERT_MODE)?;
        for (side, names) in [(Side::Destination, destination), (Side::Source, source)] {
            let files = TlsFiles::in_dir(dir, side);
            let issued = self.issue(names)?;
            write(&files.cert, &issued.cert, CERT_MODE)?;
            write(&files.key, &issued.key, KEY_MODE)?;
        }
        Ok(())
    }
}

/// A certificate's permission bits: anyone may read what is public.
const CERT_MODE: u32 = 0o644;
/// A private key's: its owner alone.
const KEY_MODE: u32 = 0o600;

/// Writes `text` into a new file at `path` with permission bits `mode`.
fn write(path: &Path, text: &str, mode: u32) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| PkiError::Write {
        path: path.into(),
        source,
    };
    std::fs::create_dir_all(path.parent().unwrap_or(Path::new("."))).map_err(err)?;
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(err)
}
