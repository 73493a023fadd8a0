//! Helpers for tests that load this build's plugin dylibs (the CLI's tests include this file
//! too).
#![allow(dead_code)]

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

/// This build's dylib of crate `crate_name` (run `cargo build --workspace` first).
pub fn dylib(crate_name: &str) -> PathBuf {
    let name = format!(
        "{}{crate_name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let p = target_dir().join(&name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// A fresh plugins directory holding copies of `files` (source, name in the dir).
pub fn plugins_dir(files: &[(PathBuf, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (src, name) in files {
        std::fs::copy(src, dir.path().join(name)).unwrap();
    }
    dir
}

/// The cpu plugin, named as in a plugins directory.
pub fn cpu() -> (PathBuf, &'static str) {
    (dylib("kvplug_cpu"), "libkvplug_cpu.so")
}
