//! Helpers shared by the host's integration tests.

use std::path::PathBuf;

/// The target directory holding this build's binaries and plugin dylibs.
pub fn target_dir() -> PathBuf {
    // target/<profile>/deps/<test binary>
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}
