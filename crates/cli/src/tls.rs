//! TLS on the command line: the flags `ferry run --incoming` and `ferry migrate` share, and
//! `ferry tls generate`, which writes a `--tls-dir` to try TLS with.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ferry_migrate::transport::tls::pki::Ca;
use ferry_migrate::transport::tls::{Side, TlsFiles};

use crate::UsageError;

/// Where this side's CA, certificate and key are: a directory, or each file by itself (a file
/// given by itself overrides the directory's).
#[derive(Clone, Debug, Default, Args)]
pub struct TlsArgs {
    /// Run every connection of the migration over TLS with mutual authentication, with the
    /// certificates in DIR: ca-cert.pem, and server-cert.pem and server-key.pem (destination)
    /// or client-cert.pem and client-key.pem (source). `ferry tls generate DIR` makes one.
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// The CA certificate that the peer's certificate must chain to (PEM).
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// This side's certificate (PEM, with its chain).
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// This side's private key (PEM).
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The files for `side`, or `None` when no TLS flag was given.
    pub fn files(&self, side: Side) -> Result<Option<TlsFiles>, UsageError> {
        let from_dir = self.tls_dir.as_deref().map(|d| TlsFiles::in_dir(d, side));
        let pick = |own: &Option<PathBuf>, dir: Option<&PathBuf>, flag: &str| {
            own.clone().or_else(|| dir.cloned()).ok_or_else(|| {
                UsageError(format!(
                    "TLS needs {flag} too (or --tls-dir with all three files in it)"
                ))
            })
        };
        if from_dir.is_none()
            && self.tls_ca.is_none()
            && self.tls_cert.is_none()
            && self.tls_key.is_none()
        {
            return Ok(None);
        }
        Ok(Some(TlsFiles {
            ca: pick(&self.tls_ca, from_dir.as_ref().map(|f| &f.ca), "--tls-ca")?,
            cert: pick(
                &self.tls_cert,
                from_dir.as_ref().map(|f| &f.cert),
                "--tls-cert",
            )?,
            key: pick(
                &self.tls_key,
                from_dir.as_ref().map(|f| &f.key),
                "--tls-key",
            )?,
        }))
    }
}

/// The files with absolute paths, for a VMM whose working directory may differ.
pub fn absolute(files: TlsFiles) -> TlsFiles {
    let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    TlsFiles {
        ca: abs(files.ca),
        cert: abs(files.cert),
        key: abs(files.key),
    }
}

#[derive(Debug, Subcommand)]
pub enum TlsCommand {
    /// Make a CA and certificates for both ends of a migration in DIR (a --tls-dir): for
    /// trying TLS out; a deployment brings certificates from its own CA.
    Generate(GenerateArgs),
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The directory to write ca-cert.pem, server-*.pem and client-*.pem into (and nothing
    /// else; ferry keeps no CA key, so issue more certificates with your own CA).
    dir: PathBuf,
    /// A name the destination's certificate carries: the host sources connect to (DNS name
    /// or IP address); repeat for more.
    #[arg(long = "destination-name", value_name = "NAME", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
    destination_names: Vec<String>,
    /// A name the source's certificate carries, for the destination's --tls-allow; repeat
    /// for more.
    #[arg(long = "source-name", value_name = "NAME", default_values_t = ["ferry-source".to_string()])]
    source_names: Vec<String>,
}

pub fn tls(cmd: &TlsCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        TlsCommand::Generate(args) => generate(args),
    }
}

fn generate(args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    // A name of its own, so that two generated CAs are never taken for one another.
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let ca = Ca::new(&format!("ferry migration CA {stamp:x}"))?;
    ca.write_dir(&args.dir, &args.destination_names, &args.source_names)?;
    eprintln!(
        "ferry: wrote a CA and certificates to {} (destination: {}; source: {})",
        args.dir.display(),
        args.destination_names.join(", "),
        args.source_names.join(", ")
    );
    eprintln!(
        "ferry: use them with ferry run --incoming ... --tls-dir {0} and ferry migrate ... --tls-dir {0}",
        args.dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_or_three_files_or_nothing() {
        let none = TlsArgs::default();
        assert_eq!(none.files(Side::Source).unwrap(), None);
        let dir = TlsArgs {
            tls_dir: Some("/t".into()),
            tls_key: Some("/k.pem".into()),
            ..TlsArgs::default()
        };
        let f = dir.files(Side::Destination).unwrap().unwrap();
        assert_eq!(f.ca, PathBuf::from("/t/ca-cert.pem"));
        assert_eq!(f.cert, PathBuf::from("/t/server-cert.pem"));
        assert_eq!(
            f.key,
            PathBuf::from("/k.pem"),
            "a file by itself overrides the directory's"
        );
        let partial = TlsArgs {
            tls_ca: Some("/ca.pem".into()),
            ..TlsArgs::default()
        };
        let e = partial.files(Side::Source).unwrap_err().0;
        assert!(e.contains("--tls-cert"), "{e}");
    }
}
