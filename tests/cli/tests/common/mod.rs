//! Helpers shared by the end-to-end tests: the runtime tests' dylib helpers and the binary.
#![allow(unused_imports)]

#[path = "../../../../host/runtime/tests/common/mod.rs"]
mod dylibs;
pub use dylibs::*;

pub mod server;

/// This build's `kvplug` binary (`make build`, or `cargo build --workspace --bins`, builds it
/// beside the plugins: this crate only tests it).
#[allow(dead_code)]
pub fn kvplug_bin() -> std::path::PathBuf {
    let bin = target_dir().join(format!("kvplug{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace --bins` first",
        bin.display()
    );
    bin
}

/// A plugins directory holding only the cpu plugin (so tests load nothing else).
#[allow(dead_code)]
pub fn cpu_plugins() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        target_dir().join("libkvplug_cpu.so"),
        dir.path().join("libkvplug_cpu.so"),
    )
    .expect("run `cargo build --workspace` first");
    dir
}

/// The largest peak RSS of this process's waited-for children (and theirs), in KiB.
#[allow(dead_code)]
pub fn peak_child_rss_kib() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: initialised by the successful call.
    unsafe { usage.assume_init() }.ru_maxrss
}
