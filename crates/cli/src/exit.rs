//! How `ferry` ends: its exit statuses (README.md has the same table) and the error that
//! ends it with [`USAGE`]. Below every command, which all end through it.

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
