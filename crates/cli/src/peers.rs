//! Who on this host may reach a VMM's sockets and take part in a local handover: `--allow-uid`
//! (`ferry migrate` and `ferry run --incoming`) and `--incoming-socket-mode` (`ferry run`), and
//! the octal modes they and `--api-socket-mode` are written in.

use clap::Args;

use crate::UsageError;

/// `--allow-uid`, on both sides of a local handover.
#[derive(Debug, Args)]
pub struct AllowUidArgs {
    /// With a local handover (ferry migrate --local; ferry run --incoming unix:PATH): also hand
    /// guest RAM to, or take it from, a process of this uid (repeat for more). By default only
    /// a process of this VMM's own (effective) uid may: the uid on the other end is read from
    /// the socket (SO_PEERCRED) before any descriptor moves, and a stranger is refused.
    #[arg(long = "allow-uid", value_name = "UID")]
    pub allow_uid: Vec<u32>,
}

/// A destination's incoming Unix socket and who may hand a guest over to it.
#[derive(Debug, Args)]
pub struct IncomingSocketArgs {
    /// With --incoming unix:PATH (or --then-incoming): the socket's permission bits, in
    /// octal, set before anyone can connect, whatever the umask [default: 600, only this
    /// user]. Whoever can connect can hand this VMM a guest.
    #[arg(long, value_name = "OCTAL", value_parser = parse_mode)]
    pub incoming_socket_mode: Option<u32>,
    #[command(flatten)]
    pub allow: AllowUidArgs,
}

impl IncomingSocketArgs {
    /// The incoming socket's mode.
    pub fn socket_mode(&self) -> u32 {
        self.incoming_socket_mode
            .unwrap_or(ferry_migrate::transport::DEFAULT_SOCKET_MODE)
    }

    /// Refuses these flags on a `ferry run` that waits for no migration.
    pub fn check(&self, waits: Waits) -> Result<(), UsageError> {
        let given = self.incoming_socket_mode.is_some() || !self.allow.allow_uid.is_empty();
        match (given, waits) {
            (true, Waits::Never) => Err(UsageError(
                "--incoming-socket-mode and --allow-uid are for a destination; give --incoming (or --then-incoming) too"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

/// Whether a `ferry run` waits for a migration at some point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waits {
    /// --incoming or --then-incoming.
    ForAMigration,
    Never,
}

/// An octal permission mode such as `600` or `0660`.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!(
            "{s:?} is not a permission mode: give octal digits, such as 600 or 660"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_octal_permission_bits() {
        assert_eq!(parse_mode("600"), Ok(0o600));
        assert_eq!(parse_mode("0660"), Ok(0o660));
        assert!(parse_mode("800").is_err());
        assert!(parse_mode("1777").is_err());
    }
}
