//! Where received pages land by default on this VMM's destination: through guest RAM's
//! mapping or through its memfd (the engine's `PageLanding`).

use ferry_migrate::PageLanding;

/// How pages land by default (`PageLanding` has the measurements): through the mapping into
/// populated RAM, or when several channels write at once (their `pwrite`s into one shmem file
/// would take turns on its inode lock); through the file for one channel into sparse RAM.
pub(crate) fn landing_for(populated: bool, channels: u16) -> PageLanding {
    if populated || channels > 1 {
        PageLanding::Mapping
    } else {
        PageLanding::File
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_channel_into_sparse_ram_writes_the_file_and_everything_else_the_mapping() {
        assert_eq!(landing_for(false, 1), PageLanding::File);
        assert_eq!(landing_for(false, 2), PageLanding::Mapping);
        assert_eq!(landing_for(true, 1), PageLanding::Mapping);
        assert_eq!(landing_for(true, 4), PageLanding::Mapping);
    }
}
