//! Finds MLX and builds the C++ bridge against it.
//!
//! MLX is looked up in `$MLX_DIR` (a prefix holding `include/mlx/mlx.h` and `lib/libmlx.*`),
//! else in the project-local install of `scripts/install-mlx.sh` (`.deps/mlx/mlx`). Found: the
//! bridge is compiled, libmlx linked with its directory as the rpath, and `cfg(mlx)` set.
//! Not found: the crate builds a plugin that loads and reports `unavailable: …` (the reason
//! is passed in `KVPLUG_MLX_MISSING`).

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(mlx)");
    println!("cargo::rerun-if-env-changed=MLX_DIR");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let prefix = match std::env::var_os("MLX_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => manifest.join("../../.deps/mlx/mlx"),
    };
    let lib_name = if cfg!(target_os = "macos") {
        "libmlx.dylib"
    } else {
        "libmlx.so"
    };
    let (header, lib) = (
        prefix.join("include/mlx/mlx.h"),
        prefix.join("lib").join(lib_name),
    );
    println!("cargo::rerun-if-changed={}", lib.display());
    if !header.is_file() || !lib.is_file() {
        println!(
            "cargo::rustc-env=KVPLUG_MLX_MISSING=MLX not found at {} (run scripts/install-mlx.sh, or set MLX_DIR to an MLX prefix) when this plugin was built",
            prefix.display()
        );
        return;
    }
    build_bridge(&prefix.canonicalize().expect("exists"));
}

fn build_bridge(prefix: &Path) {
    for f in ["src/ffi.rs", "src/bridge.cc", "src/bridge.h"] {
        println!("cargo::rerun-if-changed={f}");
    }
    cxx_build::bridge("src/ffi.rs")
        .file("src/bridge.cc")
        // -isystem: MLX's own headers are not this crate's warnings.
        .flag(format!("-isystem{}", prefix.join("include").display()))
        .std("c++20")
        .flag_if_supported("-Wno-deprecated-declarations")
        .compile("kvplug-mlx-bridge");
    let lib = prefix.join("lib");
    println!("cargo::rustc-link-search=native={}", lib.display());
    println!("cargo::rustc-link-lib=dylib=mlx");
    println!("cargo::rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo::rustc-cfg=mlx");
}
