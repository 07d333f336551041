//! How `ferry` ends: its exit statuses (README.md has the same table), the error that ends it
//! with [`USAGE`], and how an error is said ([`error_text`]). Below every command, which all
//! end through it.

/// The command did what it was asked (a migration completed).
pub const COMPLETED: u8 = 0;
/// It failed (a migration failed; the source keeps running unless it was handed over).
pub const FAILED: u8 = 1;
/// Bad flags or values, refused before anything was done (clap's own status for bad flags).
pub const USAGE: u8 = 2;
/// The migration was cancelled (`ferry cancel` or Ctrl-C; it ended in phase `cancelled`).
pub const CANCELLED: u8 = 3;
/// `ferry migrate` stopped following on Ctrl-C or SIGTERM a migration that could not be
/// cancelled any more (postcopy): it goes on in the VMM.
pub const DETACHED: u8 = 4;

/// A value the CLI refuses before doing anything: exit status 2, like clap's own errors.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// An error and its causes in one line, each cause once: most of ferry's errors already say
/// their cause's words (`cannot listen on ...: Address in use`), which anyhow's `{:#}` would
/// print a second time.
/// Whether `e` refuses a value the user gave before anything was done: the CLI's own
/// [`UsageError`], a VM refused for its configuration, or an address that is not one.
pub fn is_usage(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<UsageError>()
            || cause
                .downcast_ref::<ferry_vmm::VmmError>()
                .is_some_and(ferry_vmm::VmmError::is_usage)
            || matches!(
                cause.downcast_ref::<ferry_migrate::transport::AddressError>(),
                Some(ferry_migrate::transport::AddressError::Syntax(_))
            )
    })
}

pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if out.contains(&said) {
            continue;
        }
        if !out.is_empty() {
            out += ": ";
        }
        out += &said;
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_says_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let said = io.to_string();
        let e = anyhow::Error::new(ferry_vmm::api::client::ApiClientError::Connect {
            path: "x.sock".into(),
            source: io,
        })
        .context("could not start");
        let text = super::error_text(&e);
        assert_eq!(text.matches(&said).count(), 1, "{text}");
        assert!(
            text.starts_with("could not start: no ferry VM is listening on x.sock"),
            "{text}"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(super::error_text(&plain), "outer: inner");
    }
}
