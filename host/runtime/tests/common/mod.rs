//! Helpers for tests that load this build's plugin dylibs (the CLI's tests include this file
//! too).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

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

/// The file name of crate `crate_name`'s dylib on this platform.
pub fn dylib_name(crate_name: &str) -> String {
    format!(
        "{}{crate_name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// This build's dylib of crate `crate_name` (run `cargo build --workspace` first).
pub fn dylib(crate_name: &str) -> PathBuf {
    let name = dylib_name(crate_name);
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

/// This checkout's root (the including crates, `host/runtime` and `tests/cli`, sit two levels
/// below it).
pub fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// Where workspaces outside kvplug's are built (the backend template's build shares it).
pub fn out_of_tree_target() -> PathBuf {
    checkout().join("target/out-of-tree/target")
}

/// Builds the workspace of `manifest` out of tree, offline, with `args`; panics with cargo's
/// output if it fails.
pub fn build_out_of_tree(manifest: &Path, args: &[&str]) {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["build", "--offline", "--manifest-path"])
        .arg(manifest)
        .args(args)
        .env("CARGO_TARGET_DIR", out_of_tree_target())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "building {} failed:\n{}",
        manifest.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The dylib of the loader fixture `crate_name` (`host/runtime/tests/fixtures`, a workspace of its
/// own), built on first use in this process.
pub fn fixture(crate_name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        build_out_of_tree(
            &checkout().join("host/runtime/tests/fixtures/Cargo.toml"),
            &["--locked"],
        )
    });
    out_of_tree_target()
        .join("debug")
        .join(dylib_name(crate_name))
}
